"""StreamingLLM as published (Xiao et al., 2023): attention sinks plus the newest entries, with positions assigned
*inside the cache*. After every cut the survivors are re-rotated to consecutive positions ``0 .. len - 1``
(``Keep.rerotate``; keys are stored post-RoPE, so the cache rotates them by the position change) and the next
query takes position ``len``. :class:`~kvlab.eviction.sliding.SlidingWindow` keeps the same entries at their
original positions, so the gap between its sinks and its window grows with the generation; this policy has no
gap. A policy decides only; the cache (``KVCache.evict``) removes and re-rotates."""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.core.registry import register_eviction
from kvlab.eviction.base import EvictView, Keep, keep_all, nonneg_int, positive_int, protected_below


@register_eviction("streamingllm", order=11)
@dataclass(frozen=True)
class StreamingLLM:
    """Keep the first ``sinks`` slots and the newest ``window - sinks``, then re-rotate the survivors to
    consecutive positions (at most ``window`` entries). Needs no attention statistics."""

    window: int
    sinks: int = 4

    def __post_init__(self):
        positive_int("window", self.window)
        nonneg_int("sinks", self.sinks)
        protected_below("sinks", self.sinks, "window", self.window)

    @classmethod
    def from_budget(cls, budget: int, *, sinks: int | None = None) -> "StreamingLLM":
        """``window = budget`` with ``sinks`` sinks (default: 4, fewer when the budget is smaller)."""
        return cls(window=budget, sinks=min(4, max(0, budget - 1)) if sinks is None else sinks)

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.window:
            return keep_all(view, budget=self.window)
        recent = self.window - self.sinks
        return Keep(tuple(range(self.sinks)) + tuple(range(n - recent, n)), budget=self.window, rerotate=True)
