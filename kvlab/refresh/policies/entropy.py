"""Entropy-gated refresh (seed 000, "Entropy Gating"): zero teacher cost until it fires.
A policy decides only (``should_refresh(record)``); the decode loop refreshes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.refresh.policies._check import nonneg_float, positive_int
from kvlab.core.registry import register_refresh


@register_refresh("entropy", order=1)
@dataclass(frozen=True)
class EntropyGate:
    """Refresh after step t when the student's next-token entropy ``H_t > tau_bits`` and at least
    ``min_gap`` steps passed since the last refresh (``record.since_refresh >= min_gap``)."""

    tau_bits: float
    min_gap: int = 1
    W: int | None = None

    def __post_init__(self):
        nonneg_float("tau_bits", self.tau_bits)
        positive_int("min_gap", self.min_gap)
        positive_int("W", self.W, allow_none=True)

    @property
    def window(self) -> int | None:
        return self.W

    def should_refresh(self, record) -> bool:
        return record.entropy_bits > self.tau_bits and record.since_refresh >= self.min_gap

    def explain(self, record) -> str:
        """Why :meth:`should_refresh` fired (or not) at ``record``, in words."""
        h = record.entropy_bits
        if h <= self.tau_bits:
            return f"entropy {h:.3f} bits ≤ τ={self.tau_bits:g}"
        if record.since_refresh < self.min_gap:
            return f"entropy {h:.3f} bits > τ={self.tau_bits:g}, but only {record.since_refresh} step(s) since the last refresh"
        return f"entropy {h:.3f} bits > τ={self.tau_bits:g}"
