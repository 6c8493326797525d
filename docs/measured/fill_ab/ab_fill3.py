import sys, json, torch
torch.set_num_threads(2)
import kvlab.core.packed as pk; pk.BACKEND = "auto"
from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import bench_evict_batch, batch_evict_policies
import kvlab.cache.evict as ev
from kvlab.store.provenance import describe_machine
lm = load_teacher("cpu", "float32")
print("machine", describe_machine(), "packed", pk.backend(), flush=True)
names = sys.argv[1].split(",")
allp = batch_evict_policies(4096)
pols = {n: allp[n] for n in names}
for run, fill in enumerate((True, False, True, False), 1):
    ev.FILL = fill
    rows = bench_evict_batch(lm, batches=(8,), cache_len=4096, steps=64, repeats=3, policies=pols, every=(16,))
    for r in rows:
        print("run", run, "FILL", fill, r["policy"], "step", r["step_ms"], "plain", r["plain_ms"], "asked", r["asked_ms"],
              "e/p", r["evict_vs_plain"], [r["evict_vs_plain_lo"], r["evict_vs_plain_hi"]], flush=True)
