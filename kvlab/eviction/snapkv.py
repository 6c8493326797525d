"""SnapKV (prompt compression; Conf-KV's seed 002 baseline), with NVIDIA kvpress's conventions.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.

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
slots on every layer, by the layer mean of the window mass), kept to measure the difference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.eviction.base import (EvictView, Keep, check_bool, check_observation_window, keep_all, layer_rows, layer_stat,
                   over_budget, top_slots)
from kvlab.eviction.base import per_layer as layer_decision
from kvlab.core.registry import register_eviction


@register_eviction("snapkv", order=6)
@dataclass(frozen=True)
class SnapKV:
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
        if not view.first or not over_budget(view, self.budget, self.per_layer):
            return keep_all(view, budget=self.budget)
        if self.per_layer:
            kept = [self.layer_keep(acc.float(), len(pos), self.budget)
                    for acc, pos in zip(layer_rows(view, "acc"), view.layer_positions)]
            return layer_decision(kept, budget=self.budget)
        acc = layer_stat(view, "acc").float().mean(0)            # (T,) one live set for all layers: the layer mean
        return Keep(self.layer_keep(acc, view.length, self.budget), budget=self.budget)
