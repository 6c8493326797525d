"""Comparing runs in the playground: runs pinned for overlay (:class:`Pins`) and the current
configuration timed back to back against its baseline (:func:`time_vs_baseline`).

Keeps pins in memory; the timing decodes without storing anything.
"""
from __future__ import annotations

from kvlab.playground.settings import Settings, decode_config, sampling_of
from kvlab.playground.shown import Shown

MAX_PINS = 4


class Pins:
    """Runs pinned for overlay, oldest first (at most :data:`MAX_PINS`, oldest dropped first)."""

    def __init__(self):
        self.runs: list[Shown] = []

    def pin(self, sh: Shown | None) -> Shown:
        """Pin ``sh`` (pinning a pinned run does nothing)."""
        if sh is None:
            raise ValueError("nothing is shown yet: wait for a run before pinning")
        if all(p.key != sh.key for p in self.runs):
            self.runs = (self.runs + [sh])[-MAX_PINS:]
        return sh

    def unpin(self, key: str | None = None) -> None:
        """Unpin run ``key`` (every run when None)."""
        if key is not None and all(p.key != key for p in self.runs):
            raise ValueError(f"key={key!r} is not pinned; pinned: {[p.key for p in self.runs]}")
        self.runs = [] if key is None else [p for p in self.runs if p.key != key]


def check_repeats(repeats) -> None:
    """``repeats`` (pairs timed) must be a positive int."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int (pairs timed)")


def time_vs_baseline(teacher, student, s: Settings, repeats: int) -> dict:
    """Time ``s`` against its baseline back to back (:func:`kvlab.studies.refresh.tables.paired_timing`: same
    prompt and seed, order alternating, one warm-up; the baseline is also timed against itself, the noise
    floor): ``{"settings", "overhead_pct", "q25", "q75", "pairs", "noise_pct", "tps"}``."""
    from kvlab.harness.experiment import RunSpec
    from kvlab.studies.refresh.tables import overhead_table, paired_timing

    spec = RunSpec(prompts=(s.prompt,), tokens=s.N, sampling=sampling_of(s))
    t = paired_timing(teacher, student, spec, {"baseline": decode_config(s.baseline()), "run": decode_config(s)},
                      base="baseline", prompts=1, repeats=repeats)
    tab = overhead_table(t).set_index("policy")
    run, aa = tab.loc["run"], tab.loc["baseline"]
    return {"settings": s, "overhead_pct": float(run.overhead_pct), "q25": float(run.overhead_pct_q25),
            "q75": float(run.overhead_pct_q75), "pairs": int(run.pairs), "noise_pct": float(aa.overhead_pct),
            "tps": float(run.tps)}
