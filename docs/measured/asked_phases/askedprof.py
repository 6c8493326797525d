"""Phase times of a batched evicting run against plain rows, one process (session 17).

Usage: python docs/measured/asked_phases/askedprof.py POLICY EVERY   (e.g. scissorhands 16; NT threads, default 2)

The embedded teacher, batch 8, a 4,096-token random prompt, 64 steps of ``bench evict``'s policy POLICY asked every
EVERY steps (4,096 -> about 1,040 entries), stepped as the bench steps it (forward, then at an asked step: settle,
views, the batched decision, each row's edit), with a plain batched step (forward only) on rows cropped to the
policy's length after its first cut, stepped just before each evicting step. Run twice (the first a warm-up);
medians per phase in ms: ``fwd`` (steps between asks), ``fwd_asked``, ``settle``, ``views``, ``decide``, ``apply``,
``plain``; ``period step`` = ((EVERY - 1)·fwd + the asked step's phases) / EVERY, and its ratio to ``plain``."""
import sys, time, statistics
from types import SimpleNamespace
import torch
from kvlab.core.models import load_teacher
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows, defers
from kvlab.decode.sampling import token_stats_rows
from kvlab.decode.evict_phase import apply_keep, evict_view
from kvlab.decode.protocols import evict_due, keep_rows, measures_at, evict_attr
from kvlab.studies.bench.evict_batch import batch_evict_policies, attention_prefill, with_every
name = sys.argv[1] if len(sys.argv) > 1 else "h2o"
E = int(sys.argv[2]) if len(sys.argv) > 2 else 16
torch.set_num_threads(int(__import__("os").environ.get("NT", "2")))
lm = load_teacher("cpu", "float32"); model = lm.model
CL, B, STEPS = 4096, 8, 64
g = torch.Generator().manual_seed(0)
vocab = int(model.get_input_embeddings().weight.shape[0])
ids = torch.randint(0, vocab, (CL,), generator=g).tolist()
new = torch.randint(0, vocab, (STEPS,), generator=g).tolist()
pol = with_every({name: batch_evict_policies(CL)[name]}, [E])[name if E == 1 else f"{name}/every{E}"][2]
need = bool(evict_attr(pol, "needs_attention"))
src = attention_prefill(model, ids, pol) if need else None
if src is None:
    src = KVCache(); src.forward(model, ids, writer="teacher")
later = need and E > 1
bank = Bank.for_model(model, B, capacity=CL + STEPS + 2)
pbank = Bank.for_model(model, B, capacity=CL + STEPS + 2)
def run():
    caches = [bank.adopt(b, src) for b in range(B)]
    ph = {k: [] for k in ("fwd", "fwd_asked", "settle", "views", "decide", "apply", "plain")}
    pc = None
    for step, tok in enumerate(new, start=1):
        if step == 2:
            L0 = len(caches[0])
            pl = src.copy(); pl.crop(L0)
            pc = [pbank.adopt(b, pl) for b in range(B)]
        if pc is not None:
            t0 = time.perf_counter(); forward_rows(pbank, model, pc, [tok] * B, writer="teacher", steps=[step] * B)
            ph["plain"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        logits = forward_rows(bank, model, caches, [tok] * B, writer="teacher", steps=[step] * B,
                              attention=[measures_at(pol, step) and not later] * B, defer=[measures_at(pol, step) and later] * B)
        t1 = time.perf_counter()
        asked = evict_due(pol, step)
        if asked:
            settle_rows(caches); t2 = time.perf_counter()
            views = []
            for c, (_, ent, top1, margin, _) in zip(caches, token_stats_rows(logits)):
                rec = SimpleNamespace(step=step, entropy_bits=ent, top1_prob=top1, margin=margin)
                views.append(evict_view(c, step, rec, vocab, first=step == 1))
            t3 = time.perf_counter()
            dec = keep_rows(pol, views); t4 = time.perf_counter()
            for c, d in zip(caches, dec): apply_keep(c, d, model)
            t5 = time.perf_counter()
            if step > 1:
                ph["fwd_asked"].append(t1 - t0); ph["settle"].append(t2 - t1); ph["views"].append(t3 - t2)
                ph["decide"].append(t4 - t3); ph["apply"].append(t5 - t4)
        elif step > 1:
            ph["fwd"].append(t1 - t0)
    return ph, len(caches[0])
run()
ph, final = run()
med = {k: 1000 * statistics.median(v) for k, v in ph.items() if v}
print(name, "every", E, "final", final, {k: round(v, 1) for k, v in med.items()})
asked = med.get("fwd_asked", 0) + med.get("settle", 0) + med.get("views", 0) + med.get("decide", 0) + med.get("apply", 0)
per = ((E - 1) * med["fwd"] + asked) / E
print("period step", round(per, 1), "plain", round(med["plain"], 1), "ratio", round(per / med["plain"], 3))
