"""A/B in one process: H2O-style statistics deferred with queries vs in bank columns vs a plain step, batch 8 at
~1,040 entries, settle every 16 steps, the three stepped alternately (order rotating). Prints ms per step (period
means incl. the settle) and the settle alone."""
import os, statistics, sys, time, json
import torch
torch.set_num_threads(int(os.environ.get("NT", "2")))
import kvlab.cache.batch as cb
from kvlab.core.models import load_teacher
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows
lm = load_teacher("cpu", "float32"); model = lm.model
T, B, E, P = 1040, 8, 16, int(os.environ.get("P", "4"))
below = "below" in sys.argv
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 49152, (T,), generator=g).tolist()
src = KVCache(); src.track_attention(0.9, below=below); src.forward(model, ids, writer="teacher", attention=True)
def mk():
    bank = Bank.for_model(model, B, capacity=T + E * P + 8)
    return bank, [bank.adopt(b, src) for b in range(B)]
banks = {k: mk() for k in ("plain", "queries", "columns")}
real_ok = cb.columns_ok
def step(kind, j):
    bank, cs = banks[kind]
    cb.columns_ok = real_ok if kind == "columns" else (lambda caches: False)
    t0 = time.perf_counter()
    if kind == "plain":
        forward_rows(bank, model, cs, [5] * B, writer="teacher", steps=[j] * B)
        s = 0.0
    else:
        forward_rows(bank, model, cs, [5] * B, writer="teacher", steps=[j] * B, defer=[True] * B)
        t1 = time.perf_counter()
        if j % E == 0:
            settle_rows(cs)
        s = time.perf_counter() - t1
    return time.perf_counter() - t0, s
res = {k: [] for k in banks}; settles = {k: [] for k in banks}
kinds = list(banks)
for j in range(1, E * P + 1):
    k0 = j % 3
    for kind in kinds[k0:] + kinds[:k0]:
        t, s = step(kind, j)
        res[kind].append(t)
        if j % E == 0: settles[kind].append(s)
per = {k: statistics.median([statistics.mean(v[i:i + E]) for i in range(E, len(v), E)]) for k, v in res.items()}
out = {"batch": B, "entries": T, "every": E, "periods": P - 1, "below": below,
       **{f"{k}_ms": round(1000 * v, 2) for k, v in per.items()},
       **{f"{k}_settle_ms": round(1000 * statistics.median(v[1:]), 2) for k, v in settles.items() if k != "plain"}}
out["queries_vs_plain"] = round(per["queries"] / per["plain"], 3)
out["columns_vs_plain"] = round(per["columns"] / per["plain"], 3)
print(json.dumps(out))
