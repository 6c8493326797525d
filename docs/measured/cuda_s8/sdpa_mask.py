"""Is it the mask? One decode step's attention (batch 8, 9 query heads over 3 KV heads repeated, head dim 64, about
4,096 keys) through torch's SDPA: no mask, a boolean (B, 1, 1, W) mask, an additive float mask, each at a fixed width
and at a width that grows by one per call (as a decode step's does), the keys a view of a wider buffer (as kvlab's
bank hands them) or contiguous. Mean ms per call over 200 calls, the device
synced once per call. Usage: python sdpa_mask.py OUT_DIR"""
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
B, H, Hkv, D, W0, N = 8, 9, 3, 64, 4096, 200
g = torch.Generator(device="cpu").manual_seed(0)
q = torch.randn(B, H, 1, D, generator=g).to(dev, dt)
k = torch.randn(B, Hkv, W0 + N, D, generator=g).to(dev, dt).repeat_interleave(H // Hkv, dim=1)
v = torch.randn(B, Hkv, W0 + N, D, generator=g).to(dev, dt).repeat_interleave(H // Hkv, dim=1)


def sync():
    if dev == "cuda":
        torch.cuda.synchronize()


def run(kind, grow, dense):
    ts = []
    for i in range(N):
        w = W0 + (i if grow else 0)
        kk, vv = k[:, :, :w], v[:, :, :w]                  # views of a wider buffer, as kvlab's bank hands them
        if dense:
            kk, vv = kk.contiguous(), vv.contiguous()
        if kind == "none":
            m = None
        else:
            m = torch.ones(B, 1, 1, w, dtype=torch.bool, device=dev)
            if kind == "float":
                m = torch.zeros(B, 1, 1, w, dtype=dt, device=dev).masked_fill(~m, float("-inf"))
        sync()
        t = time.perf_counter()
        F.scaled_dot_product_attention(q, kk, vv, attn_mask=m)
        sync()
        ts.append(1000 * (time.perf_counter() - t))
    return sum(ts[10:]) / len(ts[10:])


rows = []
for kind, grow, dense in [(m, gr, de) for m in ("none", "bool", "float") for gr in (False, True) for de in (False, True)]:
    if True:
        r = {"mask": kind, "width": "grows" if grow else "fixed", "keys": "contiguous" if dense else "view",
             "ms_per_call": round(run(kind, grow, dense), 4),
             "device": dev, "dtype": str(dt), "torch": torch.__version__}
        rows.append(r)
        print(json.dumps(r), flush=True)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
(out / "sdpa_mask.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
