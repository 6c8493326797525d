"""Decode benchmarks: kvlab's loop vs HF ``generate``, at batch 1 and batched."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb  # noqa: F401


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
    from kvlab.studies.bench.evict import decode_evict_policies
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
            for name, pol in decode_evict_policies(64).items():
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
