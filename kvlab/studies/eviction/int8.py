"""INT8 cache storage's round-trip error on real prefill K/V (the ``evict_int8`` table)."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from kvlab.studies.eviction.design import INT8_GROUP

def int8_error_table(lm, prompts: Sequence[str], window: int, group: int = INT8_GROUP) -> pd.DataFrame:
    """Round-trip error of INT8 storage on real K/V: each prompt's prefill K and V per layer, the
    entries older than the ``window`` newest quantized as a cache prefix would be, by both schemes
    (one scale per (head, channel), entries arriving one at a time; and groups of ``group`` entries).
    One row per (scheme, tensor): mean over prompts and layers of ``mean_rel`` (mean |x - x̂| / mean |x|,
    the paper's "mean roundtrip error"), ``rel_fro`` and the largest ``max_abs``; ``bytes16_per_entry``:
    K+V bytes of one quantized entry of one layer with 16-bit scales, amortized over the prefix."""
    from kvlab.cache import KVCache
    from kvlab.cache.int8 import roundtrip_error

    rows = []
    for prompt in prompts:
        ids = lm.encode_prompt(prompt)
        cache, _ = KVCache.prefill(lm.model, ids, writer="teacher")
        for layer in range(cache.num_layers):
            k, v = cache.kv(layer)                                           # (1, H_kv, T, D)
            n = k.shape[2] - window
            if n <= 0:
                continue
            for scheme in ("channel", "group"):
                for name, x in (("K", k[:, :, :n].float()), ("V", v[:, :, :n].float())):
                    e = roundtrip_error(x, scheme, group)
                    groups = 1 if scheme == "channel" else -(-n // group)
                    h, d = x.shape[1], x.shape[3]
                    rows.append({"scheme": "per (head, channel)" if scheme == "channel" else f"per ({group} entries, "
                                 "head, channel)", "tensor": name, "layer": layer, **e,
                                 "bytes16_per_entry": h * d + 2 * h * d * groups / n + (4 * (groups > 1)),
                                 "entries": n})
    df = pd.DataFrame(rows)
    g = df.groupby(["scheme", "tensor"], sort=False)
    out = g.agg(mean_rel=("mean_rel", "mean"), rel_fro=("rel_fro", "mean"), max_abs=("max_abs", "max"),
                bytes16_per_entry=("bytes16_per_entry", "mean"), entries=("entries", "mean"),
                layers=("layer", "nunique")).reset_index()
    return out
