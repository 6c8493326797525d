"""The refresh benchmark: each refresh policy's latency overhead over no-refresh OverFill."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb  # noqa: F401


def bench_refresh(teacher, student, prompts, tokens: int = 256, repeats: int = 2, policies: dict | None = None):
    """Latency overhead % of each refresh policy against the no-refresh OverFill run, measured in
    this one run on the same prompts (greedy, fixed N, interleaved: none, p1, p2, … per repeat,
    after one warm-up). Overhead per prompt = median(total_s policy) / median(total_s none) - 1;
    the table shows the mean over prompts with teacher tokens and refreshes per run.
    Blog targets (N = 1200, 3B pair, GPU): periodic T=64 ≤ 3.9 %, speculative k=8 ≤ 1.9 %,
    entropy-gated ≈ 0 teacher cost until it fires. Nothing is asserted."""
    import pandas as pd

    from kvlab.decode import DecodeConfig, run
    from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative
    from kvlab.harness.costs import run_costs

    if policies is None:
        policies = {"periodic_T64": Periodic(64), "speculative_k8": Speculative(8),
                    "entropy_tau6.0": EntropyGate(6.0), "entropy_never": EntropyGate(1e6),
                    "probe_kl_M8": ProbeKL(8, 0.5)}
    names = ["none", *policies]
    cfgs = {n: DecodeConfig(mode="overfill", max_new_tokens=tokens, refresh=policies.get(n)) for n in names}
    run(teacher, student, prompts[0], cfgs["none"])   # warm-up
    times = {(n, i): [] for n in names for i in range(len(prompts))}
    costs = {}
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for n in names:
                tr = run(teacher, student, prompt, cfgs[n])
                times[n, i].append(tr.total_s)
                costs[n, i] = run_costs(tr.records)
    rows = []
    for n in names:
        over = [100 * (statistics.median(times[n, i]) / statistics.median(times["none", i]) - 1)
                for i in range(len(prompts))]
        rows.append({"policy": n, "overhead_pct": round(statistics.mean(over), 2),
                     "overhead_pct_min": round(min(over), 2), "overhead_pct_max": round(max(over), 2),
                     "total_s": round(statistics.mean(statistics.median(times[n, i]) for i in range(len(prompts))), 3),
                     "refreshes": statistics.mean(costs[n, i]["refreshes"] for i in range(len(prompts))),
                     "teacher_tokens": statistics.mean(costs[n, i]["teacher_tokens"] for i in range(len(prompts))),
                     "teacher_pct_in_run": round(statistics.mean(costs[n, i]["teacher_pct"] for i in range(len(prompts))), 2)})
    df = pd.DataFrame(rows)
    df.attrs["info"] = {"tokens": tokens, "prompts": len(prompts), "repeats": repeats,
                        "device": str(teacher.device)}
    return df
