"""Random eviction at a matched rate: the Conf-KV paper's isolation control.
A policy decides only: it reads an ``EvictView`` and returns a ``Keep``; the cache removes the rest.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.eviction.base import EvictView, Keep, check_sinks, keep_all, nonneg_int, positive_int, protected_below, sink_counts, unit_float
from kvlab.core.registry import register_eviction


@register_eviction("random", order=3, controls={"recent": "recent"})
@dataclass(frozen=True)
class RandomEvict:
    """When the cache exceeds ``budget`` — and, with ``rate < 1``, only on a seeded fraction
    ``rate`` of such steps (the per-step eviction probability to match another policy's schedule) —
    keep the newest ``recent`` slots and a uniformly random ``budget - recent`` of the others.
    The draw depends only on ``(seed, step)``, so runs are reproducible. ``sinks``: the first
    ``sinks`` positions are never evicted (StreamingLLM's attention sinks; default 0)."""

    budget: int
    recent: int
    seed: int = 0
    rate: float = 1.0
    sinks: int = 0

    def __post_init__(self):
        positive_int("budget", self.budget)
        nonneg_int("recent", self.recent)
        protected_below("recent", self.recent, "budget", self.budget)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")
        unit_float("rate", self.rate)
        check_sinks(self.sinks, "recent", self.recent, "budget", self.budget)

    @classmethod
    def from_budget(cls, budget: int, *, recent: int | None = None, sinks: int = 0, seed: int = 0) -> "RandomEvict":
        """``budget`` entries, the newest ``recent`` protected (default ``budget // 4``), ``sinks`` sinks."""
        return cls(budget=budget, recent=budget // 4 if recent is None else recent, seed=seed, sinks=sinks)

    def keep(self, view: EvictView) -> Keep:
        n = view.length
        if n <= self.budget:
            return keep_all(view, budget=self.budget)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + view.step)
        if self.rate < 1.0 and float(torch.rand((), generator=gen)) >= self.rate:
            return keep_all(view, budget=self.budget)
        s = sink_counts(view, self.sinks)[0]
        m = n - self.recent
        pick = (torch.randperm(m - s, generator=gen)[: self.budget - self.recent - s] + s).tolist()
        return Keep(tuple(range(s)) + tuple(sorted(pick)) + tuple(range(m, n)), budget=self.budget)
