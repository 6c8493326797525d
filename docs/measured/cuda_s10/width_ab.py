"""Padded vs exact key widths in kvlab's batched step, A/B in one process: a plain ``forward_rows`` step (full cache,
no policy) on a bank of B rows holding a CONTEXT-token prefill, decoding NEW key widths every step (as a real decode
does; no exact width is seen twice), with ``kvlab.cache.batch.WIDTH_STEP`` as shipped (widths padded to a multiple
of 256 columns on CUDA) and emptied (exact widths: kvlab before this change). The arms alternate in blocks of STEPS
steps. Median ms per step per arm. Usage: python width_ab.py OUT_DIR [CONTEXT] [BATCH] [STEPS]"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import kvlab.cache.batch as cb
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.core.models import load_teacher
from kvlab.studies.bench.timing import _sync

out = Path(sys.argv[1])
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
steps = int(sys.argv[4]) if len(sys.argv) > 4 else 12
blocks = 3
lm = load_teacher()
model = lm.model
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, int(model.get_input_embeddings().weight.shape[0]), (ctx,), generator=g).tolist()
src = KVCache()
src.forward(model, ids, writer="teacher")
bank = Bank.for_model(model, B, capacity=ctx + 2 * blocks * steps + 8)
caches = [bank.adopt(b, src) for b in range(B)]
shipped = cb.WIDTH_STEP
arms = {"padded (shipped)": shipped, "exact (before)": {}}
times = {a: [] for a in arms}
s = 0
forward_rows(bank, model, caches, [17] * B, writer="teacher", steps=[0] * B)    # one warm-up step (its own width)
_sync()
for blk in range(blocks):
    for arm, devs in (arms.items() if blk % 2 == 0 else reversed(list(arms.items()))):
        cb.WIDTH_STEP = devs
        for _ in range(steps):
            s += 1
            t = time.perf_counter()
            forward_rows(bank, model, caches, [17] * B, writer="teacher", steps=[s] * B)
            _sync()
            times[arm].append(1000 * (time.perf_counter() - t))
cb.WIDTH_STEP = shipped
rows = [{"arm": a, "device": str(lm.device), "dtype": str(lm.dtype), "batch": B, "context": ctx,
         "steps": len(v), "median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2),
         "max_ms": round(max(v), 2), "torch": torch.__version__} for a, v in times.items()]
out.mkdir(parents=True, exist_ok=True)
(out / "width_ab.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
for r in rows:
    print(json.dumps(r))
