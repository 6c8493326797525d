"""Sliding window with attention sinks (StreamingLLM): keep the first few entries and the newest ones, a fixed
budget with no attention statistics. A policy decides only: it reads an ``EvictView`` and returns a ``Keep``;
the cache (``KVCache.evict``) removes the rest."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.eviction.base import EvictView, Keep, keep_all, nonneg_int, positive_int, protected_below
from kvlab.eviction.ranking import drop_lowest
from kvlab.core.registry import register_eviction


@register_eviction("sliding", order=1)
@dataclass(frozen=True)
class SlidingWindow:
    """Keep the first ``sinks`` slots (attention sinks) and the newest ``window - sinks`` slots:
    at most ``window`` entries in all. Needs no attention statistics."""

    window: int
    sinks: int = 4

    def __post_init__(self):
        positive_int("window", self.window)
        nonneg_int("sinks", self.sinks)
        protected_below("sinks", self.sinks, "window", self.window)

    @classmethod
    def from_budget(cls, budget: int, *, sinks: int | None = None) -> "SlidingWindow":
        """``window = budget`` with ``sinks`` sinks (default: 4, fewer when the budget is smaller)."""
        return cls(window=budget, sinks=min(4, max(0, budget - 1)) if sinks is None else sinks)

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.window:
            return keep_all(view, budget=self.window)
        recent = self.window - self.sinks
        return Keep(tuple(range(self.sinks)) + tuple(range(n - recent, n)), budget=self.window)

    decides_columns = True      # drops over a resident bank's columns (kvlab.cache.resident)

    def column_drop(self, cols) -> torch.Tensor:
        """Over a resident bank's columns, the entries :meth:`keep` drops: each layer's oldest slots after its first
        ``sinks`` (the lowest keys), down to ``window`` entries (``(L, B)`` long columns when every layer drops one,
        else an ``(L, B, C)`` bool mask)."""
        key = cols.key
        first = torch.where(cols.live, key, torch.iinfo(key.dtype).max).amin(-1, keepdim=True)      # (L, B, 1)
        protected = ~cols.live | (key < first + self.sinks)
        return drop_lowest(key.float(), protected, key, (cols.counts() - self.window).clamp_min(0))
