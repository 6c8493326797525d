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
