"""Attention mass from the attention computation itself (one pass): the ``"kvlab"`` attention function hands each
layer's head-mean attention probabilities to a :class:`MassSink` passed as the forward's ``kvlab_mass`` kwarg.
Part of the cache module: no hook, no patched forward; nothing here edits a cache.

A decode step (one query) is computed eagerly, once: ``P = softmax(q · Kᵀ · scaling + mask)`` in float32,
the output ``P · V``, and the sink's per-entry reductions of the head mean ``a = mean_h P`` — the same
numbers :class:`~kvlab.cache.attention.QueryCapture` rebuilt with a second Q·Kᵀ pass after the forward
(equal within fp32 tolerance; tests/test_mass_one_pass.py). A multi-token forward (a prefill, a
teacher catching up) keeps SDPA's output and computes the probabilities of its measured queries
(the last ``window``) from the same query and key tensors inside the attention function: an eager
``(n, T)`` pass would cost O(n·T) memory for the output alone.

Per layer the sink keeps, over the key columns the attention function saw (``(B, T)``; a batched
step's columns are the bank's, each row its own span):

    mass_j = Σ_i a[i, j]                       # the measured queries i = 0 … w-1
    ema_j  = Σ_i β^(w-1-i) a[i, j]             # when ``decay`` = β (per-query EMA updates)
    low_j  = #{i : a[i, j] < 1/T_i, j visible}  # when ``below`` (Scissorhands)
"""
from __future__ import annotations

import torch

from kvlab.core import decode_attn

KWARG = "kvlab_mass"


class MassSink:
    """Collects one forward's per-layer attention mass. ``window``: only the last ``window`` queries
    count (None: all); ``below``: also count low-attention queries; ``decay``: β of a per-query EMA
    (None: no EMA weights). After the forward ``mass[i]`` / ``low[i]`` / ``ema[i]`` are ``(B, T_i)``
    float32 per layer ``i`` (``low`` / ``ema`` only when asked)."""

    def __init__(self, window: int | None = None, below: bool = False, decay: float | None = None,
                 low_later: bool = False):
        self.window, self.below, self.decay = window, below, decay
        # ``low_later``: one-query steps whose reader picks each row's seen columns (a batched step,
        # :func:`kvlab.cache.batch.forward_rows`) count the low queries there, all layers at once (:func:`low_of_seen`)
        self.low_later = bool(low_later and below)
        self.wants_vis = below and not self.low_later   # the attention function hands ``take`` the visibility
        # ``(L, B, W)`` float32 or None: a batched one-query step's mass of every layer in one tensor (set by the
        # batched forward, :func:`kvlab.cache.batch.forward_rows`): ``take`` writes layer ``i``'s ``(B, T_i)`` into
        # its first columns and ``mass[i]`` is that view, so the reader picks every layer's mass without stacking
        self.block: torch.Tensor | None = None
        self.mass: dict[int, torch.Tensor] = {}
        self.low: dict[int, torch.Tensor] = {}
        self.ema: dict[int, torch.Tensor] = {}

    def measured(self, n: int) -> int:
        return n if self.window is None else min(int(self.window), n)

    def take(self, layer: int, a: torch.Tensor, vis: torch.Tensor) -> None:
        """``a``: ``(B, w, T)`` head-mean probabilities of the measured queries (float32); ``vis``: bool
        ``(B | 1, w, T)``, the entries each query sees (its count is that query's ``T_i``; read only when
        ``below``)."""
        w = a.shape[1]
        if w == 1 and self.block is not None:
            dst = self.block[layer, :, :a.shape[-1]]                                # (B, T) view of the block
            dst.copy_(a[:, 0])
            self.mass[layer] = dst
        else:
            self.mass[layer] = a[:, 0] if w == 1 else a.sum(1)                       # (B, T)
        if self.decay is not None:
            if w == 1:
                self.ema[layer] = self.mass[layer]                                  # β^0 · a: exactly a
            else:
                wts = float(self.decay) ** torch.arange(w - 1, -1, -1, device=a.device, dtype=a.dtype)
                self.ema[layer] = torch.einsum("w,bwt->bt", wts, a)
        if self.below and not self.low_later:
            self.low[layer] = below_counts(a, vis)

    def layers(self, what: str, count: int) -> list[torch.Tensor]:
        got = getattr(self, what)
        if len(got) != count:
            raise RuntimeError(f"attention mass reached {len(got)} of {count} layers: the model does not run the "
                               "'kvlab' attention function on every layer")
        return [got[i] for i in range(count)]


def below_counts(a: torch.Tensor, vis: torch.Tensor) -> torch.Tensor:
    """Per entry, how many of the ``w`` queries of ``a`` ``(B, w, T)`` gave it less than the uniform share
    ``1/T_i`` of their attention, ``T_i`` = the entries query ``i`` sees (``vis`` ``(B | 1, w, T)``, True =
    seen; causal: ``T - w + i + 1``); float ``(B, T)``."""
    seen = vis.sum(-1, keepdim=True).to(a.dtype)                                   # (B | 1, w, 1)
    return ((a < 1.0 / seen) & vis).sum(-2).float()                                # (B, T)


def low_of_seen(a: torch.Tensor, seen: int | torch.Tensor) -> torch.Tensor:
    """:func:`below_counts` of one query per row, given only the entries it sees: ``a`` ``(..., c)`` its head-mean
    probabilities over its ``c`` seen columns (``seen``: c, or a broadcastable count); float 0/1 ``(..., c)``, the
    same numbers (the uniform share is computed as there: ``1 / T`` in ``a``'s dtype)."""
    c = torch.as_tensor(seen, dtype=a.dtype, device=a.device)
    return (a < 1.0 / c).float()


def _visible(mask: torch.Tensor | None, w: int, t: int, device) -> torch.Tensor:
    """Bool ``(B | 1, w, T)``: the entries each of the last ``w`` queries sees (``mask`` this forward's rows
    for them, ``(B | 1, 1, w, T)`` bool or additive; None = causal, aligned bottom right)."""
    if mask is None:
        qi = torch.arange(w, device=device).view(w, 1) + (t - w)
        return (torch.arange(t, device=device).view(1, t) <= qi).view(1, w, t)
    m = mask if mask.dtype == torch.bool else mask == 0
    return m[:, 0, -w:].expand(m.shape[0], w, t)


def softmax_(s: torch.Tensor) -> torch.Tensor:
    """``softmax(s, -1)`` computed in ``s``'s own storage (a prefill's scores are ~0.3 GB: no second tensor)."""
    s.sub_(s.amax(-1, keepdim=True)).exp_()
    return s.div_(s.sum(-1, keepdim=True))


def decode_attention(module, query, key, value, mask, scaling, sink: MassSink):
    """One query per row, computed once: ``(B, 1, H, D)`` output (transformers' layout) and the head mean
    of the probabilities handed to ``sink``."""
    out, probs = decode_attn.eager(query, key, value, mask, scaling)                   # (B, 1, H, D), (B, H, 1, T)
    vis = _visible(mask, 1, key.shape[2], query.device) if sink.wants_vis else None   # only the counts read it
    sink.take(module.layer_idx, probs.mean(1), vis)                                   # (B, 1, T)
    return out, None


def window_mass(module, query, key, mask, scaling, sink: MassSink) -> None:
    """A multi-token forward: the head-mean probabilities of its last ``w`` measured queries, to ``sink``
    (``mask``: this layer's, ``(…, n, T)``, or None = causal aligned bottom right)."""
    n, t = query.shape[2], key.shape[2]
    w = sink.measured(n)
    if mask is not None:
        mask = mask[..., n - w:, :]
    vis = _visible(mask, w, t, query.device)                                          # (B | 1, w, T)
    probs = softmax_(decode_attn.scores(query[:, :, n - w:, :], key, vis[:, None], scaling))   # (B, H, w, T)
    sink.take(module.layer_idx, probs.mean(1), vis)                                   # (B, w, T)
