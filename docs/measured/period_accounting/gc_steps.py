"""Python's garbage collector at every step (session 25): a policy asked at every step, batch 8, 4,096 -> its budget,
as `bench evict` runs it (measured forwards, views released before the edit); prints the collections' time per step
(gc.callbacks), their count per generation and the step's time, over 50 steps after 9.
usage: gc_steps.py POLICY   (env KEEPVIEWS=1: the views held through the edit, so the live maps are copied then)"""
import gc, os, sys, time
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = "auto"; packed.BACKEND = "auto"
from kvlab.cache.batch import Bank, forward_rows
from kvlab.decode.evict_phase import apply_keep_rows, evict_view
from kvlab.decode.protocols import keep_rows
from kvlab.studies.bench.evict_batch import attention_prefill, _Signals
from common import CL, B, setup
name = sys.argv[1]
keep = os.environ.get("KEEPVIEWS") == "1"
model, vocab, ids, pol = setup(name)
src = attention_prefill(model, ids, pol)
bank = Bank.for_model(model, B, capacity=CL + 200)
c = [bank.adopt(b, src) for b in range(B)]
G = {"t": 0.0, "s": 0.0, "n": [0, 0, 0], "on": False}
def cb(phase, info):
    if not G["on"]: return
    if phase == "start": G["s"] = time.perf_counter()
    else: G["t"] += time.perf_counter() - G["s"]; G["n"][info["generation"]] += 1
gc.callbacks.append(cb)
for step in range(1, 60):
    if step == 10: G["on"] = True; t_on = time.perf_counter()
    logits = forward_rows(bank, model, c, [7] * B, writer="teacher", steps=[step] * B, attention=[True] * B)
    sig = _Signals(logits)
    views = [evict_view(cc, step, sig.row(step, b), vocab, first=step == 1) for b, cc in enumerate(c)]
    dec = keep_rows(pol, views)
    if not keep:
        del views
    apply_keep_rows(c, dec, model)
print(name, "views kept" if keep else "views released", "GC ms per step", round(1000 * G["t"] / 50, 3),
      "collections", G["n"], "step ms", round(1000 * (time.perf_counter() - t_on) / 50, 2))
