"""The surgery benchmark: one tick of replace_pairs, gather splice vs the seed's per-row concat."""
from __future__ import annotations

import statistics
import time

import torch

from kvlab.studies.bench.timing import _sync, _timed, check_batches, peak_rss_mb  # noqa: F401


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
