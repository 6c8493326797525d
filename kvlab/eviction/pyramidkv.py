"""PyramidKV (Cai et al., 2024; a Conf-KV seed-002 baseline): prompt compression with per-layer budgets.
A ranked policy (:class:`~kvlab.eviction.ranked.RankedEviction`): SnapKV's score, its own per-layer budgets.

Like :class:`~kvlab.eviction.snapkv.SnapKV` it acts once, on the run's first step (the cache holds
the prefill, ``view.first``), and decoding then appends without eviction. Each layer scores the
entries before the observation window by the attention of the last ``window`` prompt queries on
them (the only prompt queries the cache measures, ``attention_window``), summed over those queries
and averaged over heads, smoothed by a centred average pool of width ``kernel`` — SnapKV's score,
per layer (:class:`~kvlab.eviction.snapkv.ObservationWindow`, shared with SnapKV; :meth:`PyramidKV.budgets`
feeds the pyramid to the ranked base). The window is kept on every layer; layer ``l`` keeps its own
top ``k_l`` other entries (``Keep.layers``), with the pyramid of the authors' code
(``Zefan-Cai/PyramidKV``, ``PyramidKVCluster.update_kv``), ``B = budget`` (mean entries per layer,
window included), ``w = window``, ``n`` the prompt length, ``L`` layers:

    n ≤ B:             nothing is evicted
    n < 2(B - w):      k_l = B - w on every layer (the reference's SnapKV branch)
    otherwise:         lo = ⌊(B - w)/β⌋,  hi = 2(B - w) - lo
                       if hi ≥ n - w:  hi = n - w,  lo = 2(B - w) - hi
                       k_l = hi - l·⌊(hi - lo)/(L - 1)⌋

so the lowest layer keeps the most, the highest the fewest, and the layers together keep
``L·B`` entries plus the integer steps' rounding (at most ``L(L-1)/2`` more). ``β = beta``
(default 20, the reference's) sets the steepness.

Differences from the reference, stated: it picks per KV head (``topk`` over each head's scores);
kvlab's cache keeps one live set per layer, so the scores are averaged over heads first. A one-layer
model keeps ``B`` (the pyramid needs ``L ≥ 2``).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.eviction.base import EvictView, check_observation_window, positive_int
from kvlab.eviction.snapkv import ObservationWindow
from kvlab.core.registry import register_eviction


@register_eviction("pyramidkv", order=8)
@dataclass(frozen=True)
class PyramidKV(ObservationWindow):
    budget: int                   # mean entries per layer after the cut, observation window included
    window: int = 16
    kernel: int = 5
    beta: int = 20
    ema_decay: float = 0.9        # unused; the cache's EMA needs a β

    def __post_init__(self):
        check_observation_window(self.budget, self.window, self.kernel)
        positive_int("beta", self.beta)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None) -> "PyramidKV":
        """The prompt cut to ``budget`` entries per layer on average; ``recent``: the observation window (default 16)."""
        return cls(budget=budget) if recent is None else cls(budget=budget, window=recent)

    def due(self, view: EvictView) -> bool:
        return view.first and view.length > self.budget

    def budgets(self, view: EvictView) -> list[int]:
        return self.layer_budgets(view.length, view.num_layers)

    def layer_budgets(self, n: int, num_layers: int) -> list[int]:
        """Entries each layer keeps of a prompt of ``n`` (window included; module docstring)."""
        b, w = self.budget, self.window
        if n <= b:
            return [n] * num_layers
        if n < 2 * (b - w) or num_layers == 1:
            return [b] * num_layers
        lo = (b - w) // self.beta
        hi = 2 * (b - w) - lo
        if hi >= n - w:
            hi = n - w
            lo = 2 * (b - w) - hi
        step = (hi - lo) // (num_layers - 1)
        return [hi - l * step + w for l in range(num_layers)]
