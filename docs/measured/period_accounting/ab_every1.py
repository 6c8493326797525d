"""A/B in one process: a policy asked at every step, its rows measuring each step (attention=True) vs deferring into
bank columns and settling at each ask (EVERY_STEP), 8 rows at 4,096 -> ~1,030, alternating steps. usage: POLICY STEPS"""
import sys, time, statistics, os
from types import SimpleNamespace
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = "auto"; packed.BACKEND = "auto"
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows
from kvlab.decode.sampling import token_stats_rows
from kvlab.decode.evict_phase import apply_keep, evict_view
from kvlab.decode.protocols import keep_rows
from kvlab.studies.bench.evict_batch import attention_prefill
name, S = sys.argv[1], int(sys.argv[2])
from common import CL, B, setup
model, vocab, ids, pol = setup(name)
src = attention_prefill(model, ids, pol)
runs = {}
for v in ("measure", "defer"):
    bank = Bank.for_model(model, B, capacity=CL + S + 80)
    runs[v] = (bank, [bank.adopt(b, src) for b in range(B)])
T = {v: [] for v in runs}; P = {v: {} for v in runs}
def step(v, st):
    bank, caches = runs[v]
    d = v == "defer"
    t0 = time.perf_counter()
    logits = forward_rows(bank, model, caches, [7] * B, writer="teacher", steps=[st] * B, attention=[not d] * B, defer=[d] * B)
    t1 = time.perf_counter()
    settle_rows(caches)
    views = [evict_view(c, st, SimpleNamespace(step=st, entropy_bits=e, top1_prob=t, margin=m), vocab, first=st == 1)
             for c, (_, e, t, m, _) in zip(caches, token_stats_rows(logits))]
    t2 = time.perf_counter()
    for c, k in zip(caches, keep_rows(pol, views)): apply_keep(c, k, model)
    t3 = time.perf_counter()
    for k, x in (("fwd", t1 - t0), ("settle+views", t2 - t1), ("decide+apply", t3 - t2)):
        P[v].setdefault(k, []).append(x)
    return t3 - t0
for st in range(1, S + 1):
    for v in (("measure", "defer") if st % 2 else ("defer", "measure")):
        x = step(v, st)
        if st > 3: T[v].append(x)
print(name, {v: round(1000 * statistics.median(t), 2) for v, t in T.items()}, "defer/measure paired median",
      round(statistics.median([a / b for a, b in zip(T["defer"], T["measure"])]), 3), "sum", round(sum(T["defer"]) / sum(T["measure"]), 3))
for v in P: print("  ", v, {k: round(1000 * statistics.median(x[3:]), 2) for k, x in P[v].items()})
