"""SnapKV (prompt compression; Conf-KV's seed 002 baseline), with NVIDIA kvpress's conventions.

Once, on the run's first step (the cache holds the prefill, ``view.first``), a prompt longer than
``budget`` is cut to ``budget`` entries; decoding then appends without further eviction. Scores
(``SnapKVPress.score``): the attention of the last ``window`` prompt queries (the observation
window; the cache measures only them, ``attention_window``) on every earlier entry, summed over the
window queries and averaged over heads, then smoothed by a centred average pool of width ``kernel``
(zero padding, ``F.avg_pool1d(kernel, padding=kernel // 2)``). The window itself is always kept; the
``budget - window`` other entries with the largest smoothed score stay (ties → newer).

kvpress keeps the top entries per KV head and, for PyramidKV, per layer. :meth:`SnapKV.layer_keep`
is the per-layer decision (one layer's scores → kept slots); until the cache keeps a live set per
layer, :meth:`SnapKV.keep` applies it once to the layer mean of the scores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import EvictView, Keep, check_observation_window, keep_all, layer_stat, top_slots


@dataclass(frozen=True)
class SnapKV:
    budget: int
    window: int = 16
    kernel: int = 5
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β

    def __post_init__(self):
        check_observation_window(self.budget, self.window, self.kernel)

    @property
    def needs_attention(self) -> bool:
        return True

    @property
    def attention_window(self) -> int:
        return self.window

    def scores(self, acc: torch.Tensor, n: int) -> torch.Tensor:
        """``(n - window,)`` smoothed observation-window scores of the entries before the window,
        from one layer's window mass ``acc`` ``(n,)``."""
        s = acc[: n - self.window].float().view(1, 1, -1)                          # (1, 1, n-w)
        return F.avg_pool1d(s, self.kernel, stride=1, padding=self.kernel // 2).view(-1)

    def layer_keep(self, acc: torch.Tensor, n: int, budget: int) -> tuple[int, ...]:
        """One layer's decision: the slots it keeps out of ``n`` under ``budget`` entries."""
        if n <= budget:
            return tuple(range(n))
        cand = list(range(n - self.window))
        kept = top_slots(self.scores(acc, n), cand, budget - self.window)
        return tuple(kept) + tuple(range(n - self.window, n))

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if not view.first or n <= self.budget:
            return keep_all(view, budget=self.budget)
        acc = layer_stat(view, "acc").float().mean(0)            # (T,) one live set for all layers: the layer mean
        return Keep(self.layer_keep(acc, n, self.budget), budget=self.budget)
