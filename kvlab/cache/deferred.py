"""Deferred attention statistics: a decode step keeps its queries; their attention mass is computed when the
statistics are next read or the cache next edited, all pending queries of a row at once. Part of the cache module.

A policy asked only every N-th step (:class:`kvlab.eviction.every.Every`) reads its statistics once per N steps,
but a step that measures mass (:mod:`.mass`) computes the attention eagerly and folds a ``(T,)`` mass per row and
layer into the statistics, every step. A deferred step instead runs the plain attention (SDPA) and keeps each
layer's post-RoPE query ``(H, D)`` of the row (:class:`QuerySink`, through the ``"kvlab"`` attention function's
``kvlab_queries`` kwarg), with each layer's length after the step; the row's statistics get the step's new entries
as zeros, as an unmeasured step would. :func:`settle` then computes, per layer, the attention of the ``N`` pending
queries over the layer's keys in one pass — query ``j`` sees the first ``t_j`` slots it saw at its step — and folds
it in as ``N`` steps would have: ``acc += Σ_j a_j``, ``ema ← β^N·ema + (1-β)·Σ_j β^(N-1-j)·a_j`` (each ``a_j``
max-pooled first when ``pool > 1``), ``count += #{j : j sees the entry}``, ``low += #{j : a_j < 1/t_j}``: the same
numbers within float tolerance (tests/test_deferred_stats.py), because between two reads the cache only grows (every
other edit settles first: :meth:`kvlab.cache.KVCache._settle`).
"""
from __future__ import annotations

import torch

from kvlab.cache.mass import below_counts
from kvlab.cache.stats import max_pool_next

KWARG = "kvlab_queries"


class QuerySink:
    """Collects one forward's per-layer queries ``(B, H, n, D)`` and attention scaling (a deferred step)."""

    def __init__(self):
        self.q: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}

    def take(self, layer: int, query: torch.Tensor, scaling) -> None:
        self.q[layer] = query
        self.scaling[layer] = float(scaling if scaling is not None else query.shape[-1] ** -0.5)

    def stacked(self, count: int) -> torch.Tensor:
        """``(L, B, H, D)``: every layer's query of a one-token step, one tensor for the step's rows."""
        if len(self.q) != count:
            raise RuntimeError(f"queries reached {len(self.q)} of {count} layers: the model does not run the 'kvlab' "
                               "attention function on every layer")
        return torch.stack([self.q[i][:, :, -1] for i in range(count)])                    # (L, B, H, D)


@torch.inference_mode()
def settle(cache) -> None:
    """Fold ``cache``'s pending queries into its attention statistics (module docstring); a no-op when none wait."""
    st = cache._stats
    if st is None or not st.pending:
        return
    pending, scaling = st.pending, st.pending_scaling
    store = cache._store
    L = store.num_layers
    n = len(pending)
    q = torch.stack([qs[:, b] for qs, b, _ in pending], dim=2)                          # (L, H, N, D)
    seen_upto = torch.tensor([lens for _, _, lens in pending], dtype=torch.long, device=q.device)  # (N, L) slots seen
    beta = st.ema_decay
    wts = beta ** torch.arange(n - 1, -1, -1, dtype=torch.float32, device=q.device)     # (N,) β^(N-1-j)
    adds = {name: [] for name in ("acc", "ema_in", "count", "low")}
    first_seen = seen_upto.min(0).values.tolist()                                         # (L,) every query sees these
    H, D = q.shape[1], q.shape[3]
    for i in range(L):
        k = store.full_kv(i)[0]                                                          # (1, H_kv, T, D)
        t, hkv = int(k.shape[2]), int(k.shape[1])
        vis = (torch.arange(t, device=k.device)[None, :] < seen_upto[:, i, None])[None]  # (1, N, T)
        qg = (q[i] * scaling[i]).to(k.dtype).reshape(1, hkv, (H // hkv) * n, D)          # (1, H_kv, g·N, D) scaled
        s = torch.matmul(qg, k.transpose(-1, -2)).view(H, n, t)                          # (H, N, T) scores
        s = s.float() if s.dtype != torch.float32 else s
        t0 = first_seen[i]
        if t0 < t:                                                                       # only the tail differs
            s[:, :, t0:].masked_fill_(~vis[:, :, t0:], float("-inf"))
        a = torch.softmax(s, dim=-1).mean(0)                                             # (N, T) float32
        m = max_pool_next(a, st.pool)                                                    # (N, T) pooled per query
        adds["acc"].append(m.sum(0))
        adds["ema_in"].append((wts[:, None] * m).sum(0))
        adds["count"].append(vis[0].sum(0).float())
        adds["low"].append(below_counts(a[None], vis)[0] if st.below else None)
    st.fold(n, adds)
    st.pending = []
