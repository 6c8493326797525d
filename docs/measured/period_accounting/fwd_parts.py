"""Where an evicting step's forward differs from a plain one (session 25): bank rows of a policy evicting at every
step (holes, as the bench), stepped alternately measured (then asked: views, decision, edit) and unmeasured (the same
rows, no statistics taken, no edit), each beside a plain bank put back to their length every 8 steps; prints the
median forward of each kind, the live length and the mean holes per layer at the end.
usage: fwd_parts.py POLICY NSTEPS   (env DECODE as the bench, "auto" by default here)"""
import sys, os, time, statistics
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = os.environ.get("DECODE", "auto") or None
packed.BACKEND = "auto"
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows
from kvlab.studies.bench.evict_batch import _Signals, attention_prefill
from kvlab.decode.evict_phase import apply_keep_rows, evict_view
from kvlab.decode.protocols import keep_rows
from common import CL, B, setup
name, N = sys.argv[1], int(sys.argv[2])
model, vocab, ids, pol = setup(name)
plain_src = KVCache(); plain_src.forward(model, ids, writer="teacher")
src = attention_prefill(model, ids, pol)
bank = Bank.for_model(model, B, capacity=CL + 2 * N + 40); c = [bank.adopt(b, src) for b in range(B)]
pbank = Bank.for_model(model, B, capacity=CL + 2 * N + 40); pc = None
T = {"meas": [], "unmeas": [], "plain": []}
for step in range(1, N + 1):
    if step == 1 or step % 8 == 0:
        p = plain_src.copy(); p.crop(len(c[0])); pc = [pbank.adopt(b, p) for b in range(B)]; fresh = True
    meas = step % 2 == 1
    order = ["ev", "plain"] if step % 4 < 2 else ["plain", "ev"]
    for who in order:
        if who == "ev":
            t0 = time.perf_counter()
            logits = forward_rows(bank, model, c, [7] * B, writer="teacher", steps=[step] * B, attention=[meas] * B)
            dt = time.perf_counter() - t0
            if step > 8: T["meas" if meas else "unmeas"].append(dt)
            if meas:
                settle_rows(c); sig = _Signals(logits)
                views = [evict_view(cc, step, sig.row(step, b), vocab, first=step == 1) for b, cc in enumerate(c)]
                dec = keep_rows(pol, views); del views
                apply_keep_rows(c, dec, model)
        else:
            t0 = time.perf_counter()
            forward_rows(pbank, model, pc, [7] * B, writer="teacher", steps=[step] * B)
            dt = time.perf_counter() - t0
            if step > 8 and not fresh: T["plain"].append(dt)
            fresh = False
print({k: round(1000 * statistics.median(v), 2) for k, v in T.items()}, {k: len(v) for k, v in T.items()}, "len", len(c[0]), "holes", sum(len(l.holes) for l in bank.rows[0]) / 30)
