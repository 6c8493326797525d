"""StreamingLLM as published (Xiao et al., 2023): attention sinks plus the newest entries, with positions assigned
*inside the cache*. After every cut the survivors are re-rotated to consecutive positions ``0 .. len - 1``
(``Keep.rerotate``; keys are stored post-RoPE, so the cache rotates them by the position change) and the next
query takes position ``len``. :class:`~kvlab.eviction.sliding.SlidingWindow` keeps the same entries at their
original positions, so the gap between its sinks and its window grows with the generation; this policy has no
gap. A policy decides only; the cache (``KVCache.evict``) removes and re-rotates."""
from __future__ import annotations

from dataclasses import dataclass, replace

from kvlab.core.registry import register_eviction
from kvlab.eviction.base import EvictView, Keep
from kvlab.eviction.sliding import SlidingWindow


@register_eviction("streamingllm", order=11)
@dataclass(frozen=True)
class StreamingLLM(SlidingWindow):
    """:class:`SlidingWindow`'s entries (the first ``sinks`` slots and the newest ``window - sinks``), re-rotated to
    consecutive positions after every cut. Needs no attention statistics."""

    def keep(self, view: EvictView) -> Keep:
        kept = super().keep(view)
        return replace(kept, rerotate=True) if view.length > self.window else kept
