import sys, json, torch
torch.set_num_threads(2)
from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import bench_evict_batch, batch_evict_policies
import kvlab.cache.evict as ev
lm = load_teacher("cpu", "float32")
names = sys.argv[1].split(",")
allp = batch_evict_policies(4096)
pols = {n: allp[n] for n in names}
for fill in (True, False, True, False):
    ev.FILL = fill
    rows = bench_evict_batch(lm, batches=(8,), cache_len=4096, steps=64, repeats=2, policies=pols, every=(16,))
    for r in rows:
        print("FILL", fill, r["policy"], "step", r["step_ms"], "plain", r["plain_ms"], "asked", r["asked_ms"],
              "e/p", r["evict_vs_plain"], flush=True)
