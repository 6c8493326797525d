"""The attention of a batched one-token decode step: SDPA or two plain products. Pure linear algebra: reads the
query, keys, values and mask it is given, edits nothing, touches no cache.

A batched decode step (:func:`kvlab.cache.batch.forward_rows`) attends one query per row over each row's own
columns, with a per-row mask ``(B, 1, 1, T)``. transformers' SDPA path folds the grouped query heads onto the key
heads (no K/V copy) and calls ``F.scaled_dot_product_attention``, whose CPU kernel walks the keys in blocks with an
online softmax. The same attention written as two batched products and a softmax (the eager form kvlab's measuring
steps already use, :func:`kvlab.cache.mass.decode_attention`) reads K and V once each as well. Which is faster is the
CPU's: on a 2-core AMD EPYC (family 26) the 30 layers at batch 8 over 1,040 columns took 17.5 ms eager and 20.0 ms
through SDPA (a plain batched step about 6 % faster eager); on the Intel Xeon of sessions 18-19 the eager pass was
the dearer one (``docs/measured/decode_attn``).

Which runs is :data:`DECODE`: None (the default) is SDPA everywhere, so studies and figures compute what they
always did (the two sum in another order: |Δ| ~1e-6, and a greedy near-tie can flip); ``"eager"`` / ``"sdpa"``
force one; ``"auto"`` times both once per process on the CPU (four layers at batch 8 over 1,024 columns at the
first step's head shapes, interleaved, median of five) and keeps the faster, SDPA on any other device. ``python -m
kvlab bench`` runs ``"auto"`` by default (its ``--decode-attention``), as it does for the weight products
(:mod:`kvlab.core.packed`).
"""
from __future__ import annotations

import torch

CHOICES = ("sdpa", "eager")
DECODE: str | None = None       # "sdpa", "eager", "auto" (the faster here, timed once: choice()), or None: SDPA
_CHOSEN: dict[tuple, str] = {}  # the timed choice of this process, per (H, H_kv, D)


def choice(query: torch.Tensor | None = None, key: torch.Tensor | None = None) -> str:
    """The attention a batched one-token step runs: :data:`DECODE` when it names one (checked), ``"sdpa"`` for
    None, and for ``"auto"`` the faster here (timed once per head shape on the CPU; SDPA elsewhere)."""
    if DECODE is None:
        return "sdpa"
    if DECODE != "auto":
        if DECODE not in CHOICES:
            raise ValueError(f"kvlab.core.decode_attn.DECODE={DECODE!r} must be one of {CHOICES}, 'auto' (timed) "
                             "or None (SDPA)")
        return DECODE
    if query is None or key is None or query.device.type != "cpu":
        return "sdpa"
    shape = (int(query.shape[1]), int(key.shape[1]), int(query.shape[-1]), query.dtype)
    if shape not in _CHOSEN:
        _CHOSEN[shape] = _timed(*shape)
    return _CHOSEN[shape]


def described() -> str:
    """What this process's one-token steps ran, for a bench row: ``"sdpa"`` / ``"eager"``, or for ``"auto"`` the
    timed choice (``"auto: eager"``; per head shape when several were timed; ``"auto"`` before any step)."""
    if DECODE != "auto":
        return choice()
    got = sorted(set(_CHOSEN.values()))
    return "auto" if not got else "auto: " + "/".join(got)


def scores(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> torch.Tensor:
    """``(B, H, w, T)`` float32 masked scores of ``query`` (B, H, w, D) over ``key`` (B, H_kv, T, D), GQA grouped
    (no K copy); ``mask`` bool (True = attend) or additive, broadcastable to ``(B, 1|H, w, T)``, or None. A new
    tensor, masked in place (a prefill's is ~0.3 GB: no second one)."""
    b, h, w, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    scale = float(scaling if scaling is not None else d ** -0.5)
    s = torch.matmul(query.reshape(b, hkv, (h // hkv) * w, d) * scale, key.transpose(-1, -2))   # (B, H_kv, g·w, T)
    s = (s if s.dtype == torch.float32 else s.float()).view(b, h, w, t)                # (B, H, w, T)
    if mask is not None:
        s.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else s.add_(mask.float())
    return s


def eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
          scaling: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row: ``query`` (B, H, 1, D) over ``key`` / ``value`` (B, H_kv, T, D), GQA grouped (no K/V
    copy); ``mask`` as :func:`scores` takes it, broadcastable to ``(B, 1, 1, T)``. Returns the output
    ``(B, 1, H, D)`` (transformers' layout) and the probabilities ``(B, H, 1, T)`` float32."""
    b, h, n, t = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    hkv = key.shape[1]
    probs = torch.softmax(scores(query, key, mask, scaling), dim=-1)                    # (B, H, 1, T) float32
    out = torch.matmul(probs.to(value.dtype).view(b, hkv, (h // hkv) * n, t), value)    # (B, H_kv, g, D)
    return out.view(b, h, n, value.shape[-1]).transpose(1, 2).contiguous(), probs


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
         scaling: float | None) -> torch.Tensor:
    """The same step through ``F.scaled_dot_product_attention`` as transformers runs it for one query (grouped
    heads folded onto the key heads); ``(B, 1, H, D)``."""
    b, h, n, d = query.shape
    hkv = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(b, hkv, h // hkv, d), key, value,
                                                           attn_mask=mask, scale=scaling)  # (B, H_kv, g, D)
    return out.reshape(b, h, n, value.shape[-1]).transpose(1, 2).contiguous()


def _timed(h: int, hkv: int, d: int, dtype) -> str:
    import time

    g = torch.Generator().manual_seed(0)
    B, T, cap = 8, 1024, 1040
    kv = [(torch.randn(B, hkv, cap, d, generator=g).to(dtype)[:, :, :T],               # (B, H_kv, T, D) views
           torch.randn(B, hkv, cap, d, generator=g).to(dtype)[:, :, :T]) for _ in range(4)]
    q = torch.randn(B, h, 1, d, generator=g).to(dtype)
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)
    mask[:, :, :, T // 2:T // 2 + 16] = False
    runs = {"sdpa": lambda k, v: sdpa(q, k, v, mask, None), "eager": lambda k, v: eager(q, k, v, mask, None)}
    times: dict[str, list[float]] = {c: [] for c in CHOICES}
    with torch.inference_mode():
        for c in CHOICES:                                                              # warm-up
            for k, v in kv:
                runs[c](k, v)
        for _ in range(5):
            for c in CHOICES:
                t0 = time.perf_counter()
                for k, v in kv:
                    runs[c](k, v)
                times[c].append(time.perf_counter() - t0)
    return min(CHOICES, key=lambda c: sorted(times[c])[len(times[c]) // 2])


__all__ = ["CHOICES", "DECODE", "choice", "described", "eager", "scores", "sdpa"]
