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
