"""evict/plain over many whole periods (asked every E), in-process, variants interleaved per period.
usage: periods.py POLICY NPERIODS VARIANTS(comma: base,fill,holes,rows,one; rows: every row's edit at once,
apply_keep_rows, as the library since session 24; one: row by row, apply_keep, as before)  (env E: the period, default 16; DECODE, PACKED:
kvlab.core.decode_attn.DECODE / kvlab.core.packed.BACKEND, "auto" as the bench runs them; unset: None)
Each variant is its own bank of 8 rows at 4,096 -> about 1,040 entries (the bulk cut and one period untimed); every
step alternates (order flipping) with a plain bank whose rows are put back to the evicting rows' live length at each
ask (untimed). Prints per-period ratios and the period's cost split: forwards between asks, the asked forward, and
the ask's phases (settle, views, decision, edit), each in plain steps."""
import sys, time, statistics, os
from types import SimpleNamespace
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = os.environ.get("DECODE") or None    # as the bench runs: DECODE=auto PACKED=auto
packed.BACKEND = os.environ.get("PACKED") or None
from kvlab.core.models import load_teacher
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows, defers
from kvlab.studies.bench.evict_batch import _Signals
from kvlab.decode.evict_phase import apply_keep, apply_keep_rows, evict_view
from kvlab.decode.protocols import evict_due, keep_rows, measures_at, evict_attr
from kvlab.studies.bench.evict_batch import batch_evict_policies, attention_prefill, with_every, _settings
import kvlab.cache.evict as kev
name, NP = sys.argv[1], int(sys.argv[2]); variants = sys.argv[3].split(",")
E = int(os.environ.get("E", "16"))
lm = load_teacher("cpu", "float32"); model = lm.model
CL, B = 4096, 8
g = torch.Generator().manual_seed(0)
vocab = int(model.get_input_embeddings().weight.shape[0])
ids = torch.randint(0, vocab, (CL,), generator=g).tolist()
pol = with_every({name: batch_evict_policies(CL)[name]}, [E])[name if E == 1 else f"{name}/every{E}"][2]
need = bool(evict_attr(pol, "needs_attention"))
src = attention_prefill(model, ids, pol) if need else None
plain_src = KVCache(); plain_src.forward(model, ids, writer="teacher")
if src is None: src = plain_src
later = need and E > 1 and defers("cpu")     # as the bench: a policy asked at every step measures each step
SETTINGS = {"base": {}, "fill": {"FILL": True}, "holes": {"FILL": False}, "rows": {"ROWS": True},
            "one": {"ROWS": False}}   # base: the library's default FILL, rows at once
FILL0 = kev.FILL
ROWS = [True]
def setv(v):
    kev.FILL = SETTINGS[v].get("FILL", FILL0)
    ROWS[0] = SETTINGS[v].get("ROWS", True)
class Run:
    def __init__(self, v):
        setv(v)
        self.bank = Bank.for_model(model, B, capacity=CL + 4 * E)
        self.c = [self.bank.adopt(b, src) for b in range(B)]
        self.pbank = Bank.for_model(model, B, capacity=CL + 4 * E)
        self.step = 0
        self.tev, self.tpl = [], []
        self.ph = {}
        self.period()                     # the bulk cut + first period, untimed
        self.tev, self.tpl, self.ph = [], [], {}
    def fwd(self, step):
        return forward_rows(self.bank, model, self.c, [7] * B, writer="teacher", steps=[step] * B,
                            attention=[measures_at(pol, step) and not later] * B,
                            defer=[measures_at(pol, step) and later] * B)
    def ask(self, step, logits):
        if PROFASK and self.tpl: PR["ask"].enable()
        t0 = time.perf_counter()
        settle_rows(self.c)
        t1 = time.perf_counter()
        sig = _Signals(logits)                # as the bench (session 24): token statistics when a policy reads them
        views = [evict_view(c, step, sig.row(step, b), vocab, first=step == 1) for b, c in enumerate(self.c)]
        t2 = time.perf_counter()
        dec = keep_rows(pol, views)
        del views                                 # released before the edit, as the bench (session 25)
        t3 = time.perf_counter()
        if ROWS[0]:
            apply_keep_rows(self.c, dec, model)
        else:
            for c, d in zip(self.c, dec): apply_keep(c, d, model)
        t4 = time.perf_counter()
        if PROFASK and self.tpl: PR["ask"].disable()
        for k, x in zip(("settle", "views", "decide", "apply"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            self.ph.setdefault(k, []).append(x)
    def period(self):
        ev = pl = 0.0
        for j in range(E):
            self.step += 1
            st = self.step
            for who in (("ev", "pl") if (st + len(self.tev)) % 2 else ("pl", "ev")):
                if who == "ev":
                    t = time.perf_counter()
                    if PROF and j == PROFJ and self.tpl: PR["ev"].enable()
                    logits = self.fwd(st)
                    if PROF and j == PROFJ and self.tpl: PR["ev"].disable()
                    self.ph.setdefault("fwd_ask" if evict_due(pol, st) else "fwd", []).append(time.perf_counter() - t)
                    if evict_due(pol, st):
                        self.ask(st, logits)
                    ev += time.perf_counter() - t
                    if evict_due(pol, st):      # plain rows back to the evicting rows' live length (untimed)
                        n = len(self.c[0])
                        p = plain_src.copy(); p.crop(n)
                        self.pc = [self.pbank.adopt(b, p) for b in range(B)]
                        pending_first = True
                elif getattr(self, "pc", None) is not None:
                    t = time.perf_counter()
                    if PROF and j == PROFJ and self.tpl: PR["pl"].enable()
                    forward_rows(self.pbank, model, self.pc, [7] * B, writer="teacher", steps=[st] * B)
                    if PROF and j == PROFJ and self.tpl: PR["pl"].disable()
                    pl += time.perf_counter() - t
                    self.ph.setdefault("plain", []).append(time.perf_counter() - t)
        self.tev.append(ev); self.tpl.append(pl)
runs = {}
import cProfile, pstats, io
PROF = os.environ.get("PROF") == "1"
PROFJ = int(os.environ.get("PROFJ", "6"))   # which step of the period PROF profiles (0: the asked one)
PROFASK = os.environ.get("PROFASK") == "1"   # profile the asks (settle, views, decision, edit) instead
PR = {"ev": cProfile.Profile(), "pl": cProfile.Profile(), "ask": cProfile.Profile()}
for v in variants:
    runs[v] = Run(v)
for k in range(NP):
    for v in (variants if k % 2 == 0 else variants[::-1]):
        setv(v); runs[v].period()
for v, r in runs.items():
    rat = [a / b for a, b in zip(r.tev[1:], r.tpl[1:])]
    print(name, v, "periods", len(rat), "ev/plain median", round(statistics.median(rat), 3), "sum", round(sum(r.tev[1:]) / sum(r.tpl[1:]), 3),
          "ev ms/step", round(1000 * statistics.median(r.tev[1:]) / E, 1), "plain", round(1000 * statistics.median(r.tpl[1:]) / E, 1), flush=True)
    print("   ", [round(x, 3) for x in rat])
    print("    phases ms (median, mean):", {k: (round(1000 * statistics.median(x), 1), round(1000 * statistics.mean(x), 1)) for k, x in r.ph.items()})
    n = E - 1                             # per period: E - 1 forwards between asks, E plain steps (the first beside the ask)
    fwd = sum(r.ph.get("fwd", [0.0])) / max(1, len(r.ph.get("fwd", []))); pln = sum(r.ph["plain"]) / len(r.ph["plain"])
    ask = sum(sum(r.ph[k]) for k in ("settle", "views", "decide", "apply")) / len(r.ph["apply"])
    print(f"    per period, in plain steps: between-ask forwards {(fwd / pln - 1) * n:.2f} over plain, asked forward "
          f"{sum(r.ph['fwd_ask']) / len(r.ph['fwd_ask']) / pln - 1:.2f}, ask phases {ask / pln:.2f} "
          f"(apply mean {1000 * sum(r.ph['apply']) / len(r.ph['apply']):.1f} ms); period of {E}: "
          f"{(fwd / pln - 1) * n / E:.3f} + {(sum(r.ph['fwd_ask']) / len(r.ph['fwd_ask']) / pln - 1) / E:.3f} + {ask / pln / E:.3f}")

if PROF or PROFASK:
    for k, p in PR.items():
        if (k == "ask") != PROFASK:
            continue
        sio = io.StringIO(); pstats.Stats(p, stream=sio).sort_stats(os.environ.get("PROFSORT", "tottime")).print_stats(int(os.environ.get("PROFN", "22"))); print("PROFILE", k); print(sio.getvalue()[-9000:])
        if os.environ.get("PROFCALLERS"):
            sio = io.StringIO(); pstats.Stats(p, stream=sio).sort_stats("tottime").print_callers(os.environ["PROFCALLERS"]); print(sio.getvalue()[-6000:])
