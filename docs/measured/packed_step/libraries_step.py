import time, statistics, torch
torch.set_num_threads(2)
from kvlab.core.models import load_teacher
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.core import packed as P
lm = load_teacher("cpu", "float32"); model = lm.model
print("timed choice:", P.backend())
g = torch.Generator().manual_seed(0)
ids = torch.randint(0, 49152, (1030,), generator=g).tolist()
src = KVCache(); src.forward(model, ids, writer="teacher")
B = 8
banks = {}
for lib in ("mkl", "onednn"):
    bank = Bank.for_model(model, B, capacity=1200)
    banks[lib] = (bank, [bank.adopt(b, src) for b in range(B)])
ts = {k: [] for k in banks}; toks = {k: [] for k in banks}
step = {k: 0 for k in banks}
for blk in range(6):
    for lib in (["mkl", "onednn"] if blk % 2 else ["onednn", "mkl"]):
        P.BACKEND = lib
        bank, caches = banks[lib]
        for r in range(8):
            tok = toks[lib][-1] if toks[lib] else [7] * B
            step[lib] += 1
            t0 = time.perf_counter()
            logits = forward_rows(bank, model, caches, tok, writer="teacher", steps=[step[lib]] * B)
            if r:
                ts[lib].append(time.perf_counter() - t0)
            toks[lib].append(logits.argmax(-1).tolist())
print({k: round(1000 * statistics.median(v), 1) for k, v in ts.items()})
print("same greedy tokens:", toks["mkl"] == toks["onednn"])
