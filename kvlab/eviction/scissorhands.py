"""Scissorhands (Liu et al., NeurIPS 2023; a Conf-KV seed-002 baseline): persistence of importance.
A ranked policy (:class:`~kvlab.eviction.ranked.RankedEviction`): it scores, the base selects.

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
head mean of its attention: the score is ``-low``. :meth:`Scissorhands.layer_keep` is one layer's
decision. ``per_layer=False`` is the earlier one-live-set ranking (the same slots on every layer,
by the layer mean of ``low``; needs a uniform cache), kept to measure the difference. ``sinks``
(default 0, as the paper): the first ``sinks`` positions are never evicted (StreamingLLM's attention sinks).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvlab.eviction.base import EvictView, RankedEviction, check_recent_budget, layer_block, layer_row
from kvlab.core.registry import register_eviction


@register_eviction("scissorhands", order=7, controls={"recent": "recent"})
@dataclass(frozen=True)
class Scissorhands(RankedEviction):
    budget: int
    recent: int
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β
    per_layer: bool = True
    sinks: int = 0

    needs_attention = True
    attention_below = True
    score_stat = "low"            # the statistic its ranker reads (the cache inspector's score; more = sooner evicted)

    def __post_init__(self):
        check_recent_budget(self.budget, self.recent, self.per_layer, self.sinks)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0) -> "Scissorhands":
        """``budget`` entries, the newest ``recent`` protected (default ``budget // 4``), ``sinks`` sinks."""
        return cls(budget=budget, recent=budget // 4 if recent is None else recent, sinks=sinks)

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        """Minus the layer's low counts: the fewer below-average queries, the higher."""
        return -layer_row(view, "low", layer).float()

    def scores_for(self, view: EvictView, layers: Sequence[int]):
        """:meth:`score` of ``layers`` at once (one negation of the ``low`` matrix when the view carries one)."""
        low = layer_block(view, "low", layers)
        return -low.float() if isinstance(low, torch.Tensor) else [-x.float() for x in low]

    def column_score(self, cols) -> torch.Tensor:
        """Over a resident bank's columns: minus the low counts, ``(L, B, C)``."""
        return -cols.stats["low"].float()

    def layer_keep(self, low: torch.Tensor, n: int, budget: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision from its low counts ``(n,)`` (its first ``sinks`` slots are sinks): the slots it keeps."""
        return self.rank_layer(-low.float(), n, budget, sinks)
