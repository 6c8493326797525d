"""Resident rows against a plain step (session 26): POLICY as `bench evict --batch` runs it at 4,096 -> its budget,
batch 8; the first step (the cut) through the batched loop, then the rows checked in (kvlab.cache.resident.Resident,
its check-in and check-out timed once) and stepped NSTEPS times (the forward, the policy's column_drop, the edit)
beside a plain bank at the rows' length (put back every 16 steps), alternating; prints the medians and the ratio.
usage: resident_step.py POLICY NSTEPS"""
import sys, time, statistics, torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = "auto"; packed.BACKEND = "auto"
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.resident import Resident
from kvlab.studies.bench.evict_batch import attention_prefill, _Signals
from kvlab.decode.evict_phase import apply_keep_rows, evict_view
from kvlab.decode.protocols import keep_rows, evict_attr
from common import CL, B, setup
name, N = sys.argv[1], int(sys.argv[2])
model, vocab, ids, pol = setup(name)
need = bool(evict_attr(pol, "needs_attention"))
plain_src = KVCache(); plain_src.forward(model, ids, writer="teacher")
src = attention_prefill(model, ids, pol) if need else plain_src
bank = Bank.for_model(model, B, capacity=CL + 40); c = [bank.adopt(b, src) for b in range(B)]
logits = forward_rows(bank, model, c, [7] * B, writer="teacher", steps=[1] * B, attention=[need] * B)
views = [evict_view(cc, 1, _Signals(logits).row(1, b), vocab, first=True) for b, cc in enumerate(c)]
apply_keep_rows(c, keep_rows(pol, views), model); del views
t0 = time.perf_counter(); cap = evict_attr(pol, 'column_capacity'); res = Resident(bank, c, cap(bank.num_layers) if callable(cap) else None, slots=bool(evict_attr(pol, 'column_slots'))); print("check-in ms", round(1000 * (time.perf_counter() - t0), 1))
pbank = Bank.for_model(model, B, capacity=CL + 40); pc = None
T = {"res": [], "res_fwd": [], "plain": []}
for step in range(2, N + 2):
    if step == 2 or step % 16 == 0:
        p = plain_src.copy(); p.crop(res.budget); pc = [pbank.adopt(b, p) for b in range(B)]; fresh = True
    for who in (["res", "plain"] if step % 2 else ["plain", "res"]):
        if who == "res":
            t0 = time.perf_counter()
            lg = res.step(model, [7] * B, writer="teacher", steps=[step] * B)
            t1 = time.perf_counter()
            sig = _Signals(lg)
            res.evict(pol.column_drop(res.view(step, [sig.row(step, b) for b in range(B)], vocab)))
            t2 = time.perf_counter()
            if step > 8: T["res"].append(t2 - t0); T["res_fwd"].append(t1 - t0)
        else:
            t0 = time.perf_counter()
            forward_rows(pbank, model, pc, [7] * B, writer="teacher", steps=[step] * B)
            if step > 8 and not fresh: T["plain"].append(time.perf_counter() - t0)
            fresh = False
t0 = time.perf_counter(); res.close(); print("check-out ms", round(1000 * (time.perf_counter() - t0), 1))
med = {k: round(1000 * statistics.median(v), 2) for k, v in T.items()}
print(name, med, "res/plain", round(med["res"] / med["plain"], 3), "sum", round(sum(T["res"]) / sum(T["plain"]) * len(T["plain"]) / len(T["res"]), 3))
