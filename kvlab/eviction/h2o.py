"""H2O: heavy hitters (accumulated attention) + a recent window, per layer as in the reference.
A ranked policy (:class:`~kvlab.eviction.ranked.RankedEviction`): it scores, the base selects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvlab.eviction.base import EvictView, RankedEviction, check_recent_budget, layer_block, layer_row
from kvlab.core.registry import register_eviction


@register_eviction("h2o", order=2, controls={"recent": "recent"})
@dataclass(frozen=True)
class H2O(RankedEviction):
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

    needs_attention = True

    def __post_init__(self):
        check_recent_budget(self.budget, self.recent, self.per_layer, self.sinks)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0) -> "H2O":
        """``budget`` entries, the newest ``recent`` protected (default ``budget // 4``), ``sinks`` sinks."""
        return cls(budget=budget, recent=budget // 4 if recent is None else recent, sinks=sinks)

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        """The layer's accumulated attention ``acc``."""
        return layer_row(view, "acc", layer)

    def scores_for(self, view: EvictView, layers: Sequence[int]):
        """:meth:`score` of ``layers`` at once: the rows of the ``acc`` matrix when the view carries one."""
        return layer_block(view, "acc", layers)

    def column_score(self, cols) -> torch.Tensor:
        """Over a resident bank's columns: the accumulated attention ``acc`` ``(L, B, C)``."""
        return cols.stats["acc"]

    def layer_keep(self, acc: torch.Tensor, n: int, sinks: int = 0) -> tuple[int, ...]:
        """One layer's decision from its ``acc`` ``(n,)`` (its first ``sinks`` slots are sinks): the slots it keeps."""
        return self.rank_layer(acc, n, self.budget, sinks)
