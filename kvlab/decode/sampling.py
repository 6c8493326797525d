"""Choosing a token: the distribution's statistics (log-probs, entropy in bits, top-1, margin) and the seeded
greedy / nucleus draw."""
from __future__ import annotations

import math

import torch

from kvlab.decode.config import Sampling

LN2 = math.log(2.0)


def token_stats(logits: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """``(logp, entropy_bits, top1_prob, margin)`` of a ``(V,)`` logit vector."""
    logp = torch.log_softmax(logits.float(), dim=-1)          # (V,)
    p = logp.exp()
    ent = -float(torch.dot(p, logp))                           # one fused pass (hot path: every step)
    if math.isnan(ent):                                        # -inf logits (masked tokens): 0 * -inf
        ent = float(torch.special.entr(p).sum())
    top1, top2 = torch.topk(logp, 2).values.exp().tolist()
    return logp, ent / LN2, top1, top1 - top2


def token_stats_rows(logits: torch.Tensor) -> list[tuple[torch.Tensor, float, float, float, int]]:
    """:func:`token_stats` of every row of ``(B, V)`` logits, in one pass over the batch, plus each
    row's greedy choice ``argmax(logits[b])`` (what :func:`choose` picks at temperature 0: the first
    maximal index, one batched argmax instead of one per row)."""
    logp = torch.log_softmax(logits.float(), dim=-1)           # (B, V)
    p = logp.exp()
    ent = -(p * logp).sum(-1)                                   # (B,)
    top = torch.topk(logp, 2, dim=-1).values.exp()              # (B, 2)
    best = torch.argmax(logits, dim=-1).tolist()                # (B,) greedy choices
    out = []
    for b, (e, t1, t2) in enumerate(zip(ent.tolist(), top[:, 0].tolist(), top[:, 1].tolist())):
        if math.isnan(e):                                       # -inf logits (masked tokens): 0 * -inf
            e = float(torch.special.entr(p[b]).sum())
        out.append((logp[b], e / LN2, t1, t1 - t2, best[b]))
    return out


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a seeded draw from ``softmax(logits / T)`` restricted to the top-p nucleus."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)  # (V,)
    if sampling.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sp, 0) - sp) < sampling.top_p   # smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
