"""Benchmarks that print ratios measured in one run (they never assert: machines are noisy)."""
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
    from .decode import run

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
    from .cache import KVCache

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
    from .decode import DecodeConfig, Decoding
    from .mc import check_n_passes, check_p, mc_dropout

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

    from .decode import DecodeConfig, run
    from .policies import EntropyGate, Periodic, ProbeKL, Speculative
    from .refresh import run_costs

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


def bench_evict(lm, cache_len: int = 2048, steps: int = 16, budget: int = 512, repeats: int = 3,
                policies: dict | None = None):
    """Eviction cost at a long context, measured side by side in this one process.

    A passkey haystack of ``cache_len`` tokens is prefilled once (twice: with and without
    attention statistics); every policy then decodes ``steps`` greedy tokens on a copy of that
    cache through the real loop (:meth:`Decoding.resume`, interleaved per repeat, after a warm-up):

    * ``first_ms``  — step 1: the forward over ``cache_len`` entries + the first eviction down to
      the budget (the big compaction);
    * ``step_ms``   — median of steps 2..N (steady state: the cache holds about ``budget``
      entries and one is evicted per step), ``speedup`` = full's ``step_ms`` / the policy's.

    Then the pieces, timed on the same caches (medians over ``repeats`` × 5 trials):

    * ``attn_ms``     — one decode forward with attention mass (query hooks + mass + EMA/acc
      update) minus the same forward without, at ``cache_len`` entries (what a policy that
      ``needs_attention`` pays per step);
    * ``decide_ms``   — the policy's ``keep(view)`` at ``budget + 1`` entries (ranking: the metadata work);
    * ``compact_ms``  — ``KVCache.evict`` of one entry at ``budget + 1`` entries (gather of every
      layer + live map + stats: the per-step compaction), and ``compact_first_ms`` for
      ``cache_len + 1 → budget``.

    Paper reference (GPT-2, GPU): 0.22 ms compaction + 0.11 ms metadata per step. Nothing is asserted.
    """
    import pandas as pd

    from .cache import KVCache
    from .decode import DecodeConfig, Decoding, StepRecord
    from .eviction import H2O, BlockEvict, ConfKV, RandomEvict, SlidingWindow
    from .eviction.base import EvictView
    from .needle import build_case

    if isinstance(budget, bool) or not isinstance(budget, int) or not 16 <= budget < cache_len:
        raise ValueError(f"budget={budget!r} must be an int in [16, cache_len={cache_len})")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps={steps!r} must be an int >= 3 (step 1 evicts to the budget; 2.. are steady)")
    if policies is None:
        rec, bs = budget // 8, 16
        policies = {"sliding": SlidingWindow(window=budget), "h2o": H2O(budget=budget, recent=rec),
                    "random": RandomEvict(budget=budget, recent=rec),
                    "confkv": ConfKV(gamma=0.7, tight=budget // 2, loose=budget, protect=rec),
                    "confkv_recency": ConfKV(gamma=0.7, tight=budget // 2, loose=budget, protect=rec, attn_weight=0.0),
                    "block": BlockEvict(block_size=bs, start_blocks=1, evictable_blocks=budget // bs - 1 - max(1, rec // bs),
                                        recent_blocks=max(1, rec // bs))}
    model = lm.model
    ids = lm.encode_prompt(build_case(lm.tokenizer, cache_len + 1, 0.5, "12345").prompt, chat=False)[:cache_len + 1]
    prefix, last = ids[:-1], ids[-1]
    base = {}
    for attn in (False, True):
        c = KVCache()
        if attn:
            c.track_attention(0.9)
        c.forward(model, prefix, writer="teacher", attention=attn)
        base[attn] = c
    names = ["full", *policies]

    def decode(name):
        pol = policies.get(name)
        attn = bool(getattr(pol, "needs_attention", False))
        d = Decoding.resume(lm, base[attn].copy(), last_token=last, config=DecodeConfig(
            mode="teacher", max_new_tokens=steps, evict=pol))
        return list(d)

    for n in names:   # warm-up
        decode(n)
    first = {n: [] for n in names}
    step = {n: [] for n in names}
    after = {}
    for _ in range(repeats):
        for n in names:
            recs = decode(n)
            first[n].append(recs[0].wall_s)
            step[n] += [r.wall_s for r in recs[1:]]
            after[n] = recs[-1].cache_len

    def med_ms(xs):
        return 1000 * statistics.median(xs)

    # pieces on the same caches
    trials = 5 * repeats
    t_on, t_off = [], []
    for _ in range(trials):
        for attn, acc in ((True, t_on), (False, t_off)):
            c = base[attn].copy()
            acc.append(_timed(lambda: c.forward(model, [last], writer="teacher", attention=attn)))
    attn_ms = med_ms(t_on) - med_ms(t_off)
    small = {}
    for attn in (False, True):
        c = base[attn].copy()
        c.evict(list(range(budget // 2, cache_len - budget // 2 - 1)))     # budget + 1 entries left
        small[attn] = c
    rec0 = StepRecord(step=2, token_id=last, token="", position=small[True].next_position, logprob=-1.0,
                      entropy_bits=1.0, top1_prob=0.9, margin=0.8, cache_len=len(small[True]), source="teacher",
                      refreshed=False, evicted=0, wall_s=0.0, elapsed_s=0.0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    rows = []
    for n in names:
        pol = policies.get(n)
        attn = bool(getattr(pol, "needs_attention", False))
        row = {"policy": n, "first_ms": round(med_ms(first[n]), 3), "step_ms": round(med_ms(step[n]), 3),
               "cache_after": after[n]}
        if pol is not None:
            c = small[attn]
            view = EvictView(step=2, length=len(c), positions=tuple(c.positions), record=rec0, vocab_size=vocab,
                             num_layers=c.num_layers, attn=c.attn)
            dec = [_timed(lambda: pol.keep(view)) for _ in range(trials)]
            comp, comp_first = [], []
            for _ in range(trials):
                cc = c.copy()
                comp.append(cc.evict([len(cc) // 2]).compact_s)
                cc = base[attn].copy()
                comp_first.append(cc.evict(list(range(budget // 2, cache_len - budget // 2))).compact_s)
            row.update(decide_ms=round(med_ms(dec), 4), compact_ms=round(med_ms(comp), 4),
                       compact_first_ms=round(med_ms(comp_first), 4),
                       attn_ms=round(attn_ms, 4) if attn else 0.0)
        rows.append(row)
    df = pd.DataFrame(rows)
    df["speedup"] = (df.loc[df.policy == "full", "step_ms"].iloc[0] / df["step_ms"]).round(3)
    df.attrs["info"] = {"model": lm.name, "device": str(lm.device), "dtype": str(lm.dtype), "cache_len": cache_len,
                        "budget": budget, "steps": steps, "repeats": repeats,
                        "attn_on_ms": round(med_ms(t_on), 3), "attn_off_ms": round(med_ms(t_off), 3),
                        "cache_mb": round(base[False].nbytes() / 2**20, 2)}
    return df
