"""Where kvlab's plain batched step (full cache, no policy) spends its host time: cProfile over 16 steps of
``forward_rows`` on a bank of B rows holding a CONTEXT-token prefill, after 4 warm-up steps; the step time without the
profiler first. Usage: python plain_prof.py OUT_DIR [CONTEXT] [BATCH]"""
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.core.models import load_teacher
from kvlab.studies.bench.timing import _sync

out = Path(sys.argv[1])
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
B = int(sys.argv[3]) if len(sys.argv) > 3 else 8
lm = load_teacher()
model = lm.model
ids = torch.randint(0, int(model.get_input_embeddings().weight.shape[0]), (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
src = KVCache()
src.forward(model, ids, writer="teacher")
bank = Bank.for_model(model, B, capacity=ctx + 64)
caches = [bank.adopt(b, src) for b in range(B)]


def step(s):
    forward_rows(bank, model, caches, [17] * B, writer="teacher", steps=[s] * B)
    _sync()


for s in range(1, 5):
    step(s)
times = []
for s in range(5, 21):
    t = time.perf_counter()
    step(s)
    times.append(1000 * (time.perf_counter() - t))
pr = cProfile.Profile()
pr.enable()
for s in range(21, 37):
    step(s)
pr.disable()
buf = io.StringIO()
pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(45)
head = f"# plain forward_rows, batch {B}, {ctx} entries, {lm.device} {lm.dtype}: median step {statistics.median(times):.2f} ms\n"
out.mkdir(parents=True, exist_ok=True)
(out / "plain_prof.txt").write_text(head + buf.getvalue())
print(head + buf.getvalue()[:6000])
