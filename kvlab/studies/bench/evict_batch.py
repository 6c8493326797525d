"""The batched eviction benchmark: tok/s per policy, batch size and context vs the full cache, and how close each
policy gets to the byte bound (weights + K/V read per step at full length / the same at its kept length)."""
from __future__ import annotations

import statistics
import time

import torch
from torch.profiler import record_function

from kvlab.studies.bench.evict import _check_evict_bench, default_evict_policies
from kvlab.studies.bench.timing import _sync, check_batches, check_whole_period, peak_rss_mb, period_times, ratio_interval


class _Signals:
    """A step's token statistics (entropy, top-1, margin) for the rows' records, computed for every row at once
    (:func:`~kvlab.decode.sampling.token_stats_rows`) when a policy first reads one. The decode loop computes them
    for every row at every step, evicting or not (its step records, its sampling); the plain step this bench
    compares with computes none, so an evicting step pays them only when its policy reads them (Conf-KV)."""

    def __init__(self, logits):
        self.logits, self.got = logits, None

    def get(self, b: int, i: int) -> float:
        if self.got is None:
            from kvlab.decode.sampling import token_stats_rows

            self.got = token_stats_rows(self.logits)
        return self.got[b][i]

    def row(self, step: int, b: int) -> "_Record":
        return _Record(step, self, b)


class _Record:
    """Row ``b``'s step record as an eviction policy reads it (``step``, ``entropy_bits``, ``top1_prob``,
    ``margin``), the statistics read from :class:`_Signals`."""

    __slots__ = ("step", "_s", "_b")

    def __init__(self, step: int, signals: _Signals, b: int):
        self.step, self._s, self._b = step, signals, b

    entropy_bits = property(lambda self: self._s.get(self._b, 1))
    top1_prob = property(lambda self: self._s.get(self._b, 2))
    margin = property(lambda self: self._s.get(self._b, 3))


def batch_evict_policies(cache_len: int) -> dict:
    """The policies ``bench evict --batch`` compares at a ``cache_len`` context (budget ≈ cache_len / 4):
    full, sliding, H2O, Scissorhands, SnapKV, block eviction and Conf-KV (tight = budget, loose = 2 × budget)."""
    from kvlab.eviction import EVICTION_POLICIES as E

    b = max(cache_len // 4, 64)
    base = default_evict_policies(cache_len)
    return {"full": base["full"], "sliding": base["sliding"], "h2o": base["h2o"],
            "scissorhands": E.entry("scissorhands").at_budget(b), "snapkv": E.entry("snapkv").at_budget(b),
            "block": base["block"], "confkv": base["confkv"]}


def check_names(names) -> list[str]:
    """``names`` (``--policies``) as a list, each one of :func:`batch_evict_policies`' (ValueError naming the flag
    and the choices otherwise: empty, or an unknown name)."""
    names = [names] if isinstance(names, str) else list(names)
    known = list(batch_evict_policies(64))
    bad = [x for x in names if x not in known]
    if not names or bad:
        raise ValueError(f"--policies={','.join(map(str, names))!r} must name some of {', '.join(known)} "
                         "(e.g. --policies full,h2o)")
    return names


def weight_bytes(model) -> int:
    """Bytes of the model's parameters, each tensor once (tied embeddings count once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def entry_bytes(model) -> int:
    """K/V bytes of one cache entry of one row over all layers (keys and values, the model's dtype)."""
    cfg = model.config
    heads = cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers * 2 * hkv * d * next(model.parameters()).element_size()


def byte_bound(model, batch: int, full_len: float, kept_len: float) -> float:
    """The speed-up a step that only reads memory could reach: (weights + K/V read at ``full_len`` entries) /
    (weights + K/V read at ``kept_len``), ``batch`` rows."""
    w, e = weight_bytes(model), entry_bytes(model) * batch
    return (w + e * full_len) / (w + e * kept_len)


def _track(cache, pol) -> None:
    from kvlab.decode.protocols import evict_attr

    cache.track_attention(evict_attr(pol, "ema_decay"), window=evict_attr(pol, "attention_window"),
                          pool=evict_attr(pol, "attention_pool"), below=evict_attr(pol, "attention_below"),
                          ema_prefill=evict_attr(pol, "ema_prefill"))


PREFILL_CHUNK = 1024          # tokens per forward of an attention prefill whose statistics compose over chunks


def attention_prefill(model, ids, pol, chunk: int = PREFILL_CHUNK):
    """A new cache of ``ids`` with ``pol``'s attention statistics measured over the prompt. In forwards of ``chunk``
    tokens when chunks measure what one forward does (every query counted, no pooling, a per-query EMA: sums, counts
    and EMA updates compose), so a long prompt's scores are ``(H, chunk, T)``, not ``(H, T, T)`` (about 2.4 GB per
    layer at 8,192 tokens); otherwise (an observation window, pooled or one-update EMA statistics, defined over one
    forward) in one forward."""
    from kvlab.cache import KVCache

    decay, window, pool, _, ema_prefill = _settings(pol)
    composes = window is None and (pool or 1) == 1 and (decay is None or ema_prefill in (None, "query"))
    step = int(chunk) if composes else len(ids)
    cache = KVCache()
    _track(cache, pol)
    for i in range(0, len(ids), step):
        cache.forward(model, list(ids[i:i + step]), writer="teacher", attention=True)
    return cache


def _settings(pol) -> tuple:
    from kvlab.decode.protocols import evict_attr

    return tuple(evict_attr(pol, k) for k in ("ema_decay", "attention_window", "attention_pool", "attention_below",
                                              "ema_prefill"))


def with_every(policies: dict, every) -> dict:
    """``policies`` (name -> policy), each also asked only every ``e``-th step for each ``e > 1`` in ``every``
    (:class:`~kvlab.eviction.every.Every`; the full cache is not wrapped): label -> ``(name, e, policy)``, the label
    ``name`` for ``e = 1`` and ``name/every{e}`` otherwise."""
    from kvlab.eviction.every import Every

    every = [1] if every is None else list(every)
    if not every or any(isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in every):
        raise ValueError(f"every={every!r} must be a non-empty list of ints >= 1 (--every 1,16)")
    out = {}
    for e in every:
        for n, pol in policies.items():
            if e == 1:
                out[n] = (n, 1, pol)
            elif n != "full":
                out[f"{n}/every{e}"] = (n, e, Every(pol, every=e))
    return out


def bench_evict_batch(lm, batches=(1, 8, 16), cache_len=2048, steps: int = 16, repeats: int = 2,
                      policies: dict | None = None, seed: int = 0, on_row=None, every=(1,),
                      names=None, resident: bool = True) -> list[dict]:
    """Batched decode steps with eviction vs the full cache, one row per (context, batch, policy).

    ``cache_len``: an int or a list of contexts. ``names``: only these of :func:`batch_evict_policies` (``--policies``;
    the full cache's speed-up columns need ``"full"`` among them); ``policies``: a dict of one's own instead. Per context one prompt of ``cache_len`` random tokens is
    prefilled once per attention-statistics setting the policies need (untimed) and copied into every
    row of a :class:`~kvlab.cache.batch.Bank`; each policy then runs ``steps`` steps of one batched
    forward (:func:`~kvlab.cache.batch.forward_rows`, attention mass when the policy needs it) plus
    every row's decision (all rows at once where the policy can: :func:`kvlab.decode.protocols.keep_rows`; at the
    steps the policy is asked: ``every`` > 1 adds each policy asked every ``e``-th step, :func:`with_every`) and
    the caches' edit (the batched decode loop's own evict phase, all rows at once:
    :func:`kvlab.decode.evict_phase.apply_keep_rows`). The first step (the bulk cut to the budget) is left out.
    ``resident`` (default): a policy asked at every step that decides over columns (``decides_columns``: sliding, H2O,
    Scissorhands, block eviction, Conf-KV) runs its later steps as resident rows (:class:`kvlab.cache.resident.Resident`: checked in after
    the first step's cut, inside that untimed step; each step one forward into the freed columns, the policy's
    ``column_drop`` and the edit; closed after the last step, untimed); its row says ``resident``.
    ``step_ms`` is the median over periods of the mean step time of each whole period of ``e`` steps starting at an
    asked step (:func:`~kvlab.studies.bench.timing.period_times`; ``e = 1``: the median step), so a policy asked
    every ``e`` steps pays its asked step's decision and edit spread over the steps it serves; ``asked_ms``: the
    median time of the asked steps alone. Beside every policy, in the same repeat, a plain batched step (forward only: no
    attention mass, no policy) on rows holding the policy's mean live length (``plain_ms``;
    ``evict_vs_plain`` = ``step_ms / plain_ms``, over the same periods), stepped alternately with the policy's (a plain step after the
    policy's, then before it, ...), so both see the machine alike; ``evict_vs_plain_lo`` / ``_hi``: its 95 %
    percentile-bootstrap interval over the ``periods`` paired periods (:func:`~kvlab.studies.bench.timing.ratio_interval`;
    None under 3 periods: more ``steps`` or ``repeats`` give more); ``evict_vs_plain_sum``: the same periods' total
    times divided (a throughput ratio: the median over periods passes over a cost paid in one period of several, such
    as the compaction a lazy eviction's holes get every few asks; the sum counts it). Policies interleave per repeat
    after one warm-up.

    Per row: ``tok_s``, ``speedup_vs_full`` (``full_ms`` / ``step_ms``: the full cache's own policy row stepped
    beside this policy in the same block, the order rotating per step, so slow drift of the machine between blocks
    does not enter the ratio), ``mean_len`` (live
    entries the policy's forwards read, mean over rows, layers and steps), ``bound``
    (:func:`byte_bound` at the full cache's and the policy's mean lengths) and ``frac_of_bound`` =
    ``speedup_vs_full / bound``; ``plain_frac_of_bound``: the same for the plain step at the policy's mean length (the
    fraction of the bound this machine's plain loop reaches at that length: what an eviction that costs nothing would
    reach)."""
    from kvlab.cache import KVCache
    from kvlab.cache.batch import Bank, forward_rows
    from kvlab.cache.deferred import defers, settle_rows
    from kvlab.cache.resident import Resident
    from kvlab.decode.evict_phase import apply_keep_rows, evict_view
    from kvlab.decode.protocols import evict_due, keep_rows, measures_at

    batches = check_batches(batches)
    lens = [cache_len] if isinstance(cache_len, int) and not isinstance(cache_len, bool) else list(cache_len)
    if not lens:
        raise ValueError("cache_len must be an int >= 64 or a non-empty list of them (--cache-len 2048,4096)")
    for cl in lens:
        _check_evict_bench(cl, steps)
    with_every({}, every)                                                 # the list checked before any model work
    if names is not None:
        if policies is not None:
            raise ValueError("give names (--policies) or policies, not both")
        names = check_names(names)
    for e in [1] if every is None else every:
        check_whole_period(steps, e, "a policy")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    model = lm.model
    vocab = int(model.get_input_embeddings().weight.shape[0])
    out = []
    for cl in lens:
        pick = policies if policies is not None else batch_evict_policies(cl)
        if names is not None:
            pick = {x: p for x, p in pick.items() if x in names}
        labelled = with_every(pick, every)
        pols = {k: v[2] for k, v in labelled.items()}
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (cl,), generator=g).tolist()
        new = torch.randint(0, vocab, (steps,), generator=g).tolist()
        bases: dict[tuple, KVCache] = {}
        plain_base = KVCache()
        plain_base.forward(model, ids, writer="teacher")
        for pol in pols.values():                                      # one prefill per statistics setting
            key = _settings(pol)
            if key not in bases:
                bases[key] = attention_prefill(model, ids, pol)

        for B in batches:
            bank = Bank.for_model(model, B, capacity=cl + steps + 2)
            pbank = Bank.for_model(model, B, capacity=cl + steps + 2)      # the plain rows, stepped alternately
            fbank = Bank.for_model(model, B, capacity=cl + steps + 2) if "full" in pols else None   # the full cache's
            plain_src: dict[int, KVCache] = {}

            def stepper(p, bk, times: list, read: list):
                """One step of policy ``p`` on the rows of ``bk`` (adopted from its prefill, untimed), timed into
                ``times``: the forward, and at an asked step the views, the decision and the edit."""
                from kvlab.decode.protocols import evict_attr

                need = bool(evict_attr(p, "needs_attention"))
                later = need and evict_attr(p, "every") > 1 and defers(bk.device)   # as the decode loop does
                src = bases[_settings(p)] if need else plain_base
                caches = [bk.adopt(b, src) for b in range(B)]                # untimed copies
                held = {"res": None, "ok": resident and evict_attr(p, "every") == 1 and
                        bool(evict_attr(p, "decides_columns"))}

                def evicting(step: int, tok: int) -> None:
                    t0 = time.perf_counter()
                    res = held["res"]
                    if res is not None:                                 # resident rows: the step, the drop, the edit
                        with record_function("evict_bench.resident"):
                            logits = res.step(model, [tok] * B, writer="teacher", steps=[step] * B,
                                              measure=measures_at(p, step))
                            read.append(float(res.live.sum()) / (B * res.L))
                            signals = _Signals(logits)                  # read by Conf-KV only (its confidence)
                            res.evict(p.column_drop(res.view(step, [signals.row(step, b) for b in range(B)], vocab)))
                        _sync()
                        times.append(time.perf_counter() - t0)
                        return
                    with record_function("evict_bench.forward"):
                        logits = forward_rows(bk, model, caches, [tok] * B, writer="teacher", steps=[step] * B,
                                              attention=[measures_at(p, step) and not later] * B,
                                              defer=[measures_at(p, step) and later] * B)
                    read.append(sum(sum(c.layer_lengths()) for c in caches) / (B * caches[0].num_layers))
                    if evict_due(p, step):                              # asked this step: views, decision, edit
                        with record_function("evict_bench.views"):
                            settle_rows(caches)                         # deferred statistics, the rows together
                            views = []                                  # the batched loop's one stats pass
                            signals = _Signals(logits)                  # read by Conf-KV only (its confidence)
                            for b, c in enumerate(caches):
                                views.append(evict_view(c, step, signals.row(step, b), vocab, first=step == 1))
                        with record_function("evict_bench.decide"):
                            decisions = keep_rows(p, views)             # every row's decision at once
                            del views                                   # released before the edit (no copies)
                        with record_function("evict_bench.apply"):
                            apply_keep_rows(caches, decisions, model)      # every row's edit at once
                    if held["ok"] and step == 1:                        # in the untimed first step: check in
                        cap = evict_attr(p, "column_capacity")
                        held["res"] = Resident(bk, caches, cap(bk.num_layers) if callable(cap) else None,
                                               slots=bool(evict_attr(p, "column_slots")))
                    _sync()
                    times.append(time.perf_counter() - t0)

                def close() -> bool:
                    """The rows as caches again; whether they ran resident."""
                    if held["res"] is not None:
                        held["res"].close()
                        return True
                    return False
                return evicting, caches, close

            def one(pol, n0: int | None = None, full=None):
                """``steps`` steps of ``pol``; with ``n0``, each step beside a plain step on rows that start at
                ``n0`` entries, and with ``full``, beside a step of the full cache too (the order rotating per
                step). Returns the step times of the policy, the plain rows and the full cache (the first step
                left out), the policy's mean live length and its final length."""
                times, ptimes, ftimes, read = [], [], [], []
                evicting, caches, close = stepper(pol, bank, times, read)
                fns, closes = [evicting], []
                if n0 is not None:
                    if n0 not in plain_src:
                        plain_src[n0] = plain_base.copy()
                        plain_src[n0].crop(n0)
                    pcaches = [pbank.adopt(b, plain_src[n0]) for b in range(B)]

                    def plain(step: int, tok: int) -> None:
                        t0 = time.perf_counter()
                        forward_rows(pbank, model, pcaches, [tok] * B, writer="teacher", steps=[step] * B)
                        _sync()
                        ptimes.append(time.perf_counter() - t0)
                    fns.append(plain)
                if full is not None:
                    fstep, _, fclose = stepper(full, fbank, ftimes, [])
                    fns.append(fstep)
                    closes.append(fclose)
                for step, tok in enumerate(new, start=1):
                    k = step % len(fns)
                    for fn in fns[k:] + fns[:k]:                       # each goes first, middle, last in turn
                        fn(step, tok)
                was = close()
                for f in closes:
                    f()
                return times[1:], ptimes[1:], ftimes[1:], statistics.mean(read[1:]), len(caches[0]), was

            start = {}
            full_pol = pols.get("full")
            for n, pol in pols.items():                                  # warm-up; each policy's mean length
                _, _, _, mean_len, _, _ = one(pol)
                start[n] = max(1, min(cl, round(mean_len - (steps + 2) / 2)))   # plain reads that length on average
                one(pol, start[n])
            runs = {n: [] for n in pols}
            plains: dict[str, list[float]] = {n: [] for n in pols}
            fulls: dict[str, list[float]] = {n: [] for n in pols}
            asked: dict[str, list[float]] = {n: [] for n in pols}
            got = {}
            for _ in range(repeats):
                for n, pol in pols.items():
                    twin = full_pol if n != "full" else None            # the full cache beside every other policy
                    t, pt, ft, mean_len, final, was = one(pol, start[n], twin)
                    e = labelled[n][1]
                    runs[n] += period_times(t, e)                       # whole periods: asked step included
                    plains[n] += period_times(pt, e)                    # the same steps' plain twins
                    fulls[n] += period_times(ft if twin is not None else t, e)   # ... and full-cache twins
                    asked[n] += [x for j, x in enumerate(t) if (j + 1) % e == 0]     # steps 1 + k·e (t[0]: step 2)
                    got[n] = (mean_len, final, was)
            med = {n: statistics.median(v) for n, v in runs.items()}
            full_len = got["full"][0] if "full" in got else cl + (steps + 2) / 2
            for n in pols:
                mean_len, final, was = got[n]
                plain_s = statistics.median(plains[n])
                row = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "batch": B,
                       "policy": labelled[n][0], "every": labelled[n][1], "cache_len": cl, "steps": steps, "repeats": repeats, "step_ms": round(1000 * med[n], 2),
                       "tok_s": round(B / med[n], 2), "final_len": final, "mean_len": round(mean_len, 1),
                       "plain_ms": round(1000 * plain_s, 2), "evict_vs_plain": round(med[n] / plain_s, 3),
                       "evict_vs_plain_sum": round(sum(runs[n]) / sum(plains[n]), 3) if plains[n] else None,
                       "asked_ms": round(1000 * statistics.median(asked[n]), 2), "periods": len(runs[n]),
                       "peak_rss_mb": peak_rss_mb(), "resident": was}
                ci = ratio_interval(runs[n], plains[n])                 # paired periods resampled together
                row["evict_vs_plain_lo"], row["evict_vs_plain_hi"] = (None, None) if ci is None else \
                    (round(ci[0], 3), round(ci[1], 3))
                if "full" in med:
                    full_s = statistics.median(fulls[n])                # the full cache stepped beside this policy
                    row["full_ms"] = round(1000 * full_s, 2)
                    row["speedup_vs_full"] = round(full_s / med[n], 3)
                    row["bound"] = round(byte_bound(model, B, full_len, mean_len), 3)
                    row["frac_of_bound"] = round(row["speedup_vs_full"] / row["bound"], 3)
                    row["plain_frac_of_bound"] = round(full_s / plain_s / row["bound"], 3)   # this machine's ceiling
                out.append(row)
                if on_row is not None:
                    on_row(row)
            del bank, pbank, fbank
    return out
