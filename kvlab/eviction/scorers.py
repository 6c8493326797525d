"""Two kvpress-style scorers and the registered policies bound to them (``knorm``, ``snapkv_scorer``).
Scorers compute scores and policies decide; neither touches the cache (the wrapper is
:mod:`kvlab.eviction.scorer`, which states what a scorer receives).

* :class:`KeyNorm` — kvpress's ``KnormPress``: ``score = -‖k‖₂`` per KV head and entry (Devoto et
  al., 2024: low-norm keys draw more attention), so the lowest-norm keys are kept.
* :class:`SnapKVWindow` — kvpress's ``SnapKVPress``: the attention of the last ``window`` queries
  of the prompt (the observation window) on each earlier entry, smoothed by a centred average pool
  of width ``kernel`` (zero padding), the window itself padded with the largest score so it is never
  pruned. kvpress recomputes the window queries from ``hidden_states``; here the cache measures them
  (``needs_attention``, ``attention_window = window``) and the scorer reads ``kwargs["attn"]["acc"]``:
  the window's mass summed over the window queries and averaged over query heads — kvpress averages
  over the window queries (a constant factor, the same ranking) and keeps per-KV-head scores, which
  the wrapper averages over heads anyway. After the prefill ``acc`` also collects every decode
  query's mass (with ``every_step=True`` the scorer ranks by that running sum).

:class:`Knorm` and :class:`SnapKVScorer` are :class:`~kvlab.eviction.scorer.ScorerPolicy` with
these scorers fixed, so that the registry can build them from a budget and the run store names them.
``SnapKVScorer(budget, window, kernel)`` keeps what :class:`~kvlab.eviction.snapkv.SnapKV` keeps on
the same cache (``tests/test_scorers.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.eviction.base import check_observation_window, check_sinks
from kvlab.eviction.scorer import ScoredEviction
from kvlab.core.registry import register_eviction


@dataclass(frozen=True)
class KeyNorm:
    """``-‖k‖₂`` over the head dimension: ``(B, H_kv, T)``."""

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        return -keys.float().norm(dim=-1)                                        # (B, H_kv, T)


@dataclass(frozen=True)
class SnapKVWindow:
    """SnapKV's observation-window score (module docstring): ``(B, H_kv, T)``, the same for every head."""

    window: int = 16
    kernel: int = 5
    needs_attention = True          # class attributes, not fields: the cache measures the window for it

    @property
    def attention_window(self) -> int:
        return self.window

    def score(self, module, hidden_states, keys, values, attentions, kwargs) -> torch.Tensor:
        b, h, t = keys.shape[:3]
        attn = kwargs.get("attn")
        if attn is None or "acc" not in attn:
            raise ValueError("SnapKVWindow reads kwargs['attn']['acc'], the cache's window attention: wrap it in "
                             "kvlab.eviction.scorer.ScorerPolicy (which asks the loop to measure attention)")
        w = min(self.window, t)
        if w == t:                                                               # nothing before the window
            return torch.zeros(b, h, t)
        s = attn["acc"].float()[: t - w].view(1, 1, -1)                          # (1, 1, T-w) window mass
        s = F.avg_pool1d(s, self.kernel, stride=1, padding=self.kernel // 2).view(-1)   # (T-w,)
        s = torch.cat([s, s.max().expand(w)])                                    # (T,) the window: the max
        return s.view(1, 1, t).expand(b, h, t)                                   # (B, H_kv, T)


@register_eviction("knorm", order=9)
@dataclass(frozen=True)
class Knorm(ScoredEviction):
    """Key-norm eviction (kvpress ``KnormPress``): per layer the ``budget`` entries with the smallest
    head-mean key norm, plus the ``sinks`` first positions and newest ``protect`` among them."""

    budget: int
    sinks: int = 0
    protect: int = 0
    every_step: bool = False

    def __post_init__(self):
        self.check()

    @property
    def scorer(self) -> KeyNorm:
        return KeyNorm()


@register_eviction("snapkv_scorer", order=10)
@dataclass(frozen=True)
class SnapKVScorer(ScoredEviction):
    """SnapKV through the scorer wrapper: :class:`SnapKVWindow` ``(window, kernel)`` at ``budget``
    entries per layer (the window among them: its padded score keeps it)."""

    budget: int
    window: int = 16
    kernel: int = 5
    sinks: int = 0
    every_step: bool = False
    protect = 0                     # the window protects itself through its score

    def __post_init__(self):
        check_observation_window(self.budget, self.window, self.kernel)
        check_sinks(self.sinks, "window", self.window, "budget", self.budget)
        self.check()

    @property
    def scorer(self) -> SnapKVWindow:
        return SnapKVWindow(self.window, self.kernel)
