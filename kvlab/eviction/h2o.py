"""H2O: heavy hitters (accumulated attention) + a recent window, per layer as in the reference.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.eviction.base import (EvictView, Keep, check_bool, check_sinks, keep_all, layer_mean, layer_rows, layer_stat, nonneg_int,
                   over_budget, positive_int, protected_below, sink_counts, top_and_recent_layers, top_slots)
from kvlab.eviction.base import per_layer as layer_decision
from kvlab.core.registry import register_eviction


@register_eviction("h2o", order=2, controls={"recent": "recent"})
@dataclass(frozen=True)
class H2O:
    """Over ``budget`` entries, every layer ``l`` keeps its newest ``recent`` slots and the
    ``budget - recent`` other slots with the largest accumulated attention of that layer,
    ``acc_lj = Σ_steps mean_h A_l[h, j]`` (``attn["acc"][l]``; ties go to the newer slot), as the
    H2O reference scores each layer's own attention: the layers keep different entries
    (``Keep.layers``; ``Keep.slots`` is layer 0's). At most ``budget`` entries per layer.

    ``per_layer=False`` is the earlier one-live-set ranking, kept to measure the difference: the
    same slots on every layer, by ``acc`` averaged over the layers (needs a uniform cache).

    ``sinks`` (default 0, as the H2O reference): the first ``sinks`` positions are never evicted
    (StreamingLLM's attention sinks); they count against the budget."""

    budget: int
    recent: int
    ema_decay: float = 0.9        # unused by H2O's ranking; the cache's EMA needs a β
    per_layer: bool = True
    sinks: int = 0

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)
        check_bool("per_layer", self.per_layer)
        check_sinks(self.sinks, "recent", self.recent, "budget", self.budget)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0) -> "H2O":
        """``budget`` entries, the newest ``recent`` protected (default ``budget // 4``), ``sinks`` sinks."""
        return cls(budget=budget, recent=budget // 4 if recent is None else recent, sinks=sinks)

    @property
    def needs_attention(self) -> bool:
        return True

    def layer_keep(self, acc: torch.Tensor, n: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision from its ``acc`` ``(n,)`` (its first ``sinks`` slots are sinks): the slots it keeps."""
        if n <= self.budget:
            return tuple(range(n))
        cand = list(range(sinks, n - self.recent))
        kept = top_slots(acc[sinks: n - self.recent].float(), cand, self.budget - self.recent - sinks)
        return tuple(range(sinks)) + tuple(kept) + tuple(range(n - self.recent, n))

    def keep(self, view: EvictView) -> Keep:
        if not over_budget(view, self.budget, self.per_layer):
            return keep_all(view, budget=self.budget)
        if self.per_layer:
            kept = top_and_recent_layers(layer_rows(view, "acc"), [len(p) for p in view.layer_positions],
                                         self.budget, self.recent, sink_counts(view, self.sinks))
            return layer_decision(kept, budget=self.budget)
        n, s = view.length, sink_counts(view, self.sinks)[0]
        cand = list(range(s, n - self.recent))
        score = layer_mean(layer_stat(view, "acc"), cand)
        kept = top_slots(score, cand, self.budget - self.recent - s)
        return Keep(tuple(range(s)) + tuple(kept) + tuple(range(n - self.recent, n)), budget=self.budget)
