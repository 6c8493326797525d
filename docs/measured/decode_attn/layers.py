"""The batched one-token step's attention alone, SDPA vs the eager form (kvlab.core.decode_attn), at the embedded
teacher's shapes: 30 layers, batch 8, 9 query heads over 3 K/V heads of 64, T columns of a bank's (B, H_kv, cap, D)
buffer, 20 of them masked out (an eviction's holes). Interleaved rounds, the median of 15 per round.
usage: python docs/measured/decode_attn/layers.py [T ...]   (default 1040 4112)"""
import statistics
import sys
import time

import torch

from kvlab.core import decode_attn as DA

torch.set_num_threads(2)
B, H, HKV, D, L = 8, 9, 3, 64, 30
for T in [int(x) for x in sys.argv[1:]] or [1040, 4112]:
    g = torch.Generator().manual_seed(0)
    cap = T + 66
    ks = [torch.randn(B, HKV, cap, D, generator=g)[:, :, :T] for _ in range(L)]       # (B, H_kv, T, D) views
    vs = [torch.randn(B, HKV, cap, D, generator=g)[:, :, :T] for _ in range(L)]
    q = torch.randn(B, H, 1, D, generator=g)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[:, :, :, T // 2:T // 2 + 20] = False
    add = torch.zeros(B, 1, 1, T).masked_fill_(~mask, float("-inf"))
    runs = {"sdpa bool": lambda k, v: DA.sdpa(q, k, v, mask, D ** -0.5),
            "sdpa additive": lambda k, v: DA.sdpa(q, k, v, add, D ** -0.5),
            "eager bool": lambda k, v: DA.eager(q, k, v, mask, D ** -0.5),
            "eager additive": lambda k, v: DA.eager(q, k, v, add, D ** -0.5)}
    got = {n: [] for n in runs}
    with torch.inference_mode():
        for _ in range(3):
            for n, f in runs.items():
                ts = []
                for _ in range(15):
                    t0 = time.perf_counter()
                    for k, v in zip(ks, vs):
                        f(k, v)
                    ts.append(time.perf_counter() - t0)
                got[n].append(statistics.median(ts))
    print(f"T={T}: " + ", ".join(f"{n} {1000 * statistics.median(x):.2f} ms" for n, x in got.items()), flush=True)
