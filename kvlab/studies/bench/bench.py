"""Benchmarks that print ratios measured in one run (they never assert: machines are noisy).
Timings go to stdout and, with ``--out``, to untracked timing files; nothing enters the run store.
"""
from __future__ import annotations

import statistics
import time

import torch


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench_decode(lm, prompt: str, tokens: int = 64, repeats: int = 3) -> dict:
    """kvlab's loop (teacher mode, greedy, fixed N) vs HF ``generate`` on the same model and prompt.

    Runs alternate (kvlab, HF, kvlab, HF, …) after one warm-up each; medians are reported.
    tok/s = N / (prefill + N decode steps) for both.
    """
    from kvlab.decode import run

    ids = lm.encode_prompt(prompt)
    x = torch.tensor([ids], device=lm.device)

    def ours():
        tr = run(lm, None, prompt, mode="teacher", max_new_tokens=tokens)
        assert len(tr.records) == tokens

    def hf():
        with torch.inference_mode():
            out = lm.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                                    min_new_tokens=tokens, do_sample=False, pad_token_id=lm.tokenizer.eos_token_id)
        assert out.shape[1] - x.shape[1] == tokens

    ours(), hf()  # warm-up
    t_ours, t_hf = [], []
    for _ in range(repeats):
        t_ours.append(_timed(ours))
        t_hf.append(_timed(hf))
    ours_tps = tokens / statistics.median(t_ours)
    hf_tps = tokens / statistics.median(t_hf)
    return {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "tokens": tokens,
            "repeats": repeats, "kvlab_tps": round(ours_tps, 2), "hf_generate_tps": round(hf_tps, 2),
            "ratio": round(ours_tps / hf_tps, 3)}


def bench_surgery(lm, cache_len: int = 2048, pairs: int = 16, repeats: int = 3, seed: int = 0) -> dict:
    """One tick of ``pairs`` replace_pairs on a ``cache_len``-token cache: kvlab's one-concat-per-layer
    splice vs the seed's naive per-row ``torch.cat`` sequence, same actions, same K/V, one run.

    Both variants compute the same new K/V (``compute_s``); they differ in the splice
    (``splice_s``, ``splice_mb`` = MiB of K/V tensors written). Runs alternate after one warm-up;
    medians are reported; the two results are checked to be identical.
    """
    from kvlab.cache import KVCache

    if not isinstance(pairs, int) or pairs <= 0 or 2 * pairs > cache_len:
        raise ValueError(f"pairs={pairs!r} must be a positive int with 2*pairs <= cache_len={cache_len}")
    vocab = int(lm.model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (cache_len,), generator=g).tolist()
    base, _ = KVCache.prefill(lm.model, ids, writer="teacher")
    slots = torch.randperm(cache_len // 2 - 1, generator=g)[:pairs].add(1).mul(2).tolist()   # disjoint (p, p+1)
    actions = [{"action": "replace_pair", "original_pos1": p, "original_pos2": p + 1,
                "new_token_ids": [int(torch.randint(0, vocab, (1,), generator=g))]} for p in slots]

    def tick(mode):
        c = base.copy()
        t = time.perf_counter()
        r = c.apply(actions, lm.model, writer="teacher", splice=mode)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return c, r, time.perf_counter() - t

    tick("gather"), tick("per_row")  # warm-up
    runs = {"gather": [], "per_row": []}
    for _ in range(repeats):
        for mode in runs:
            runs[mode].append(tick(mode))
    (cg, _, _), (cp, _, _) = runs["gather"][-1], runs["per_row"][-1]
    identical = cg.live == cp.live and all(
        torch.equal(a, b) for i in range(cg.num_layers) for a, b in zip(cg.kv(i), cp.kv(i)))
    out = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "cache_len": cache_len,
           "pairs": pairs, "layers": base.num_layers, "cache_mb": round(base.nbytes() / 2**20, 1),
           "repeats": repeats, "identical": identical}
    med = {mode: {k: statistics.median(getattr(r, k) if k != "tick_s" else t for _, r, t in rs)
                  for k in ("tick_s", "compute_s", "splice_s")} for mode, rs in runs.items()}
    for mode, rs in runs.items():
        out[mode] = {k: round(v, 5) for k, v in med[mode].items()}
        out[mode]["splice_mb"] = round(rs[0][1].splice_bytes / 2**20, 2)
    out["splice_speedup"] = round(med["per_row"]["splice_s"] / med["gather"]["splice_s"], 2)
    out["tick_speedup"] = round(med["per_row"]["tick_s"] / med["gather"]["tick_s"], 2)
    out["bytes_ratio"] = round(runs["per_row"][0][1].splice_bytes / runs["gather"][0][1].splice_bytes, 2)
    return out


def bench_mc(lm, prompt: str, tokens: int = 32, n_passes: int = 8, p: float = 0.1) -> dict:
    """MC-dropout cost per decode step, measured at every step of one greedy decode of ``lm``:

    * ``clean``      — one clean pass of the step (``KVCache.probe_last(model, 1)``, no hooks),
    * ``batched``    — N noisy passes as one batch sharing the prefix cache (what the probe runs),
    * ``sequential`` — N noisy passes one after another (batch 1 each).

    The three alternate at every step (order rotated); medians over the steps are reported in ms.
    """
    from kvlab.decode import DecodeConfig, Decoding
    from kvlab.uncertainty.mc import check_n_passes, check_p, mc_dropout

    n_passes, p = check_n_passes(n_passes), check_p(p)
    model = lm.model
    d = Decoding(None, lm, prompt, DecodeConfig(mode="student", max_new_tokens=tokens + 1))

    def clean():
        model_out = d.cache.probe_last(model, 1)
        assert model_out.shape[0] == 1

    def batched():
        with mc_dropout(model, p, seed=0):
            assert d.cache.probe_last(model, n_passes).shape[0] == n_passes

    def sequential():
        with mc_dropout(model, p, seed=0):
            for _ in range(n_passes):
                d.cache.probe_last(model, 1)

    fns = {"clean": clean, "batched": batched, "sequential": sequential}
    times = {k: [] for k in fns}
    for rec in d:
        if rec.step == 1:          # warm-up step
            for fn in fns.values():
                fn()
            continue
        order = list(fns)[rec.step % 3:] + list(fns)[:rec.step % 3]
        for k in order:
            times[k].append(_timed(fns[k]))
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    return {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "steps": tokens,
            "n_passes": n_passes, "p": p, "prompt_tokens": len(d.prompt_ids),
            "ms_clean": round(ms["clean"], 3), "ms_batched_N": round(ms["batched"], 3),
            "ms_sequential_N": round(ms["sequential"], 3),
            "batched_over_clean": round(ms["batched"] / ms["clean"], 3),
            "sequential_over_batched": round(ms["sequential"] / ms["batched"], 3)}

def bench_refresh(teacher, student, prompts, tokens: int = 256, repeats: int = 2, policies: dict | None = None):
    """Latency overhead % of each refresh policy against the no-refresh OverFill run, measured in
    this one run on the same prompts (greedy, fixed N, interleaved: none, p1, p2, … per repeat,
    after one warm-up). Overhead per prompt = median(total_s policy) / median(total_s none) - 1;
    the table shows the mean over prompts with teacher tokens and refreshes per run.
    Blog targets (N = 1200, 3B pair, GPU): periodic T=64 ≤ 3.9 %, speculative k=8 ≤ 1.9 %,
    entropy-gated ≈ 0 teacher cost until it fires. Nothing is asserted."""
    import pandas as pd

    from kvlab.decode import DecodeConfig, run
    from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative
    from kvlab.harness.costs import run_costs

    if policies is None:
        policies = {"periodic_T64": Periodic(64), "speculative_k8": Speculative(8),
                    "entropy_tau6.0": EntropyGate(6.0), "entropy_never": EntropyGate(1e6),
                    "probe_kl_M8": ProbeKL(8, 0.5)}
    names = ["none", *policies]
    cfgs = {n: DecodeConfig(mode="overfill", max_new_tokens=tokens, refresh=policies.get(n)) for n in names}
    run(teacher, student, prompts[0], cfgs["none"])   # warm-up
    times = {(n, i): [] for n in names for i in range(len(prompts))}
    costs = {}
    for _ in range(repeats):
        for i, prompt in enumerate(prompts):
            for n in names:
                tr = run(teacher, student, prompt, cfgs[n])
                times[n, i].append(tr.total_s)
                costs[n, i] = run_costs(tr.records)
    rows = []
    for n in names:
        over = [100 * (statistics.median(times[n, i]) / statistics.median(times["none", i]) - 1)
                for i in range(len(prompts))]
        rows.append({"policy": n, "overhead_pct": round(statistics.mean(over), 2),
                     "overhead_pct_min": round(min(over), 2), "overhead_pct_max": round(max(over), 2),
                     "total_s": round(statistics.mean(statistics.median(times[n, i]) for i in range(len(prompts))), 3),
                     "refreshes": statistics.mean(costs[n, i]["refreshes"] for i in range(len(prompts))),
                     "teacher_tokens": statistics.mean(costs[n, i]["teacher_tokens"] for i in range(len(prompts))),
                     "teacher_pct_in_run": round(statistics.mean(costs[n, i]["teacher_pct"] for i in range(len(prompts))), 2)})
    df = pd.DataFrame(rows)
    df.attrs["info"] = {"tokens": tokens, "prompts": len(prompts), "repeats": repeats,
                        "device": str(teacher.device)}
    return df


def default_evict_policies(cache_len: int) -> dict:
    """Eviction policies sized for a ``cache_len`` context (budget ≈ cache_len / 4)."""
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


def batch_evict_policies(budget: int = 64) -> dict:
    """The eviction policies the batched benchmark times beside the plain loop (H2O and Conf-KV, 16 protected)."""
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


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
    ``step_ms / plain_ms`` (1.0: an evicting step costs what a plain step at that length costs).
    Also the attention-mass cost, full-cache forward with ``attention=True`` vs without
    (``attn_forward_ratio``). Ratios print; nothing is asserted. The Conf-KV paper reports 0.22 ms
    compaction + 0.11 ms metadata per step on GPT-2 (GPU).
    """
    from types import SimpleNamespace

    from kvlab.cache import KVCache
    from kvlab.decode import token_stats
    from kvlab.eviction import EvictView

    _check_evict_bench(cache_len, steps)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} must be a positive int")
    policies = policies if policies is not None else default_evict_policies(cache_len)
    model = lm.model
    vocab, new, base = _evict_bench_cache(model, cache_len, steps, seed)

    def one(pol) -> dict:
        c = base.copy()
        need = bool(getattr(pol, "needs_attention", False))
        rows = []
        for step, tok in enumerate(new, start=1):
            t0 = time.perf_counter()
            logits = c.forward(model, [tok], writer="teacher", step=step, attention=need)
            _sync()
            t1 = time.perf_counter()
            _, ent, top1, margin = token_stats(logits)
            rec = SimpleNamespace(step=step, entropy_bits=ent, top1_prob=top1, margin=margin)
            d = pol.keep(EvictView(step=step, length=len(c), positions=tuple(c.positions), record=rec,
                                   vocab_size=vocab, num_layers=c.num_layers, attn=c.layer_attn(),
                                   layer_positions=c.layer_positions()))
            drop = d.dropped(len(c))
            per_layer = d.dropped_layers(c.layer_lengths())
            _sync()
            t2 = time.perf_counter()
            r = (c.evict(drop, model=model, rerotate=d.rerotate, layers=per_layer)
                 if drop or (per_layer is not None and any(per_layer)) else None)
            _sync()
            t3 = time.perf_counter()
            if d.int8_window is not None:
                c.quantize_older(d.int8_window, d.int8_group)
            _sync()
            t4 = time.perf_counter()
            rows.append({"forward": t1 - t0, "metadata": t2 - t1, "compact": t3 - t2, "int8": t4 - t3,
                         "step": t4 - t0, "evicted": len(drop), "len": len(c), "bytes": c.nbytes(),
                         "rotate": r.rotate_s if r is not None else 0.0})
        return {"rows": rows}

    def plain(c: KVCache, need: bool) -> dict:
        """Plain steps, each on a cache of the length this copy starts with (cropped back, untimed)."""
        n0, rows = len(c), []
        for step, tok in enumerate(new, start=1):
            c.crop(n0)
            t0 = time.perf_counter()
            c.forward(model, [tok], writer="teacher", step=step, attention=need)
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
        plain(c.copy(), bool(getattr(pol, "needs_attention", False)))
    runs = {n: [] for n in policies}
    plains = {n: [] for n in policies}
    attn = {True: [], False: []}
    for _ in range(repeats):
        for n, pol in policies.items():
            runs[n].append(one(pol))
            plains[n].append(plain(plain_base[n].copy(), bool(getattr(pol, "needs_attention", False))))
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
        med = {k: 1000 * statistics.median(row[k] for row in later)
               for k in ("step", "forward", "metadata", "compact", "int8", "rotate")}
        res = {f"{k}_ms": round(v, 3) for k, v in med.items()}
        plain_ms = 1000 * statistics.median(row["step"] for r in plains[n] for row in r["rows"][1:])
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


def int8_effect(lm, prompt: str, window: int = 32, group: int = 64, tokens: int = 64) -> dict:
    """INT8 storage's roundtrip error and its effect on the next-token distribution, measured.

    The teacher-forced continuation of ``prompt`` (``lm``'s own greedy tokens) is decoded twice
    over the same token sequence: once on an FP cache, once on a cache whose entries older than
    ``window`` are stored as INT8 after every step (``KVCache.quantize_older``, groups of
    ``group``). Reported: the mean / max KL(p_fp || p_int8) over the steps (nats), the K/V bytes of
    both caches at the end, and the relative roundtrip error of K and V (``mean|x̂ - x| / mean|x|``
    per layer, averaged; and the worst layer) of the final FP cache's entries older than ``window``
    quantized as one group.
    """
    from kvlab.cache import KVCache
    from kvlab.decode import DecodeConfig, run
    from kvlab.core.metrics import kl_rows

    model = lm.model
    ids = lm.encode_prompt(prompt)
    cont = run(lm, None, prompt, DecodeConfig(mode="teacher", max_new_tokens=tokens)).tokens
    fp, lf = KVCache.prefill(model, ids, writer="teacher")
    q, lq = KVCache.prefill(model, ids, writer="teacher")
    q.quantize_older(window, group)
    kls = []
    for t in cont[:-1]:
        lf = fp.forward(model, [t], writer="teacher")
        lq = q.forward(model, [t], writer="teacher")
        q.quantize_older(window, group)
        kls.append(float(kl_rows(torch.log_softmax(lf.float(), -1)[None], torch.log_softmax(lq.float(), -1)[None])[0]))
    rt = fp.copy()                       # pure roundtrip: the FP cache's own entries through INT8 and back
    rt.quantize_older(window, 1)
    n = rt.n_int8
    rel_k, rel_v = [], []
    for i in range(rt.num_layers):
        (k, v), (rk, rv) = rt.kv(i), fp.kv(i)
        rel_k.append(float((k[:, :, :n] - rk[:, :, :n]).abs().mean() / rk[:, :, :n].abs().mean()))
        rel_v.append(float((v[:, :, :n] - rv[:, :, :n]).abs().mean() / rv[:, :, :n].abs().mean()))
    return {"model": lm.name, "prompt_tokens": len(ids), "tokens": len(kls), "window": window, "group": group,
            "int8_entries": q.n_int8, "rel_err_k_mean": round(sum(rel_k) / len(rel_k), 5),
            "rel_err_v_mean": round(sum(rel_v) / len(rel_v), 5), "rel_err_max_layer": round(max(rel_k + rel_v), 5),
            "kl_mean": sum(kls) / len(kls), "kl_max": max(kls),
            "fp_kib": round(fp.nbytes() / 1024, 1), "int8_kib": round(q.nbytes() / 1024, 1),
            "bytes_ratio": round(q.nbytes() / fp.nbytes(), 3)}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MiB (Linux ``ru_maxrss`` is KiB)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(r / (2**20 if sys.platform == "darwin" else 1024), 1)


def check_batches(batches) -> list[int]:
    """``--batch`` sizes: positive ints (ValueError naming ``--batch`` otherwise)."""
    if isinstance(batches, int):
        batches = [batches]
    out = list(batches)
    if not out or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in out):
        raise ValueError(f"--batch={batches!r} must be positive ints, e.g. --batch 1,4,8,16")
    return out


def bench_decode_batch(lm, prompts, batches=(1, 4, 8, 16), tokens: int = 64, repeats: int = 2, student=None,
                       variants: int = 8, on_row=None) -> list[dict]:
    """kvlab's batched loop (:func:`kvlab.decode.run_batch`, teacher mode, greedy, fixed N, chat
    template) vs HF ``generate`` on the same model, the same first ``B`` prompts (left-padded for
    HF), greedy, fixed N — one row per batch size ``B``, timed alternately (kvlab, HF, ...) after
    one warm-up each; medians. tok/s = B·N / (prefill + N steps). ``peak_rss_mb``: the process's peak
    so far (monotone across rows).

    At batch ``variants`` (if listed) it also times, side by side in the same repeats, batched
    decoding with eviction (H2O, Conf-KV; teacher mode) and with refresh (Periodic T=27, overfill;
    needs ``student``) against the plain batched loop of the same mode: rows with ``mode`` =
    ``evict:h2o`` etc. and ``vs_plain`` = their tok/s over the plain batched tok/s.
    ``on_row(row)`` is called as soon as each row is measured (a long run keeps what it measured);
    ``kvlab_gain_vs_b1`` / ``hf_gain_vs_b1`` are set once batch 1 has run (list it first).
    """
    from kvlab.decode import DecodeConfig, run_batch
    from kvlab.refresh.policies import Periodic

    batches = check_batches(batches)
    if len(prompts) < max(batches):
        raise ValueError(f"--batch {max(batches)} needs {max(batches)} prompts, got {len(prompts)}")
    tok = lm.tokenizer
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if pad is not None else tok.eos_token_id

    def hf_inputs(b):
        ids = [lm.encode_prompt(p) for p in prompts[:b]]
        width = max(len(x) for x in ids)
        x = torch.tensor([[pad] * (width - len(r)) + r for r in ids], device=lm.device)          # (B, width) left pad
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids], device=lm.device)
        return x, mask

    def ours(b, cfg, student_lm=None):
        def f():
            trs = run_batch(lm, student_lm, list(prompts[:b]), cfg)
            assert all(len(t.records) == tokens for t in trs)
        return f

    def hf(b):
        x, mask = hf_inputs(b)

        def f():
            with torch.inference_mode():
                out = lm.model.generate(x, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                        do_sample=False, pad_token_id=pad)
            assert out.shape[1] - x.shape[1] == tokens
        return f

    plain = DecodeConfig(mode="teacher", max_new_tokens=tokens)
    rows = []
    for b in batches:
        fns = {"kvlab": ours(b, plain), "hf": hf(b)}
        if b == variants:
            for name, pol in batch_evict_policies(64).items():
                fns[name] = ours(b, DecodeConfig(mode="teacher", max_new_tokens=tokens, evict=pol))
            if student is not None:
                fns["overfill"] = ours(b, DecodeConfig(mode="overfill", max_new_tokens=tokens), student)
                fns["refresh:periodic27"] = ours(b, DecodeConfig(mode="overfill", max_new_tokens=tokens,
                                                                 refresh=Periodic(27)), student)
        for f in fns.values():       # warm-up
            f()
        times = {k: [] for k in fns}
        for _ in range(repeats):
            for k, f in fns.items():
                times[k].append(_timed(f))
        tps = {k: b * tokens / statistics.median(v) for k, v in times.items()}
        base = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "tokens": tokens,
                "repeats": repeats, "batch": b}
        new = [{**base, "mode": "teacher", "kvlab_tok_s": round(tps["kvlab"], 2), "hf_tok_s": round(tps["hf"], 2),
                "ratio": round(tps["kvlab"] / tps["hf"], 3), "peak_rss_mb": peak_rss_mb()}]
        one = next((r for r in rows if r["mode"] == "teacher" and r["batch"] == 1), new[0] if b == 1 else None)
        if one is not None:
            new[0]["kvlab_gain_vs_b1"] = round(tps["kvlab"] / one["kvlab_tok_s"], 2)
            new[0]["hf_gain_vs_b1"] = round(tps["hf"] / one["hf_tok_s"], 2)
        for k in fns:
            if ":" in k:
                ref = "overfill" if k.startswith("refresh") else "kvlab"
                new.append({**base, "mode": k, "kvlab_tok_s": round(tps[k], 2),
                            "plain_tok_s": round(tps[ref], 2), "plain_mode": "overfill" if ref == "overfill" else
                            "teacher", "vs_plain": round(tps[k] / tps[ref], 3), "peak_rss_mb": peak_rss_mb()})
        rows += new
        for r in new:
            if on_row is not None:
                on_row(r)
    return rows


def bench_evict_batch(lm, batches=(1, 8, 16), cache_len: int = 2048, steps: int = 16, repeats: int = 2,
                      policies: dict | None = None, seed: int = 0, on_row=None) -> list[dict]:
    """Batched decode steps with eviction vs the full cache, at each batch size (one row per
    (batch, policy)): B rows each start from the same ``cache_len``-entry cache (one prefill, copied
    into every row, attention tracked); each policy then runs ``steps`` steps of one batched forward
    (:func:`kvlab.cache.batch.forward_rows`, attention mass when the policy needs it) plus every row's
    decision, compaction and INT8 demotion (the loop's evict phase). Policies interleave per repeat
    after one warm-up; the first step (the bulk cut to the budget) is left out of the medians.
    ``speedup_vs_full`` = full-cache step time / the policy's, at the same batch size: where
    eviction's saving shows (the cache reads multiply with B, the weight reads do not)."""
    from types import SimpleNamespace

    from kvlab.cache.batch import Bank, forward_rows
    from kvlab.decode import token_stats
    from kvlab.eviction import EvictView

    batches = check_batches(batches)
    _check_evict_bench(cache_len, steps)
    if policies is None:
        full = default_evict_policies(cache_len)
        policies = {k: full[k] for k in ("full", "sliding", "h2o", "confkv")}
    model = lm.model
    vocab, new, base = _evict_bench_cache(model, cache_len, steps, seed)

    out = []
    for B in batches:
        bank = Bank.for_model(model, B, capacity=cache_len + steps + 2)

        def one(pol) -> list[float]:
            caches = [bank.adopt(b, base) for b in range(B)]                 # untimed copies
            need = bool(getattr(pol, "needs_attention", False))
            times = []
            for step, tok in enumerate(new, start=1):
                t0 = time.perf_counter()
                logits = forward_rows(bank, model, caches, [tok] * B, writer="teacher", steps=[step] * B,
                                      attention=[need] * B)
                for b, c in enumerate(caches):
                    _, ent, top1, margin = token_stats(logits[b])
                    rec = SimpleNamespace(step=step, entropy_bits=ent, top1_prob=top1, margin=margin)
                    d = pol.keep(EvictView(step=step, length=len(c), positions=tuple(c.positions), record=rec,
                                           vocab_size=vocab, num_layers=c.num_layers, attn=c.layer_attn(),
                                           layer_positions=c.layer_positions()))
                    drop = d.dropped(len(c))
                    per_layer = d.dropped_layers(c.layer_lengths())
                    if drop or (per_layer is not None and any(per_layer)):
                        c.evict(drop, model=model, rerotate=d.rerotate, layers=per_layer)
                    if d.int8_window is not None:
                        c.quantize_older(d.int8_window, d.int8_group)
                _sync()
                times.append(time.perf_counter() - t0)
            return times, len(caches[0])

        for pol in policies.values():
            one(pol)                                                          # warm-up
        runs = {n: [] for n in policies}
        lens = {}
        for _ in range(repeats):
            for n, pol in policies.items():
                t, lens[n] = one(pol)
                runs[n] += t[1:]
        med = {n: statistics.median(v) for n, v in runs.items()}
        for n in policies:
            row = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "batch": B, "policy": n,
                   "cache_len": cache_len, "steps": steps, "repeats": repeats, "step_ms": round(1000 * med[n], 2),
                   "tok_s": round(B / med[n], 2), "final_len": lens[n], "peak_rss_mb": peak_rss_mb()}
            if "full" in med:
                row["speedup_vs_full"] = round(med["full"] / med[n], 3)
            out.append(row)
            if on_row is not None:
                on_row(row)
        del bank
    return out
