"""The matched-memory budget solver and the memory numbers of a stored run (see
:mod:`kvlab.studies.eviction.tables` for the study it serves).

Every fixed-budget family has one integer knob; :func:`solve_budget` finds the knob whose achieved mean
memory is closest to Conf-KV's: a first guess from the full-cache runs (a hard cap ``b`` turns the full
cache's lengths ``n_t`` into ``min(n_t, b)``, :func:`capped_mean`, inverted exactly by
:func:`invert_capped`), then bracketing and secant steps on measured values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

MIB = 2 ** 20


# --------------------------------------------------------------------------- memory of a run


def run_memory(steps: dict) -> dict:
    """Memory numbers of one stored run's step columns (``experiment.records_columns``)."""
    lens = [int(x) for x in steps["cache_len"]]
    nbytes = steps.get("cache_bytes") or [None] * len(lens)
    if any(b is None for b in nbytes):
        raise ValueError("stored run has no cache_bytes per step (made before eviction records existed); "
                         "delete it from the run store or use a fresh --runs folder")
    nbytes = [float(b) for b in nbytes]
    ev = [int(e) for e in steps["evicted"]]
    meta = steps.get("meta_bytes") or [float("nan")] * len(lens)
    fwd = steps.get("forward_bytes") or [float("nan")] * len(lens)
    b16 = steps.get("cache_bytes16") or [float("nan")] * len(lens)
    return {"mean_len": float(np.mean(lens)), "peak_len": max(lens), "min_len": min(lens),
            "mean_mb": float(np.mean(nbytes)) / MIB, "mean_mb16": float(np.mean(b16)) / MIB,
            "peak_mb": max(nbytes) / MIB, "evicted": sum(ev), "evict_events": sum(e > 0 for e in ev),
            "meta_mb": float(np.mean(meta)) / MIB, "peak_fwd_mb": float(np.max(fwd)) / MIB}


def budget_fractions(steps: dict, loose: int) -> dict:
    """Share of decode steps whose chosen budget (the policy's ``budget`` signal) is the loose one, and
    share of steps whose cache (layer 0, after the evict phase) stood at ``loose`` — the loose budget
    binding. NaN for policies without a confidence schedule (no ``confidence`` signal)."""
    sigs = steps.get("signals") or []
    b = [sig.get("budget") for sig in sigs]
    if not b or any(x is None for x in b) or any(sig.get("confidence") is None for sig in sigs):
        return {"frac_loose": float("nan"), "frac_at_loose": float("nan")}
    lens = [int(x) for x in steps["cache_len"]]
    return {"frac_loose": float(np.mean([x == loose for x in b])),
            "frac_at_loose": float(np.mean([n >= loose and x == loose for n, x in zip(lens, b)]))}


def capped_mean(trajectories: Sequence[Sequence[float]], cap: float) -> float:
    """Mean over runs of ``mean_t min(n_t, cap)``: what a hard cap of ``cap`` entries would leave of
    the full cache's per-step lengths ``n_t`` (the solver's first guess)."""
    return float(np.mean([np.minimum(np.asarray(t, dtype=float), cap).mean() for t in trajectories]))


def invert_capped(trajectories: Sequence[Sequence[float]], target: float, lo: int, hi: int) -> int:
    """The integer cap in ``[lo, hi]`` whose :func:`capped_mean` is closest to ``target``."""
    best, best_err = lo, math.inf
    a, b = lo, hi
    while a <= b:                                   # capped_mean is non-decreasing in cap
        mid = (a + b) // 2
        m = capped_mean(trajectories, mid)
        if abs(m - target) < best_err:
            best, best_err = mid, abs(m - target)
        if m < target:
            a = mid + 1
        else:
            b = mid - 1
    for c in (a - 1, a, a + 1):
        if lo <= c <= hi and abs(capped_mean(trajectories, c) - target) < best_err:
            best, best_err = c, abs(capped_mean(trajectories, c) - target)
    return best


@dataclass
class Solved:
    """Result of :func:`solve_budget`: the knob, its measured value, the target, every probe."""

    knob: int
    achieved: float
    target: float
    probes: dict = field(default_factory=dict)

    @property
    def rel_err(self) -> float:
        return abs(self.achieved - self.target) / self.target if self.target else float("nan")


def solve_budget(measure: Callable[[int], float], target: float, lo: int, hi: int, guess: int | None = None,
                 tol: float = 0.02, max_probes: int = 8) -> Solved:
    """The integer knob ``k`` in ``[lo, hi]`` whose ``measure(k)`` (non-decreasing in ``k``) is closest
    to ``target``: start at ``guess``, stop once within ``tol`` (relative), else bracket and refine.
    Until the target is bracketed the knob doubles (or halves) from the guess; then secant steps.
    At most ``max_probes`` calls of ``measure``; every probe is kept in ``probes``."""
    if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi or lo < 1:
        raise ValueError(f"lo={lo!r}, hi={hi!r} must be ints with 1 <= lo <= hi")
    if not target > 0:
        raise ValueError(f"target={target!r} must be > 0")
    probes: dict[int, float] = {}

    def m(k: int) -> float:
        if k not in probes:
            probes[k] = float(measure(k))
        return probes[k]

    def done() -> Solved:
        k = min(probes, key=lambda k: (abs(probes[k] - target), k))
        return Solved(k, probes[k], target, dict(sorted(probes.items())))

    k = min(max(guess if guess is not None else (lo + hi) // 2, lo), hi)
    a, b = lo, hi                       # invariant: the answer lies in [a, b]
    while len(probes) < max_probes:
        v = m(k)
        if abs(v - target) <= tol * target:
            break
        if v < target:
            a = k + 1
        else:
            b = k - 1
        if a > b:
            break
        # secant step from the two probes nearest the target when they bracket it, else bisect
        below = [(kk, vv) for kk, vv in probes.items() if vv < target]
        above = [(kk, vv) for kk, vv in probes.items() if vv > target]
        if below and above:
            (k0, v0), (k1, v1) = max(below), min(above)
            nxt = round(k0 + (target - v0) * (k1 - k0) / (v1 - v0)) if v1 != v0 else (a + b) // 2
        elif below:                      # not bracketed yet: expand away from the guess
            nxt = 2 * k
        else:
            nxt = k // 2
        k = min(max(nxt, a), b)
        if k in probes:
            k = (a + b) // 2
            if k in probes:
                break
    return done()
