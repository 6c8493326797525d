import json, sys
import kvlab.cache.deferred as D
from kvlab.core.models import load_teacher
from kvlab.studies.bench.evict_batch import bench_evict_batch, batch_evict_policies
lm = load_teacher()
P = batch_evict_policies(4096)
pols = {"full": P["full"], "h2o": P["h2o"], "scissorhands": P["scissorhands"]}
new = D._rows_view
for variant in ("per_row", "joined"):
    D._rows_view = (lambda keys: None) if variant == "per_row" else new
    rows = bench_evict_batch(lm, batches=(8,), cache_len=4096, steps=32, repeats=2, policies=pols, every=(16,))
    for r in rows:
        print(json.dumps({"variant": variant, **{k: r.get(k) for k in ("policy", "every", "step_ms", "asked_ms", "plain_ms", "full_ms", "evict_vs_plain", "speedup_vs_full", "frac_of_bound", "plain_frac_of_bound", "mean_len")}}), flush=True)
