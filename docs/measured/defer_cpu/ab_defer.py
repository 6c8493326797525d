"""A/B: a policy asked every 16 steps, its attention statistics deferred to the asked step vs measured at each step.

Run alone (nothing else on the machine), from the repository root:
    python docs/measured/defer_cpu/ab_defer.py OUT.jsonl
Per round and mode, `bench_evict_batch` (batch 8, 4,096 -> 1,024 entries, 32 steps, H2O and Scissorhands asked
every 16 steps) with `kvlab.cache.deferred.DEFERS` set so that the CPU defers ("defer") or not ("each"); the
modes alternate over two rounds so drift of the machine falls on both. One JSON row per (round, mode, policy).
"""
import json
import subprocess
import sys
import time

from kvlab.cache import deferred
from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import batch_evict_policies, bench_evict_batch

out = open(sys.argv[1], "a")
lm = load_teacher()
P = batch_evict_policies(4096)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
for rnd in range(2):
    for mode in ("defer", "each") if rnd == 0 else ("each", "defer"):
        deferred.DEFERS.clear()
        deferred.DEFERS.update({"cuda": True, "cpu": mode == "defer"})
        t0 = time.time()
        rows = bench_evict_batch(lm, batches=(8,), cache_len=4096, steps=32, repeats=1,
                                 policies={"h2o": P["h2o"], "scissorhands": P["scissorhands"]}, every=(16,))
        for r in rows:
            if r.get("every") == 16:
                keep = {k: r.get(k) for k in ("policy", "every", "batch", "cache_len", "mean_len", "step_ms",
                                               "plain_ms", "evict_vs_plain", "asked_ms")}
                keep.update(round=rnd, mode=mode, commit=commit, wall_s=round(time.time() - t0, 1),
                            asked_over_plain=round(r["asked_ms"] / r["plain_ms"], 3))
                print(json.dumps(keep), file=out, flush=True)
                print(json.dumps(keep), flush=True)
