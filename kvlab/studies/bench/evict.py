"""The eviction benchmark at batch 1: per-step time of each policy vs the full cache, by phase."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.decode.protocols import evict_attr, evict_due, measures_at
from kvlab.studies.bench.timing import _sync, _timed, check_whole_period, period_times


def default_evict_policies(cache_len: int) -> dict:
    """Eviction policies sized for a ``cache_len`` context (budget ≈ cache_len / 4), built through the registry."""
    from kvlab.eviction import EVICTION_POLICIES as E

    b = max(cache_len // 4, 64)
    bs = 16
    # block eviction: one start block, two recent blocks, max_cache_size <= b (a budget of b + bs - 1)
    block = {"block_size": bs, "recent": 2 * bs}
    return {"full": E.entry("full").at_budget(b), "sliding": E.entry("sliding").at_budget(b, sinks=4),
            "h2o": E.entry("h2o").at_budget(b), "random": E.entry("random").at_budget(b),
            "confkv": E.entry("confkv").at_budget(2 * b, recent=b // 4),
            "confkv_int8": E.entry("confkv").at_budget(2 * b, recent=b // 4, int8_window=b // 4),
            "block": E.entry("block").at_budget(b + bs - 1, **block),
            "block_rerotate": E.entry("block").at_budget(b + bs - 1, rerotate=True, **block)}


def decode_evict_policies(budget: int = 64) -> dict:
    """The eviction policies ``bench decode --batch`` times beside the plain loop (H2O and Conf-KV, 16 protected)."""
    from kvlab.eviction import EVICTION_POLICIES as E

    return {"evict:h2o": E.entry("h2o").at_budget(budget, recent=16),
            "evict:confkv": E.entry("confkv").at_budget(2 * budget, recent=16)}


def _check_evict_bench(cache_len, steps) -> None:
    """The eviction benchmarks' sizes (ValueError naming the parameter)."""
    if isinstance(cache_len, bool) or not isinstance(cache_len, int) or cache_len < 64:
        raise ValueError(f"cache_len={cache_len!r} must be an int >= 64")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} must be an int >= 2 (the first step is reported apart)")


def _evict_bench_cache(model, cache_len: int, steps: int, seed: int):
    """``(vocab, new, base)``: the model's vocabulary size, ``steps`` random decode tokens and a
    :class:`KVCache` prefilled with ``cache_len`` random prompt tokens (one seeded generator for both),
    attention tracked (EMA 0.9)."""
    from kvlab.cache import KVCache

    vocab = int(model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (cache_len,), generator=g).tolist()
    new = torch.randint(0, vocab, (steps,), generator=g).tolist()
    base = KVCache()
    base.track_attention(0.9)
    base.forward(model, ids, writer="teacher")
    return vocab, new, base


def bench_evict(lm, cache_len: int = 2048, steps: int = 16, repeats: int = 3, policies: dict | None = None,
                seed: int = 0) -> dict:
    """Per-step time of decoding with each eviction policy vs the full cache, at a ``cache_len`` context.

    One cache of ``cache_len`` random tokens is prefilled (attention tracked, stats start at 0).
    For each policy a copy runs ``steps`` decode steps of the loop's evict phase by hand:
    forward (with attention mass when the policy needs it), ``policy.keep`` (metadata: the
    decision), ``KVCache.evict`` (compaction, incl. re-rotation), ``quantize_older`` (INT8).
    The first step's eviction (cache_len → budget, a bulk compaction) is reported on its own
    (``first_evict_ms``); the per-step medians are over the later steps, pooled over ``repeats``
    (policies interleaved per repeat, after one warm-up pass). Side by side with every policy, in
    the same repeat: ``plain_ms``, a plain decode step (forward only, the same attention
    measurement, no policy, no eviction) on a cache holding the policy's live length after its
    first eviction (cropped back to it before every step, untimed), and ``evict_vs_plain`` =
    ``step_ms / plain_ms`` (1.0: an evicting step costs what a plain step at that length costs). A policy asked
    every ``e`` steps (:class:`~kvlab.eviction.every.Every`): ``step_ms`` and ``plain_ms`` are medians over whole
    periods of ``e`` steps (:func:`~kvlab.studies.bench.timing.period_times`), so the asked step counts.
    Also the attention-mass cost, full-cache forward with ``attention=True`` vs without
    (``attn_forward_ratio``). Ratios print; nothing is asserted. The Conf-KV paper reports 0.22 ms
    compaction + 0.11 ms metadata per step on GPT-2 (GPU).
    """
    from types import SimpleNamespace

    from kvlab.cache import KVCache
    from kvlab.decode import token_stats
    from kvlab.decode.evict_phase import apply_keep, evict_view

    _check_evict_bench(cache_len, steps)
    policies = policies if policies is not None else default_evict_policies(cache_len)
    for n, pol in policies.items():
        check_whole_period(steps, evict_attr(pol, "every"), f"policy {n!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    model = lm.model
    vocab, new, base = _evict_bench_cache(model, cache_len, steps, seed)

    def one(pol) -> dict:
        c = base.copy()
        rows = []
        for step, tok in enumerate(new, start=1):
            t0 = time.perf_counter()
            logits = c.forward(model, [tok], writer="teacher", step=step, attention=measures_at(pol, step))
            _sync()
            t1 = time.perf_counter()
            _, ent, top1, margin = token_stats(logits)
            rec = SimpleNamespace(step=step, entropy_bits=ent, top1_prob=top1, margin=margin)
            d = pol.keep(evict_view(c, step, rec, vocab, first=step == 1)) if evict_due(pol, step) else None
            _sync()
            t2 = time.perf_counter()
            phases: dict = {"compact": 0.0}
            r = apply_keep(c, d, model, phases) if d is not None else None       # not asked this step: no edit
            _sync()
            t4 = time.perf_counter()
            rows.append({"forward": t1 - t0, "metadata": t2 - t1, "compact": phases["compact"],
                         "int8": t4 - t2 - phases["compact"], "step": t4 - t0,
                         "evicted": r.evicted if r is not None else 0, "len": len(c), "bytes": c.nbytes(),
                         "rotate": r.rotate_s if r is not None else 0.0})
        return {"rows": rows}

    def plain(c: KVCache, pol) -> dict:
        """Plain steps, each on a cache of the length this copy starts with (cropped back, untimed), measuring
        attention at the steps ``pol``'s run does (:func:`~kvlab.decode.protocols.measures_at`)."""
        n0, rows = len(c), []
        for step, tok in enumerate(new, start=1):
            c.crop(n0)
            t0 = time.perf_counter()
            c.forward(model, [tok], writer="teacher", step=step, attention=measures_at(pol, step))
            _sync()
            rows.append({"step": time.perf_counter() - t0})
        return {"rows": rows}

    live = {}
    for n, pol in policies.items():   # warm-up; the live length each policy holds after its first eviction
        live[n] = one(pol)["rows"][0]["len"]
    plain_base = {}
    for n, pol in policies.items():
        c = base.copy()
        c.crop(min(live[n], cache_len))  # the evicting run's length when its next forward starts
        plain_base[n] = c
        plain(c.copy(), pol)
    runs = {n: [] for n in policies}
    plains = {n: [] for n in policies}
    attn = {True: [], False: []}
    for _ in range(repeats):
        for n, pol in policies.items():
            runs[n].append(one(pol))
            plains[n].append(plain(plain_base[n].copy(), pol))
        for flag in (False, True):
            c = base.copy()
            attn[flag].append(_timed(lambda: c.forward(model, [new[0]], writer="teacher", attention=flag)))
    out = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "cache_len": cache_len,
           "steps": steps, "repeats": repeats,
           "attn_forward_ratio": round(statistics.median(attn[True]) / statistics.median(attn[False]), 3),
           "policies": {}}
    full_step = None
    for n, rs in runs.items():
        later = [row for r in rs for row in r["rows"][1:]]
        first = [r["rows"][0] for r in rs]
        e = evict_attr(policies[n], "every")                    # whole periods: a policy asked every e steps
        med = {k: 1000 * statistics.median(row[k] for row in later)
               for k in ("forward", "metadata", "compact", "int8", "rotate")}
        med["step"] = 1000 * statistics.median(x for r in rs for x in period_times([w["step"] for w in r["rows"][1:]], e))
        res = {f"{k}_ms": round(v, 3) for k, v in med.items()}
        plain_ms = 1000 * statistics.median(x for r in plains[n]
                                            for x in period_times([w["step"] for w in r["rows"][1:]], e))
        res["plain_ms"] = round(plain_ms, 3)
        res["evict_vs_plain"] = round(med["step"] / plain_ms, 3)
        res["first_evict_ms"] = round(1000 * statistics.median(row["compact"] for row in first), 3)
        res["mean_len"] = round(statistics.mean(row["len"] for row in later), 1)
        res["mean_kib"] = round(statistics.mean(row["bytes"] for row in later) / 1024, 1)
        res["evicted_per_step"] = round(statistics.mean(row["evicted"] for row in later), 2)
        out["policies"][n] = res
        if n == "full":
            full_step = med["step"]
    if full_step is not None:
        for n, res in out["policies"].items():
            res["speedup_vs_full"] = round(full_step / res["step_ms"], 3)
    return out
