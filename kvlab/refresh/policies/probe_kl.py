"""Probe-KL refresh (seed 000, "Optional (probe-KL every M steps)").
A policy decides only (``should_refresh(record)``, from the probe's signal on the record); the decode loop probes
and refreshes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.refresh.policies._check import nonneg_float, positive_int
from kvlab.core.registry import register_refresh


@register_refresh("probe_kl", order=2)
@dataclass(frozen=True)
class ProbeKL:
    """Every M steps the teacher catches up on its own cache (the probe's cost, in teacher
    tokens) and gives ``p_T``; refresh when ``KL(p_T || p_S) > kappa`` nats."""

    M: int
    kappa: float
    W: int | None = None
    probe: str = "teacher_kl"

    def __post_init__(self):
        positive_int("M", self.M)
        nonneg_float("kappa", self.kappa)
        positive_int("W", self.W, allow_none=True)

    @property
    def probe_every(self) -> int:
        return self.M

    @property
    def window(self) -> int | None:
        return self.W

    def should_refresh(self, record) -> bool:
        kl = record.signals.get("kl")
        return kl is not None and kl > self.kappa

    def explain(self, record) -> str:
        """Why :meth:`should_refresh` fired (or not) at ``record``, in words."""
        kl = record.signals.get("kl")
        if kl is None:
            return f"no probe at step {record.step} (the teacher probes every M={self.M} steps)"
        return f"probe KL {kl:.3f} nats {'>' if kl > self.kappa else '≤'} κ={self.kappa:g}"
