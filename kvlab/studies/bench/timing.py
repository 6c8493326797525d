"""What every benchmark shares: timing, the CUDA sync, peak memory, the ``--batch`` check."""
from __future__ import annotations

import time

import torch


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux ``ru_maxrss`` is KiB)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(r / (2**20 if sys.platform == "darwin" else 1024), 1)


def check_batches(batches) -> list[int]:
    """``--batch`` sizes: positive ints (ValueError naming ``--batch`` otherwise)."""
    if isinstance(batches, int):
        batches = [batches]
    out = list(batches)
    if not out or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out):
        raise ValueError(f"--batch={batches!r} must be positive ints, e.g. --batch 1,4,8,16")
    return out


def check_whole_period(steps: int, every: int, what: str) -> None:
    """ValueError naming ``--tokens`` when ``steps`` time no whole period of ``what``, asked every ``every`` steps
    (:func:`period_times`: the first whole period starts at step ``every + 1``)."""
    if steps < 2 * every:
        raise ValueError(f"steps={steps} (--tokens) times no whole period of {what} asked every {every} steps: use "
                         f"at least {2 * every} (the first period starts at step {every + 1})")


def period_times(times, every: int, first_step: int = 1, start: int = 2) -> list[float]:
    """Mean step time of each whole period of ``every`` steps that begins at an asked step (``first_step``, then
    every ``every``-th: :func:`kvlab.decode.protocols.evict_due`); ``times[j]`` is step ``start + j``. With
    ``every == 1`` each step is its own period (the steps' own times). A policy asked every N steps pays its
    decision and edit on one step in N: a per-step median would leave that step out, a period's mean spreads it over
    the N steps it serves. Empty when no whole period is timed."""
    out = []
    for j, _ in enumerate(times):
        step = start + j
        if (step - first_step) % every == 0 and j + every <= len(times):
            out.append(sum(times[j:j + every]) / every)
    return out


def ratio_interval(num, den, level: float = 0.95, n_boot: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """A percentile-bootstrap interval of ``median(num) / median(den)`` over paired samples (``num[k]``, ``den[k]``:
    the same period timed two ways, e.g. a policy's period and its plain twin's): the pairs are resampled together,
    so what the two sides share (the machine's drift over the run) stays paired. None with fewer than 3 pairs."""
    import numpy as np

    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"num and den must be paired 1-d samples, got {a.shape} and {b.shape}")
    if len(a) < 3:
        return None
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n_boot, len(a)))                # (n_boot, n)
    stats = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
