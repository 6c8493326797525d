"""INT8 storage's roundtrip error and its effect on the next-token distribution."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb  # noqa: F401


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
