"""One batched step's column statistics for 30 layers at batch 8 over 1,040 columns (the embedded teacher's shapes):
ColumnSink adding all layers at once through the bank's blocks vs one layer at a time (Bank.col_block off), the
head mean included. usage: sink_mb.py [repeats]  (alone on the machine; medians of interleaved runs, ms per step)"""
import statistics, sys, time
import torch
from kvlab.cache.bank import Bank
from kvlab.cache.deferred import ColumnSink
torch.set_num_threads(2)
L, B, H, T = 30, 8, 9, 1040
R = int(sys.argv[1]) if len(sys.argv) > 1 else 300
g = torch.Generator().manual_seed(0)
probs = [torch.softmax(torch.randn(B, H, 1, T, generator=g), -1) for _ in range(L)]
seen = torch.full((L, B, 1), float(T))
CASES = {"h2o": dict(below=False, pool=1), "scissorhands": dict(below=True, pool=1), "block": dict(below=False, pool=7)}
def step(bank, kw):
    s = ColumnSink(bank, [0] * L, 0.9, kw["below"], pool=kw["pool"], seen=seen if kw["below"] else None, spare=[6] * L)
    for i in range(L):
        s.take(i, probs[i].mean(1), None)
    s.apply(L)
for name, kw in CASES.items():
    banks = {}
    for blocked in (True, False):
        bank = Bank(B, L, 3, 64, dtype=torch.float32, device="cpu", capacity=4200)
        if not blocked:
            bank.col_block = lambda n: None
        banks[blocked] = bank
    ts = {True: [], False: []}
    for r in range(R):
        for blocked in ((True, False) if r % 2 else (False, True)):
            t = time.perf_counter(); step(banks[blocked], kw); ts[blocked].append(time.perf_counter() - t)
    print(f"{name}: all layers at once {1000 * statistics.median(ts[True]):.3f} ms, layer by layer "
          f"{1000 * statistics.median(ts[False]):.3f} ms")
