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
