"""Random eviction at a matched rate: the Conf-KV paper's isolation control.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import EvictView, Keep, keep_all, nonneg_int, positive_int, protected_below, unit_float


@dataclass(frozen=True)
class RandomEvict:
    """When the cache exceeds ``budget`` — and, with ``rate < 1``, only on a seeded fraction
    ``rate`` of such steps (the per-step eviction probability to match another policy's schedule) —
    keep the newest ``recent`` slots and a uniformly random ``budget - recent`` of the others.
    The draw depends only on ``(seed, step)``, so runs are reproducible."""

    budget: int
    recent: int
    seed: int = 0
    rate: float = 1.0

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
        unit_float("rate", self.rate)

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.budget:
            return keep_all(view, budget=self.budget)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + view.step)
        if self.rate < 1.0 and float(torch.rand((), generator=gen)) >= self.rate:
            return keep_all(view, budget=self.budget)
        m = n - self.recent
        pick = torch.randperm(m, generator=gen)[: self.budget - self.recent].tolist()
        return Keep(tuple(sorted(pick)) + tuple(range(m, n)), budget=self.budget)
