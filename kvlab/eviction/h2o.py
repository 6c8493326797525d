"""H2O: heavy hitters (accumulated attention) + a recent window."""
from __future__ import annotations

from dataclasses import dataclass

from .base import EvictView, Keep, keep_all, layer_mean, layer_stat, nonneg_int, positive_int, protected_below, top_slots


@dataclass(frozen=True)
class H2O:
    """Keep the newest ``recent`` slots and the ``budget - recent`` other slots with the largest
    accumulated attention ``acc_j = Σ_steps mean_h A[h, j]`` averaged over layers
    (``attn["acc"]``; ties go to the newer slot). At most ``budget`` entries."""

    budget: int
    recent: int
    ema_decay: float = 0.9        # unused by H2O's ranking; the cache's EMA needs a β

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)

    @property
    def needs_attention(self) -> bool:
        return True

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.budget:
            return keep_all(view, budget=self.budget)
        cand = list(range(n - self.recent))
        score = layer_mean(layer_stat(view, "acc"), cand)
        kept = top_slots(score, cand, self.budget - self.recent)
        return Keep(tuple(kept) + tuple(range(n - self.recent, n)), budget=self.budget)
