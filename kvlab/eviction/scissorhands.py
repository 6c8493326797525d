"""Scissorhands (Liu et al., NeurIPS 2023; a Conf-KV seed-002 baseline): persistence of importance.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.

A token that received little attention in the past is taken to stay unimportant. The cache counts,
per entry and layer, the measured queries that gave it less than the uniform share of their
head-mean attention (``attn["low"]``: ``Σ_i [ā_ij < 1/T_i]``, ``T_i`` = entries query ``i`` sees;
``attention_below``). Over ``budget``, every layer keeps its newest ``recent`` slots and, of its
others, the ``budget - recent`` with the FEWEST low counts of that layer (ties → newer) — i.e. the
entries most often below average in that layer go. As in the paper, each layer judges by its own
attention, so the layers keep different entries (``Keep.layers``; ``Keep.slots`` is layer 0's).

Differences from the paper, stated: the paper counts within a history window of the last ``w``
steps and drops ``m`` tokens at a time once a buffer fills; here the count runs over the entry's
whole measured life (``w = ∞``) and the cache is cut to ``budget`` on every over-budget step (the
matched-memory study's convention for fixed-budget families). Each layer's count is over the
head mean of its attention. :meth:`Scissorhands.layer_keep` is one layer's decision.
``per_layer=False`` is the earlier one-live-set ranking (the same slots on every layer, by the
layer mean of ``low``; needs a uniform cache), kept to measure the difference. ``sinks`` (default
0, as the paper): the first ``sinks`` positions are never evicted (StreamingLLM's attention sinks).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.eviction.base import (EvictView, Keep, check_bool, check_sinks, keep_all, layer_rows, layer_stat, nonneg_int,
                   over_budget, positive_int, protected_below, sink_counts, top_and_recent_layers, top_slots)
from kvlab.eviction.base import per_layer as layer_decision
from kvlab.core.registry import register_eviction


@register_eviction("scissorhands", order=7, controls={"recent": "recent"})
@dataclass(frozen=True)
class Scissorhands:
    budget: int
    recent: int
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β
    per_layer: bool = True
    sinks: int = 0

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)
        check_bool("per_layer", self.per_layer)
        check_sinks(self.sinks, "recent", self.recent, "budget", self.budget)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0) -> "Scissorhands":
        """``budget`` entries, the newest ``recent`` protected (default ``budget // 4``), ``sinks`` sinks."""
        return cls(budget=budget, recent=budget // 4 if recent is None else recent, sinks=sinks)

    @property
    def needs_attention(self) -> bool:
        return True

    @property
    def attention_below(self) -> bool:
        return True

    @property
    def score_stat(self) -> str:
        """The statistic its ranker reads (the cache inspector's score; more = sooner evicted)."""
        return "low"

    def layer_keep(self, low: torch.Tensor, n: int, budget: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision from its low counts ``(n,)`` (its first ``sinks`` slots are sinks): the slots it keeps."""
        if n <= budget:
            return tuple(range(n))
        cand = list(range(sinks, n - self.recent))
        kept = top_slots(-low[sinks: n - self.recent].float(), cand, budget - self.recent - sinks)
        return tuple(range(sinks)) + tuple(kept) + tuple(range(n - self.recent, n))

    def keep(self, view: EvictView) -> Keep:
        if not over_budget(view, self.budget, self.per_layer):
            return keep_all(view, budget=self.budget)
        if self.per_layer:
            kept = top_and_recent_layers([-low.float() for low in layer_rows(view, "low")],
                                         [len(p) for p in view.layer_positions], self.budget, self.recent,
                                         sink_counts(view, self.sinks))
            return layer_decision(kept, budget=self.budget)
        n = view.length
        low = layer_stat(view, "low").float().mean(0)     # (T,) one live set for all layers: the layer mean
        return Keep(self.layer_keep(low, n, self.budget, sink_counts(view, self.sinks)[0]), budget=self.budget)
