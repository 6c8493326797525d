"""A policy asked at every step (as `bench evict` runs it: measured forwards, lazy holes), batch 8, 4,096 -> its budget:
each variant its own bank of 8 rows, stepped in turn with a plain bank put back to the evicting rows' length every 16
steps (untimed; the first plain step after that not counted). Prints each variant's phases per step (medians: the
measuring forward, the views, the decision, the edit, their total) against the plain step, the largest forwards and
edits (a compaction of the lazy holes shows there), and for two variants their paired ratio.
usage: every_step.py POLICY NSTEPS VARIANTS   (variants: names in PATCHES; `new` the library as it is, `old_low` the
low-query counts per layer inside the attention as before session 23; `one` each row's edit on its own (apply_keep)
as before session 24, `new` all rows at once (apply_keep_rows); `keepviews` the views held through the edit (their
live maps copied then, as every view's were when taken before session 25); `fillm` measured rows' evictions fill
(kvlab.cache.evict.FILL_MEASURED on; off by default); ABPATCH=FILE adds PATCHES entries)
env: PROFAPPLY=1 / PROFVIEWS=1 profile the edits / the views and decisions (PROFSORT, PROFN); DECODE, PACKED as the
bench ("auto" by default here)."""
import sys, time, statistics, os
from types import SimpleNamespace
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = os.environ.get("DECODE", "auto") or None
packed.BACKEND = os.environ.get("PACKED", "auto") or None
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
import kvlab.cache.batch as kb
from kvlab.cache.mass import MassSink
from kvlab.cache.deferred import settle_rows
from kvlab.studies.bench.evict_batch import _Signals
from kvlab.decode.evict_phase import apply_keep, apply_keep_rows, evict_view
from kvlab.decode.protocols import keep_rows, measures_at, evict_attr
from kvlab.studies.bench.evict_batch import attention_prefill
name, N = sys.argv[1], int(sys.argv[2]); variants = sys.argv[3].split(",")
STATE = {}
def base():
    kb.MassSink = MassSink
    STATE["one"] = False
    STATE["keepviews"] = False
    evict_mod.FILL_MEASURED = False
    for f in STATE.get("undo", []): f()
def old_low():
    kb.MassSink = lambda *a, **k: MassSink(*a, **{**k, "low_later": False})
import importlib
extra = os.environ.get("ABPATCH")
def one():
    STATE["one"] = True
def keepviews():
    STATE["keepviews"] = True
import kvlab.cache.evict as evict_mod
def fillm():
    evict_mod.FILL_MEASURED = True
PATCHES = {"new": lambda: None, "old_low": old_low, "one": one, "keepviews": keepviews, "fillm": fillm}
if extra: exec(open(extra).read())
from common import CL, B, setup
model, vocab, ids, pol = setup(name)
need = bool(evict_attr(pol, "needs_attention"))
plain_src = KVCache(); plain_src.forward(model, ids, writer="teacher")
src = attention_prefill(model, ids, pol) if need else plain_src
def setv(v): base(); PATCHES[v]()
runs = {}
for v in variants:
    setv(v)
    bank = Bank.for_model(model, B, capacity=CL + N + 40)
    runs[v] = dict(bank=bank, c=[bank.adopt(b, src) for b in range(B)], ph={k: [] for k in ("fwd", "views", "decide", "apply", "tot")})
pbank = Bank.for_model(model, B, capacity=CL + N + 40)
plain = []
pc = None
def ev(v, step):
    r = runs[v]; c = r["c"]; setv(v)
    t0 = time.perf_counter()
    logits = forward_rows(r["bank"], model, c, [7] * B, writer="teacher", steps=[step] * B, attention=[measures_at(pol, step)] * B)
    t1 = time.perf_counter()
    if PV is not None and step > 8: PV.enable()
    settle_rows(c)
    sig = _Signals(logits)                    # as the bench (session 24): token statistics when a policy reads them
    views = [evict_view(cc, step, sig.row(step, b), vocab, first=step == 1) for b, cc in enumerate(c)]
    t2 = time.perf_counter()
    dec = keep_rows(pol, views)
    if not STATE.get("keepviews"):
        del views                             # released before the edit, as the bench (session 25)
    if PV is not None and step > 8: PV.disable()
    t3 = time.perf_counter()
    if PR is not None and step > 8: PR.enable()
    if STATE.get("one"):
        for cc, d in zip(c, dec): apply_keep(cc, d, model)
    else:
        apply_keep_rows(c, dec, model)
    if PR is not None and step > 8: PR.disable()
    t4 = time.perf_counter()
    if step > 8:
        for k, x in zip(("fwd", "views", "decide", "apply", "tot"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)): r["ph"][k].append(x)
import cProfile, pstats, io
PR = cProfile.Profile() if os.environ.get("PROFAPPLY") else None
PV = cProfile.Profile() if os.environ.get("PROFVIEWS") else None
fresh = True
for step in range(1, N + 1):
    order = variants + ["plain"]; k = step % len(order); order = order[k:] + order[:k]
    for who in order:
        if who != "plain":
            ev(who, step)
        elif pc is not None:
            base(); t0 = time.perf_counter()
            forward_rows(pbank, model, pc, [7] * B, writer="teacher", steps=[step] * B)
            if step > 8 and not fresh: plain.append(time.perf_counter() - t0)
            fresh = False
    if step == 1 or step % 16 == 0:
        p = plain_src.copy(); p.crop(len(runs[variants[0]]["c"][0])); pc = [pbank.adopt(b, p) for b in range(B)]; fresh = True
pm = 1000 * statistics.median(plain)
for v in variants:
    med = {k: round(1000 * statistics.median(x), 2) for k, x in runs[v]["ph"].items()}
    print(name, v, med, "plain", round(pm, 2), "tot/plain", round(med["tot"] / pm, 3), "sum/plain", round(statistics.mean(runs[v]["ph"]["tot"]) / statistics.mean(plain), 3), flush=True)
    for k in ("fwd", "apply"):
        x = runs[v]["ph"][k]; top = sorted(range(len(x)), key=lambda i: -x[i])[:4]
        print("   top", k, [(i + 9, round(1000 * x[i], 1)) for i in top], "mean", round(1000 * statistics.mean(x), 2))
if len(variants) == 2:
    a, b = (runs[v]["ph"]["tot"] for v in variants)
    rat = [x / y for x, y in zip(a, b)]
    print(f"{variants[0]}/{variants[1]} paired median", round(statistics.median(rat), 3), "sum", round(sum(a) / sum(b), 3))

if PV is not None: PR = PV
if PR is not None:
    sio = io.StringIO(); pstats.Stats(PR, stream=sio).sort_stats(os.environ.get("PROFSORT", "tottime")).print_stats(int(os.environ.get("PROFN", "40"))); print(sio.getvalue()[-12000:])
