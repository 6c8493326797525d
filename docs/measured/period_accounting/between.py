"""Many alternating between-ask steps: ev rows (bench state after K asks) with/without deferred stats vs plain.
usage: between.py POLICY E R [variants: defer,nostat,plain2]  (plain2: a second plain bank, the two banks' floor)"""
import sys, time, statistics, os
from types import SimpleNamespace
import torch
from kvlab.core.models import load_teacher
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows
from kvlab.decode.sampling import token_stats_rows
from kvlab.decode.evict_phase import apply_keep, evict_view
from kvlab.decode.protocols import evict_due, keep_rows, measures_at
from kvlab.studies.bench.evict_batch import batch_evict_policies, attention_prefill, with_every
name = sys.argv[1]; E = int(sys.argv[2]); R = int(sys.argv[3]) if len(sys.argv) > 3 else 60
variants = sys.argv[4].split(",") if len(sys.argv) > 4 else ["defer", "nostat"]
torch.set_num_threads(2)
from kvlab.core import decode_attn, packed
decode_attn.DECODE = os.environ.get("DECODE") or None    # as the bench runs: DECODE=auto PACKED=auto
packed.BACKEND = os.environ.get("PACKED") or None
lm = load_teacher("cpu", "float32"); model = lm.model
CL, B = 4096, 8
g = torch.Generator().manual_seed(0)
vocab = int(model.get_input_embeddings().weight.shape[0])
ids = torch.randint(0, vocab, (CL,), generator=g).tolist()
new = torch.randint(0, vocab, (64,), generator=g).tolist()
pol = with_every({name: batch_evict_policies(CL)[name]}, [E])[f"{name}/every{E}"][2]
src = attention_prefill(model, ids, pol)
plain_src = KVCache(); plain_src.forward(model, ids, writer="teacher")
cap = CL + 2 * R + 80
K = int(os.environ.get("K", "3"))
def evbank():
    bank = Bank.for_model(model, B, capacity=cap)
    caches = [bank.adopt(b, src) for b in range(B)]
    for step in range(1, K * E + 2):
        logits = forward_rows(bank, model, caches, [new[step % 64]] * B, writer="teacher", steps=[step] * B,
                              attention=[False] * B, defer=[measures_at(pol, step)] * B)
        if evict_due(pol, step):
            settle_rows(caches)
            views = [evict_view(c, step, SimpleNamespace(step=step, entropy_bits=e, top1_prob=t, margin=m), vocab, first=step == 1)
                     for c, (_, e, t, m, _) in zip(caches, token_stats_rows(logits))]
            for c, d in zip(caches, keep_rows(pol, views)): apply_keep(c, d, model)
    return bank, caches
banks = {v: evbank() for v in variants if v != "plain2"}
L0 = len(banks[variants[0]][1][0])
lay = banks[variants[0]][1][0]._store.layers
print("live", L0, "holes", sum(len(l.holes) for l in lay), "s", [l.s for l in lay][:6], flush=True)
pl = plain_src.copy(); pl.crop(L0)
pbank = Bank.for_model(model, B, capacity=cap)
pc = [pbank.adopt(b, pl) for b in range(B)]
if "plain2" in variants:                 # a second plain bank: the floor of two banks' difference
    pbank2 = Bank.for_model(model, B, capacity=cap)
    banks["plain2"] = (pbank2, [pbank2.adopt(b, pl) for b in range(B)])
ts = {v: [] for v in variants}; ts["plain"] = []
step0 = K * E + 2
for r in range(R):
    order = variants + ["plain"]
    k = r % len(order); order = order[k:] + order[:k]
    for v in order:
        t0 = time.perf_counter()
        if v in ("plain", "plain2"):
            bk, cs = (pbank, pc) if v == "plain" else banks[v]
            forward_rows(bk, model, cs, [7] * B, writer="teacher", steps=[step0 + r] * B)
        else:
            bank, caches = banks[v]
            d = v == "defer"
            forward_rows(bank, model, caches, [7] * B, writer="teacher", steps=[step0 + r] * B,
                         attention=[False] * B, defer=[d] * B)
        ts[v].append(time.perf_counter() - t0)
med = {k: statistics.median(v) for k, v in ts.items()}
print({k: round(1000 * v, 2) for k, v in med.items()})
for v in variants:
    r = [a / b for a, b in zip(ts[v], ts["plain"])]
    print(v, "paired median ratio", round(statistics.median(r), 3), "sum ratio", round(sum(ts[v]) / sum(ts["plain"]), 3))
