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
# Whether a batched step defers a policy's statistics to its asked step, per device type (False: it measures every
# step, one pass: :mod:`.mass`). Deferring moves the steps' Q·Kᵀ to the asked step and batches it (the settle's
# N-query products are compute the CPU pays in full); measuring each step runs the attention eagerly and folds each
# row's mass at every step. A/B on the 2-core CPU (batch 8, 4,096 -> ~1,030 entries, asked every 16 steps, two
# alternating rounds; docs/measured/defer_cpu): evicting / plain H2O 1.130, 1.136 deferred vs 1.131, 1.088 each
# step; Scissorhands 1.167, 1.171 vs 1.220, 1.225 (its below-uniform counts every step). Neither wins on both: the
# CPU keeps deferring, as CUDA does (docs/measured/cuda_s13).
DEFERS = {"cuda": True, "cpu": True}


def defers(device) -> bool:
    """Whether a batched step on ``device`` defers the statistics of a policy asked every N steps (:data:`DEFERS`)."""
    return DEFERS.get(torch.device(device).type, True)


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
    settle_rows([cache])


def _group_key(cache) -> tuple:
    """Rows that settle together: the same pending steps (count and per-layer lengths seen), statistics settings,
    layer lengths, scaling and key dtype."""
    st, store = cache._stats, cache._store
    k0 = store.full_kv(0)[0]
    return (tuple(tuple(lens) for _, _, lens in st.pending), tuple(st.pending_scaling), st.ema_decay, st.pool,
            st.below, tuple(cache.layer_lengths()), k0.dtype, k0.device)


@torch.inference_mode()
def settle_rows(caches) -> None:
    """:func:`settle` for several caches (the rows of a batch) at once: rows with the same pending steps, settings
    and layer lengths share each layer's softmax, head mean, pooling and sums (one op over the rows instead of one
    per row); the ``Q·Kᵀ`` stays one matmul per row and layer, over the row's own keys (no copy). Rows that
    match no other settle alone. The same numbers as one :func:`settle` per row."""
    groups: dict[tuple, list] = {}
    for c in caches:
        if c is not None and c._stats is not None and c._stats.pending:
            groups.setdefault(_group_key(c), []).append(c)
    for group in groups.values():
        _settle_group(group)


def _rows_view(keys: list) -> torch.Tensor | None:
    """The rows' keys ``G × (1, H_kv, T, D)`` as one ``(G, H_kv, T, D)`` view when they lie in one storage at equal
    steps of their own row stride (a bank's rows ``b, b+1, …`` at the same columns), else None. No copy."""
    k0 = keys[0]
    if len(keys) < 2 or k0.stride(0) <= 0:
        return None
    step = k0.stride(0)
    for g, k in enumerate(keys):
        if (k.untyped_storage().data_ptr() != k0.untyped_storage().data_ptr() or k.shape != k0.shape
                or k.stride() != k0.stride() or k.dtype != k0.dtype
                or k.storage_offset() != k0.storage_offset() + g * step):
            return None
    return k0.as_strided((len(keys),) + tuple(k0.shape[1:]), k0.stride(), k0.storage_offset())


def _settle_group(group: list) -> None:
    st0 = group[0]._stats
    pending, scaling = st0.pending, st0.pending_scaling
    L = group[0]._store.num_layers
    n, G = len(pending), len(group)
    q = torch.stack([torch.stack([qs[:, b] for qs, b, _ in c._stats.pending], dim=2) for c in group])  # (G, L, H, N, D)
    seen = [lens for _, _, lens in pending]
    seen_upto = torch.tensor(seen, dtype=torch.long, device=q.device)                 # (N, L) slots seen
    first_seen = [min(col) for col in zip(*seen)]                     # (L,) every query sees these (no read-back)
    beta = st0.ema_decay
    wts = beta ** torch.arange(n - 1, -1, -1, dtype=torch.float32, device=q.device)  # (N,) β^(N-1-j)
    H, D = q.shape[2], q.shape[4]
    adds = {name: [] for name in ("acc", "ema_in", "count", "low")}
    for i in range(L):
        keys = [c._store.full_kv(i)[0] for c in group]                               # G × (1, H_kv, T, D)
        t, hkv = int(keys[0].shape[2]), int(keys[0].shape[1])
        qi = (q[:, i] * scaling[i]).to(keys[0].dtype)                                  # (G, H, N, D) scaled
        s = torch.empty(G, H, n, t, dtype=keys[0].dtype, device=keys[0].device)      # (G, H, N, T) scores
        rows = _rows_view(keys)                                                       # (G, H_kv, T, D) or None
        if rows is not None:                                                          # one matmul for the group
            torch.matmul(qi.reshape(G, hkv, (H // hkv) * n, D), rows.transpose(-1, -2),
                         out=s.view(G, hkv, (H // hkv) * n, t))
        else:
            for g, k in enumerate(keys):                                              # GQA grouped: no K copy
                torch.matmul(qi[g].reshape(hkv, (H // hkv) * n, D), k[0].transpose(-1, -2),
                             out=s[g].view(hkv, (H // hkv) * n, t))
        s = s.float() if s.dtype != torch.float32 else s
        vis = (torch.arange(t, device=s.device)[None, :] < seen_upto[:, i, None])[None]   # (1, N, T)
        t0 = first_seen[i]
        if t0 < t:                                                                    # only the tail differs
            s[..., t0:].masked_fill_(~vis[:, None, :, t0:], float("-inf"))
        a = torch.softmax(s, dim=-1).mean(1)                                          # (G, N, T) float32
        m = max_pool_next(a.reshape(G * n, t), st0.pool).view(G, n, t)               # pooled per query
        adds["acc"].append(m.sum(1))                                                  # (G, T)
        adds["ema_in"].append((wts[:, None] * m).sum(1))
        adds["count"].append(vis[0].sum(0).float().expand(G, t))
        adds["low"].append(below_counts(a, vis) if st0.below else None)
    uniform = len({int(x.shape[1]) for x in adds["acc"]}) == 1
    for g, c in enumerate(group):                                                     # (L, T) matrices or lists
        c._stats.fold(n, {name: None if v[0] is None else torch.stack(v, 1)[g] if uniform else [x[g] for x in v]
                          for name, v in adds.items()})
        c._stats.pending = []
