"""Speculative refresh: fixed bursts of k student tokens, then a k-token teacher correction
(seed 000, "Speculative Refresh").
A policy decides only (``should_refresh(record)``); the decode loop refreshes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.refresh.policies._check import positive_int
from kvlab.core.registry import register_refresh


@register_refresh("speculative", order=3)
@dataclass(frozen=True)
class Speculative:
    """Every k tokens the teacher prefills exactly the k new tokens and the last k entries are
    spliced: constant teacher work per refresh. Same post-refresh KV as ``Periodic(T=k, W=k)``."""

    k: int

    def __post_init__(self):
        positive_int("k", self.k)

    @property
    def window(self) -> int:
        return self.k

    def should_refresh(self, record) -> bool:
        return record.since_refresh >= self.k

    def explain(self, record) -> str:
        """Why :meth:`should_refresh` fired (or not) at ``record``, in words."""
        n = record.since_refresh
        return f"burst done: {n} student step(s) since the last refresh {'≥' if n >= self.k else '<'} k={self.k}"
