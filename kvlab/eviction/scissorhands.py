"""Scissorhands (Liu et al., NeurIPS 2023; a Conf-KV seed-002 baseline): persistence of importance.

A token that received little attention in the past is taken to stay unimportant. The cache counts,
per entry and layer, the measured queries that gave it less than the uniform share of their
head-mean attention (``attn["low"]``: ``Σ_i [ā_ij < 1/T_i]``, ``T_i`` = entries query ``i`` sees;
``attention_below``). Over ``budget``, the newest ``recent`` slots stay and, of the others, the
``budget - recent`` with the FEWEST low counts (layer mean; ties → newer) — i.e. the entries most
often below average go.

Differences from the paper, stated: the paper counts within a history window of the last ``w``
steps and drops ``m`` tokens at a time once a buffer fills; here the count runs over the entry's
whole measured life (``w = ∞``) and the cache is cut to ``budget`` on every over-budget step (the
matched-memory study's convention for fixed-budget families). One decision for all layers (layer
mean over the layers' ``attn["low"][l]``, :func:`~kvlab.eviction.base.layer_stat`);
:meth:`Scissorhands.layer_keep` is one layer's decision.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictView, Keep, keep_all, layer_stat, nonneg_int, positive_int, protected_below, top_slots


@dataclass(frozen=True)
class Scissorhands:
    budget: int
    recent: int
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)

    @property
    def needs_attention(self) -> bool:
        return True

    @property
    def attention_below(self) -> bool:
        return True

    def layer_keep(self, low: torch.Tensor, n: int, budget: int) -> tuple[int, ...]:
        """One layer's decision from its low counts ``(n,)``: the slots it keeps."""
        if n <= budget:
            return tuple(range(n))
        cand = list(range(n - self.recent))
        kept = top_slots(-low[: n - self.recent].float(), cand, budget - self.recent)
        return tuple(kept) + tuple(range(n - self.recent, n))

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.budget:
            return keep_all(view, budget=self.budget)
        low = layer_stat(view, "low").float().mean(0)     # (T,) one live set for all layers: the layer mean
        return Keep(self.layer_keep(low, n, self.budget), budget=self.budget)
