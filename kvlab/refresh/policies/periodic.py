"""Periodic refresh every T tokens, optionally windowed (seed 000, "Periodic Refresh").
A policy decides only (``should_refresh(record)``); the decode loop refreshes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.refresh.policies._check import positive_int
from kvlab.core.registry import register_refresh


@register_refresh("periodic", order=0)
@dataclass(frozen=True)
class Periodic:
    """Refresh after steps T, 2T, …; each refresh rewrites the last ``min(W, T)`` entries.

    ``W=None`` rewrites everything the student wrote since the last refresh (sliding window off).
    """

    T: int
    W: int | None = None

    def __post_init__(self):
        positive_int("T", self.T)
        positive_int("W", self.W, allow_none=True)

    @property
    def window(self) -> int | None:
        return self.W

    def should_refresh(self, record) -> bool:
        return record.step % self.T == 0

    def explain(self, record) -> str:
        """Why :meth:`should_refresh` fired (or not) at ``record``, in words."""
        return f"T reached: step {record.step} is a multiple of T={self.T}" if self.should_refresh(record) else \
            f"step {record.step} is not a multiple of T={self.T}"
