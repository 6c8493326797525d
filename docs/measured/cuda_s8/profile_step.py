"""Where a batched eviction step's time goes on a CUDA device: torch.profiler over steps of ``bench evict``'s own
loop (kvlab.studies.bench.evict_batch.bench_evict_batch with one policy), the top host-side ops by self CPU time.

Usage: python profile_step.py OUT_DIR [POLICY,...] [CACHE_LEN] [BATCH]   (default sliding,h2o,confkv 4096 8)"""
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import batch_evict_policies, bench_evict_batch

out = Path(sys.argv[1])
names = (sys.argv[2] if len(sys.argv) > 2 else "sliding,h2o,confkv").split(",")
cl = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
B = int(sys.argv[4]) if len(sys.argv) > 4 else 8
lm = load_teacher()
pols = batch_evict_policies(cl)
out.mkdir(parents=True, exist_ok=True)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
for n in names:
    bench_evict_batch(lm, batches=(B,), cache_len=cl, steps=8, repeats=1, policies={n: pols[n]})   # warm
    with profile(activities=acts) as prof:
        rows = bench_evict_batch(lm, batches=(B,), cache_len=cl, steps=8, repeats=1, policies={n: pols[n]})
    ka = prof.key_averages()
    parts = "\n".join(f"{e.key:24s} calls {e.count:4d}  cpu total {e.cpu_time_total / 1e3:9.2f} ms"
                      f"  per call {e.cpu_time_total / 1e3 / e.count:8.3f} ms"
                      for e in ka if e.key.startswith("evict_bench."))
    t = parts + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=40)
    head = f"# {n} at batch {B}, {cl} entries on {lm.device} {lm.dtype}: {rows[0]}\n"
    (out / f"profile_{n}.txt").write_text(head + t)
    print(head + t[:3000], flush=True)
