"""The floor of an every-step H2O eviction at batch 8 (4,096-token prompt -> its 1,024-entry budget) when the
eviction's whole state is bank-wide tensors: each layer's K/V one (B, H_kv, budget + 1, D) buffer whose new entry is
written into the column the last eviction freed (no holes, nothing moves), the accumulated attention, positions and
ledger rows per column as (L, B, budget + 1) tensors, H2O's decision one masked argmin per step, the edit three
scatters. Stepped beside (a) the same explicit step without the mass or the decision over the same width (a ring
buffer: the ideal plain step at that length) and (b) the library's plain batched step (forward_rows, put back to the
budget's length every 16 steps, as every_step.py). Prints medians and the paired ratios.
usage: floor.py NSTEPS"""
import sys, time, statistics
import torch
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = "auto"; packed.BACKEND = "auto"
from transformers.cache_utils import Cache, DynamicLayer
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.mass import MassSink, KWARG as MASS
from kvlab.cache.step import explicit_step
from common import CL, B, setup

N = int(sys.argv[1])
model, vocab, ids, pol = setup("h2o")
budget, recent = pol.budget, pol.recent
src = KVCache(); src.forward(model, ids, writer="teacher")
L = model.config.num_hidden_layers
step_fn = explicit_step(model)
C = budget + 1                                            # budget entries + the step's new one


class Col(DynamicLayer):
    """Writes row b's new entry at column cols[b] of (B, H_kv, C, D) buffers; returns all C columns."""
    def __init__(self, k, v, cols):
        super().__init__(); self.k, self.v, self.cols = k, v, cols
        self.rows = torch.arange(B); self.is_initialized = True
    def update(self, ks, vs, *a, **kw):
        self.k[self.rows, :, self.cols] = ks[:, :, 0]
        self.v[self.rows, :, self.cols] = vs[:, :, 0]
        return self.k, self.v


class StepCache(Cache):
    def __init__(self, layers):
        super().__init__(layers=layers)


def buffers():
    ks, vs = [], []
    for i in range(L):
        lay = src._store.layers[i]
        k, v = lay.keys[:, :, CL - budget:], lay.values[:, :, CL - budget:]             # (1, H_kv, budget, D)
        kb = torch.zeros(B, k.shape[1], C, k.shape[3]); vb = torch.zeros_like(kb)
        kb[:, :, :budget] = k; vb[:, :, :budget] = v
        ks.append(kb); vs.append(vb)
    return ks, vs


class Evict:
    def __init__(self):
        self.k, self.v = buffers()
        pos0 = torch.arange(CL - budget, CL)
        self.pos = torch.full((L, B, C), -1, dtype=torch.long); self.pos[:, :, :budget] = pos0
        self.row = self.pos.clone()                                                       # ledger row per column
        self.acc = torch.zeros(L, B, C)
        self.free = torch.full((L, B), budget, dtype=torch.long)                          # (L, B) column to write
        self.next = CL; self.events = []; self.ledger = [[] for _ in range(B)]

    def step(self, token):
        t0 = time.perf_counter()
        at = self.free[..., None]                                                         # (L, B, 1)
        self.pos.scatter_(2, at, self.next); self.row.scatter_(2, at, self.next); self.acc.scatter_(2, at, 0.0)
        sink = MassSink(None, False, None); sink.block = torch.empty(L, B, C)
        cache = StepCache([Col(self.k[i], self.v[i], self.free[i]) for i in range(L)])
        ids_t = torch.full((B, 1), token, dtype=torch.long); pos_t = torch.full((B, 1), self.next, dtype=torch.long)
        logits = step_fn(ids_t, pos_t, cache, 1, kvlab_masks=[None] * L, **{MASS: sink})
        tok = logits[:, -1].argmax(-1).tolist()
        t1 = time.perf_counter()
        for b in range(B): self.ledger[b].append(self.next)
        self.acc += sink.block                                                            # H2O's statistic
        score = self.acc.masked_fill(self.pos > self.next - recent, float("inf"))        # newest `recent` kept
        ev = score.argmin(-1)                                                             # (L, B) column to drop
        self.events.append(self.row.gather(2, ev[..., None]))                             # the dropped ledger rows
        self.free = ev
        self.next += 1
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


class Ring:
    """The plain step at the same width: the new entry over the oldest column, no mass, no decision."""
    def __init__(self):
        self.k, self.v = buffers(); self.i = budget; self.next = CL
    def step(self, token):
        t0 = time.perf_counter()
        cols = torch.full((B,), self.i, dtype=torch.long)
        cache = StepCache([Col(self.k[i], self.v[i], cols) for i in range(L)])
        ids_t = torch.full((B, 1), token, dtype=torch.long); pos_t = torch.full((B, 1), self.next, dtype=torch.long)
        logits = step_fn(ids_t, pos_t, cache, 1, kvlab_masks=[None] * L)
        tok = logits[:, -1].argmax(-1).tolist()
        self.i = (self.i + 1) % C; self.next += 1
        return time.perf_counter() - t0, 0.0


ev, ring = Evict(), Ring()
pbank = Bank.for_model(model, B, capacity=budget + 64)
T = {"evict_fwd": [], "evict_rest": [], "evict": [], "ring": [], "lib_plain": []}
pc = None
with torch.inference_mode():
    for step in range(1, N + 1):
        if step == 1 or step % 16 == 0:
            p = src.copy(); p.crop(budget); pc = [pbank.adopt(b, p) for b in range(B)]; fresh = True
        order = ["evict", "ring", "lib"]; k = step % 3; order = order[k:] + order[:k]
        for who in order:
            if who == "evict":
                a, b = ev.step(7)
                if step > 8: T["evict_fwd"].append(a); T["evict_rest"].append(b); T["evict"].append(a + b)
            elif who == "ring":
                a, _ = ring.step(7)
                if step > 8: T["ring"].append(a)
            else:
                t0 = time.perf_counter()
                forward_rows(pbank, model, pc, [7] * B, writer="teacher", steps=[step] * B)
                if step > 8 and not fresh: T["lib_plain"].append(time.perf_counter() - t0)
                fresh = False
med = {k: round(1000 * statistics.median(v), 2) for k, v in T.items()}
print("medians ms", med)
print("evict / ring", round(med["evict"] / med["ring"], 3), "evict / lib_plain", round(med["evict"] / med["lib_plain"], 3),
      "ring / lib_plain", round(med["ring"] / med["lib_plain"], 3))
pr = [a / b for a, b in zip(T["evict"], T["ring"])]
print("paired median evict/ring", round(statistics.median(pr), 3), "sum", round(sum(T["evict"]) / sum(T["ring"]), 3))
