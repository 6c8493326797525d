"""SnapKV (prompt compression; Conf-KV's seed 002 baseline), with NVIDIA kvpress's conventions.
A ranked policy (:class:`~kvlab.eviction.ranked.RankedEviction`): it scores, the base selects.

Once, on the run's first step (the cache holds the prefill, ``view.first``), a prompt longer than
``budget`` is cut to ``budget`` entries; decoding then appends without further eviction. Scores
(``SnapKVPress.score``): the attention of the last ``window`` prompt queries (the observation
window; the cache measures only them, ``attention_window``) on every earlier entry, summed over the
window queries and averaged over heads, then smoothed by a centred average pool of width ``kernel``
(zero padding, ``F.avg_pool1d(kernel, padding=kernel // 2)``). The window itself is always kept; the
``budget - window`` other entries with the largest smoothed score stay (ties → newer).

Each layer scores and cuts its own entries from its own window attention, as the references do
(kvpress's presses and SnapKV's ``SnapKVCluster.update_kv`` run inside each layer's attention), so
the layers keep different entries, ``budget`` each (``Keep.layers``; ``Keep.slots`` is layer
0's). :meth:`SnapKV.layer_keep` is one layer's decision. The references pick per KV head; here
each layer ranks the head mean. ``per_layer=False`` is the earlier one-live-set cut (the same
slots on every layer, by the pooled layer mean of the window mass), kept to measure the difference.
:class:`ObservationWindow` (the score, the window, the one cut) is shared with PyramidKV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.eviction.base import (EvictView, RankedEviction, check_bool, check_observation_window, layer_row,
                                 layer_stat)
from kvlab.core.registry import register_eviction


class ObservationWindow(RankedEviction):
    """SnapKV's score and cut, for a dataclass with ``budget``, ``window`` and ``kernel``: once, on the
    first step; the newest ``window`` entries (the observation window) always kept."""

    newest_field = "window"
    needs_attention = True
    attention_steps = "first"      # its one cut reads attention at the first step; later steps keep everything

    @property
    def attention_window(self) -> int:
        return self.window

    def due(self, view: EvictView) -> bool:
        return view.first

    def scores(self, acc: torch.Tensor, n: int) -> torch.Tensor:
        """``(n - window,)`` smoothed observation-window scores of the entries before the window,
        from one layer's window mass ``acc`` ``(n,)``."""
        s = acc[: n - self.window].float().view(1, 1, -1)                          # (1, 1, n-w)
        return F.avg_pool1d(s, self.kernel, stride=1, padding=self.kernel // 2).view(-1)

    def score(self, view: EvictView, layer: int) -> torch.Tensor:
        """The layer's pooled window mass before the window (the window itself, always kept, is not scored)."""
        return self.scores(layer_row(view, "acc", layer).float(), len(view.layer_positions[layer]))

    def layer_mean_score(self, view: EvictView, lo: int, hi: int) -> torch.Tensor:
        """``per_layer=False``: the pooled layer mean of the window mass."""
        return self.scores(layer_stat(view, "acc").float().mean(0), view.length)

    def layer_keep(self, acc: torch.Tensor, n: int, budget: int) -> tuple[int, ...]:
        """One layer's decision: the slots it keeps out of ``n`` under ``budget`` entries."""
        return self.rank_layer(self.scores(acc, n), n, budget)


@register_eviction("snapkv", order=6)
@dataclass(frozen=True)
class SnapKV(ObservationWindow):
    budget: int
    window: int = 16
    kernel: int = 5
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β
    per_layer: bool = True

    def __post_init__(self):
        check_observation_window(self.budget, self.window, self.kernel)
        check_bool("per_layer", self.per_layer)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None) -> "SnapKV":
        """The prompt cut to ``budget`` entries; ``recent``: the observation window (default 16)."""
        return cls(budget=budget) if recent is None else cls(budget=budget, window=recent)
