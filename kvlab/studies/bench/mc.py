"""The MC-dropout benchmark: clean, batched-N and sequential-N passes per decode step."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb  # noqa: F401


def bench_mc(lm, prompt: str, tokens: int = 32, n_passes: int = 8, p: float = 0.1) -> dict:
    """MC-dropout cost per decode step, measured at every step of one greedy decode of ``lm``:

    * ``clean``      — one clean pass of the step (``KVCache.probe_last(model, 1)``, no hooks),
    * ``batched``    — N noisy passes as one batch sharing the prefix cache (what the probe runs),
    * ``sequential`` — N noisy passes one after another (batch 1 each).

    The three alternate at every step (order rotated); medians over the steps are reported in ms.
    """
    from kvlab.decode import DecodeConfig, Decoding
    from kvlab.uncertainty.mc import check_n_passes, check_p, mc_dropout

    n_passes, p = check_n_passes(n_passes), check_p(p)
    model = lm.model
    d = Decoding(None, lm, prompt, DecodeConfig(mode="student", max_new_tokens=tokens + 1))

    def clean():
        model_out = d.cache.probe_last(model, 1)
        assert model_out.shape[0] == 1

    def batched():
        with mc_dropout(model, p, seed=0):
            assert d.cache.probe_last(model, n_passes).shape[0] == n_passes

    def sequential():
        with mc_dropout(model, p, seed=0):
            for _ in range(n_passes):
                d.cache.probe_last(model, 1)

    fns = {"clean": clean, "batched": batched, "sequential": sequential}
    times = {k: [] for k in fns}
    for rec in d:
        if rec.step == 1:          # warm-up step
            for fn in fns.values():
                fn()
            continue
        order = list(fns)[rec.step % 3:] + list(fns)[:rec.step % 3]
        for k in order:
            times[k].append(_timed(fns[k]))
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "steps": tokens,
            "n_passes": n_passes, "p": p, "prompt_tokens": len(d.prompt_ids),
            "ms_clean": round(ms["clean"], 3), "ms_batched_N": round(ms["batched"], 3),
            "ms_sequential_N": round(ms["sequential"], 3),
            "batched_over_clean": round(ms["batched"] / ms["clean"], 3),
            "sequential_over_batched": round(ms["sequential"] / ms["batched"], 3)}
