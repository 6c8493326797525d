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

Rows of a :class:`~kvlab.cache.bank.Bank` whose step all defer (no row measuring beside them, one token each, one
statistics setting, no INT8 entries: :func:`columns_ok`) keep no queries: the step's attention is computed once,
eagerly, and :class:`ColumnSink` adds each layer's head-mean probabilities into sums the bank keeps per column
(``acc``, the β-weighted ``ema`` sum, and ``high``: the steps that gave the entry at least the uniform share),
which the bank moves with the row's entries; the read folds the row's live columns in (``count`` from the lengths
each step saw, ``low = count - high``). Nothing is replayed at the read: the ``N`` queries' ``Q·Kᵀ`` and softmax
were the steps' own.
"""
from __future__ import annotations

import torch

from kvlab.cache.mass import below_counts
from kvlab.cache.stats import max_pool_next

KWARG = "kvlab_queries"
# Whether a batched step defers a policy's statistics to its asked step, per device type (False: it measures every
# step, one pass: :mod:`.mass`, each row's mass folded into its statistics at every step). Deferring with queries
# moves the steps' Q·Kᵀ to the asked step and batches it (compute the CPU pays in full at the read); deferring in
# bank columns (ColumnSink) computes each step's attention once and folds only at the read. The earlier A/B of
# queries vs each step (2-core CPU, batch 8, 4,096 -> ~1,030 entries, asked every 16 steps; docs/measured/defer_cpu):
# evicting / plain H2O 1.130, 1.136 deferred vs 1.131, 1.088 each step; Scissorhands 1.167, 1.171 vs 1.220, 1.225.
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


class ColumnSink:
    """A deferred one-token step of bank rows whose statistics add up per bank column (:data:`COLUMNS`): the
    ``"kvlab"`` attention function computes the step's attention eagerly (it is the :class:`~kvlab.cache.mass.MassSink`
    of :func:`kvlab.cache.mass.decode_attention`) and this sink adds each layer's head-mean probabilities ``a``
    ``(B, W_i)`` (columns ``lows[i] …``) into the bank's column statistics of the deferring rows: ``acc += a``,
    ``ema ← β·ema + a`` (after ``N`` steps ``Σ_j β^(N-1-j) a_j``) and, when ``below``, ``high += [a >= 1/T]``
    (``T``: the columns the row sees; ``seen``, ``(L, B, 1)``).
    ``rows``: bool ``(B,)``, the rows that defer (None: all). ``pool > 1``: each step's ``a`` is max-pooled over the
    entry and the next ``pool - 1`` entries (the rows' holes are compacted before such a step; masked columns give 0,
    so a row's end cuts the window as the dense pool does); ``slots`` ``(L, B, w + pool - 1)`` long, when some row's
    columns are permuted (a filling eviction, :attr:`~kvlab.cache.buffer.BufferLayer.order`): each row's slot ``j``'s
    column from the layer's first column read, ``w`` (>= the columns read) for none
    (:meth:`~kvlab.cache.bank.Bank.slot_columns`), so the pool runs in slot order. The fold happens at the rows'
    next read or edit (:func:`settle_rows`); the bank moves a row's columns with its entries
    (:meth:`~kvlab.cache.bank.Bank.move_cols`)."""

    def __init__(self, bank, lows: list[int], decay: float, below: bool, rows: torch.Tensor | None = None,
                 pool: int = 1, seen: torch.Tensor | None = None, spare: list[int] | None = None,
                 slots: torch.Tensor | None = None):
        self.slots = slots if pool > 1 else None       # (L, B, w + pool - 1) slot -> column, permuted pooled rows
        self.names = COLUMNS if below else COLUMNS[:2]                # the statistics this sink adds to
        self.bank, self.cols = bank, bank.column_stats(self.names)
        self.lows, self.below, self.pool = lows, below, pool
        self.spare = spare or [0] * len(lows)       # per layer: masked columns read past the last used one
        if below and seen is None:
            raise ValueError("ColumnSink(below=True) needs seen: each layer's and row's visible columns, (L, B, 1)")
        self.thr = None if seen is None else 1.0 / seen.to(torch.float32)             # (L, B, 1) uniform share
        self.wants_vis = False                     # the below counts compare with ``thr``: no visibility per layer
        self.got: dict[int, torch.Tensor] = {}      # layer -> (B, W_i) the step's head-mean probabilities
        self.rows = rows                                                                       # (B,) bool or None
        self.keep = None if rows is None else rows.to(torch.float32)[:, None]                 # (B, 1)
        self.fac = decay if rows is None else torch.where(rows, float(decay), 1.0)[:, None]   # (B, 1): others stay

    def take(self, layer: int, a: torch.Tensor, vis: torch.Tensor | None) -> None:
        """Layer ``layer``'s head-mean probabilities ``a`` ``(B, 1, W_i)``, kept until :meth:`apply` (a forward that
        fails adds nothing). Below counts are kept as their complement, ``high += [a >= 1/T]``: a column the row
        does not see has ``a = 0`` and never counts, so no visibility mask is read; the fold takes
        ``low = count - high`` (``count``: the steps that saw the entry)."""
        self.got[layer] = a[:, 0]                                                             # (B, W_i)

    def _pooled(self, a: torch.Tensor, spare: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The step's ``a`` ``(..., W)`` max-pooled over each column and the next ``pool - 1`` (no holes: see the
        class docstring); when the pool's window past the last used column is read (``spare`` masked columns,
        ``a = 0``) the last ``pool - 1`` columns are left out, else the window is cut at the end. ``slots``
        (``(..., w' + pool - 1)`` long, ``w' >= W``; ``w'`` for none): the columns in each row's slot order; the pool
        then runs over the entries in that order and lands on their columns (``a >= 0``: a window cut at the row's
        end, or reading its masked columns or zeros, gives the same maxima; columns no slot maps to get 0)."""
        if self.pool <= 1:
            return a
        if slots is not None:
            w, n = a.shape[-1], slots.shape[-1]
            wc = n - (self.pool - 1)
            ap = torch.nn.functional.pad(a, (0, wc + 1 - w))                                  # (..., B, w' + 1)
            x = torch.nn.functional.max_pool1d(ap.gather(-1, slots).view(-1, 1, n), self.pool, stride=1)
            x = x.view(*slots.shape[:-1], wc)                                                 # in slot order
            return torch.zeros_like(ap).scatter_(-1, slots[..., :wc], x)[..., :w]             # back on the columns
        flat = a.reshape(-1, a.shape[-1])                                                     # (rows, W)
        if self.pool <= spare + 1:
            x = torch.nn.functional.max_pool1d(flat[:, None], self.pool, stride=1)[:, 0]      # (rows, W - pool + 1)
        else:
            x = max_pool_next(flat, self.pool)                                                # (rows, W)
        return x.view(*a.shape[:-1], x.shape[-1])

    def _add(self, cols: dict, a: torch.Tensor, thr: torch.Tensor | None, spare: int,
             slots: torch.Tensor | None = None) -> None:
        """Add one step's ``a`` ``(..., B, W)`` (a layer's, or every layer's stacked) into ``cols`` (the matching
        views of the statistics) and, when ``below``, ``[a >= thr]`` (unpooled) into ``high``."""
        b = a.shape[-2]
        x = self._pooled(a, spare, slots)
        high = None
        if self.below:              # (…, B, W) float 0/1, unpooled: a float out (a bool added to the float sums casts
            high = torch.ge(a, thr, out=torch.empty_like(a))                          # element by element, slower)
        if self.keep is not None:
            x = x * self.keep
            if high is not None:
                high.mul_(self.keep)
        w = x.shape[-1]
        cols["acc"][..., :b, :w].add_(x)
        cols["ema"][..., :b, :w].mul_(self.fac).add_(x)
        if high is not None:                                                                  # (its own width)
            cols["high"][..., :b, :high.shape[-1]].add_(high)

    def apply(self, layers: int) -> None:
        """Add every layer's step into the bank's columns (after the forward succeeded). Layers of one width add
        together through the bank's ``(L, B, capacity)`` blocks (:meth:`~kvlab.cache.bank.Bank.col_block`), one
        group per first column read (a run of layers through a view, others gathered and put back); else one layer
        at a time. The same numbers either way (the same elementwise operations)."""
        if len(self.got) != layers:
            raise RuntimeError(f"attention reached {len(self.got)} of {layers} layers: the model does not run the "
                               "'kvlab' attention function on every layer")
        got = [self.got[i] for i in range(layers)]
        w = int(got[0].shape[-1])
        blocks = {name: self.bank.col_block(name) for name in self.names} \
            if all(int(a.shape[-1]) == w for a in got) and len({1 < self.pool <= sp + 1 for sp in self.spare}) == 1 \
            else {}
        if blocks and all(v is not None for v in blocks.values()):
            groups: dict[int, list[int]] = {}
            for i, lo in enumerate(self.lows):
                groups.setdefault(lo, []).append(i)
            for lo, group in groups.items():
                self._add_layers({k: v[:, :, lo:lo + w] for k, v in blocks.items()}, group, got)
            return
        for i, a in enumerate(got):
            lo = self.lows[i]
            self._add({name: self.cols[name][i][:, lo:lo + int(a.shape[-1])] for name in self.names}, a,
                      None if self.thr is None else self.thr[i], self.spare[i],
                      None if self.slots is None else self.slots[i])

    def _add_layers(self, cols: dict, group: list[int], got: list) -> None:
        """:meth:`_add` for the layers ``group`` at once (``cols``: ``(L, B, W)`` views at their columns)."""
        x = torch.stack([got[i] for i in group])                                              # (G, B, W)
        i0, i1 = group[0], group[-1] + 1
        if group == list(range(i0, i1)):                                                      # a run: views
            self._add({k: v[i0:i1] for k, v in cols.items()}, x, None if self.thr is None else self.thr[i0:i1],
                      self.spare[i0], None if self.slots is None else self.slots[i0:i1])
            return
        idx = torch.tensor(group, dtype=torch.long, device=x.device)
        parts = {k: v.index_select(0, idx) for k, v in cols.items()}                          # (G, B, W) copies
        self._add(parts, x, None if self.thr is None else self.thr.index_select(0, idx), self.spare[i0],
                  None if self.slots is None else self.slots.index_select(0, idx))
        for k, v in cols.items():
            v.index_copy_(0, idx, parts[k])


COLUMNS = ("acc", "ema", "high")


def columns_ok(caches) -> bool:
    """Whether these deferring rows can keep their statistics in bank columns (:class:`ColumnSink`): one statistics
    setting (decay, below, pool) and no INT8 entries (their columns are rebuilt at every forward). Pooling rows
    (``pool > 1``: a max-pool over live neighbours) step with their holes compacted
    (:func:`kvlab.cache.batch.forward_rows`) and pool in slot order where a filling eviction permuted them."""
    sts = [c._stats for c in caches]
    return len({(st.ema_decay, st.below, st.pool) for st in sts}) == 1 and not any(c.n_int8 for c in caches)


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
            column = c._stats.pending[0][0] is None
            groups.setdefault((column, _column_key(c) if column else _group_key(c)), []).append(c)
    for (column, _), group in groups.items():
        (_settle_columns if column else _settle_group)(group)


def _column_key(cache) -> tuple:
    """Rows whose column statistics settle together: the same pending steps, settings, bank and per-layer used span
    (start, live entries, holes)."""
    st, lays = cache._stats, cache._store.layers
    return (tuple(tuple(lens) for _, _, lens in st.pending), st.ema_decay, st.below, id(lays[0].bank),
            tuple((lay.s, lay.n, tuple(lay.holes), lay.order is None) for lay in lays))


def _settle_columns(group: list) -> None:
    """Fold the column statistics of ``group``'s rows (:class:`ColumnSink`): per layer one gather of the rows' live
    columns per statistic; ``count`` from the lengths each pending step saw. The rows' columns are zero afterwards."""
    st0 = group[0]._stats
    lays0 = group[0]._store.layers
    bank = lays0[0].bank
    seen_upto = torch.tensor([lens for _, _, lens in st0.pending], dtype=torch.long, device=bank.device)   # (N, L)
    rix = [c._store.layers[0].row for c in group]
    rows = torch.tensor(rix, dtype=torch.long, device=bank.device)                                       # (G,)
    span = rix == list(range(rix[0], rix[0] + len(rix)))                      # consecutive rows: views, no gather
    names = COLUMNS if st0.below else COLUMNS[:2]
    if not _settle_blocks(group, bank, names, seen_upto, rix, rows, span):
        _settle_layers(group, bank, names, seen_upto, rix, rows, span)
    if set(names) == set(bank.cols):                                          # every sum the bank keeps
        for r in rix:
            bank.summed[r] = False


def _settle_blocks(group, bank, names, seen_upto, rix, rows, span) -> bool:
    """:func:`_settle_columns` for every layer at once when the layers hold equally many entries, none has holes
    and the bank keeps each statistic as one block (:meth:`~kvlab.cache.bank.Bank.col_block`): one gather per
    statistic over ``(L, G, T)`` columns, one ``count`` and one zeroing per statistic. False (nothing done)
    otherwise. The same numbers as :func:`_settle_layers` (the same values gathered, the same arithmetic)."""
    lays0 = group[0]._store.layers
    t = lays0[0].n
    if any(lay.n != t or lay.holes for lay in lays0):
        return False
    blocks = {name: bank.col_block(name) for name in names}
    if any(b is None for b in blocks.values()):
        return False
    L, G, n, dev = len(lays0), len(group), seen_upto.shape[0], bank.device
    s = torch.tensor([lay.s for lay in lays0], dtype=torch.long, device=dev).view(L, 1, 1)     # (L, 1, 1) starts
    if all(lay.order is None for lay in lays0):                     # dense rows: offsets 0 .. T - 1 on every layer
        at = (torch.arange(t, device=dev).view(1, 1, t) + s).expand(L, G, t)                   # (L, G, T)
    else:                                                           # permuted rows: each row layer its own columns
        at = torch.stack([c._store.layers[i].live_offsets() for i in range(L) for c in group]).to(dev)
        at = at.view(L, G, t) + s                                                              # (L, G, T)
    got = {}
    for name, key in zip(names, ("acc", "ema_in", "low")):
        blk = blocks[name]                                                                     # (L, B, capacity)
        x = blk[:, rix[0]:rix[0] + G] if span else blk.index_select(1, rows)                   # (L, G, capacity)
        got[key] = x.gather(2, at).transpose(0, 1)                                             # (G, L, T)
    # count[l, j] = #{k : j < seen_upto[k, l]} = N - #{k : seen_upto[k, l] <= j}: a histogram of the lengths seen
    hist = torch.zeros(L, t + 1, dtype=torch.long, device=dev)
    hist.scatter_add_(1, seen_upto.clamp(max=t).T.contiguous(), torch.ones(L, n, dtype=torch.long, device=dev))
    count = (n - hist.cumsum(1)[:, :t]).float()                                                # (L, T)
    got["count"] = count.expand(G, L, t)
    got["low"] = count - got["low"] if "low" in got else None        # below uniform: the steps that saw it, less high
    _fold(group, n, got)
    for blk in blocks.values():                                                                # the rows' columns: 0
        blk[:, rix[0]:rix[0] + G].zero_() if span else blk.index_fill_(1, rows, 0.0)
    return True


def _settle_layers(group, bank, names, seen_upto, rix, rows, span) -> None:
    """:func:`_settle_columns` layer by layer: per layer one gather of the rows' live columns per statistic."""
    st0, lays0 = group[0]._stats, group[0]._store.layers
    n = seen_upto.shape[0]
    adds = {"acc": [], "ema_in": [], "count": [], "low": []}                  # "low" gathers high, then count - high
    for i, lay in enumerate(lays0):
        t = lay.n
        at = (lay.live_offsets() + lay.s).to(bank.device) if lay.holes else None          # (T,) live columns
        perm = None                 # permuted rows (BufferLayer.order): each its own columns, one gather per statistic
        if lay.order is not None:
            perm = (torch.stack([c._store.layers[i].live_offsets() for c in group]) + lay.s).to(bank.device)  # (G, T)
        for name, key in zip(names, ("acc", "ema_in", "low")):
            col = bank.cols[name][i]                                                           # (B, capacity)
            x = col[rix[0]:rix[0] + len(rix)] if span else col.index_select(0, rows)           # (G, capacity)
            adds[key].append(x.narrow(1, lay.s, t) if at is None and perm is None else
                             x.index_select(1, at) if perm is None else x.gather(1, perm))   # (G, T)
        vis = torch.arange(t, device=bank.device)[None, :] < seen_upto[:, i, None]             # (N, T)
        count = vis.sum(0).float()                                                             # (T,)
        adds["count"].append(count.expand(len(group), t))
        if st0.below:                                         # below uniform: the steps that saw it, less high
            adds["low"][-1] = count - adds["low"][-1]
        else:
            adds["low"].append(None)
    _fold(group, n, adds)                                                     # (reads the views above first)
    for name in names:                                                        # then the rows' columns: zeros
        for col in bank.cols[name]:
            col[rix[0]:rix[0] + len(rix)].zero_() if span else col.index_fill_(0, rows, 0.0)


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
    _fold(group, n, adds)


def _fold(group: list, n: int, adds: dict) -> None:
    """Each row ``g`` of ``group`` folds ``n`` pending steps: ``adds[name]`` per layer ``(G, T_l)`` (a list), or
    every layer's at once ``(G, L, T)`` (a tensor; None: not kept)."""
    if isinstance(adds["acc"], torch.Tensor):
        mats, uniform = adds, True
    else:
        uniform = len({int(x.shape[1]) for x in adds["acc"]}) == 1
        mats = {name: None if v[0] is None else torch.stack(v, 1) if uniform else v for name, v in adds.items()}
    for g, c in enumerate(group):                                                     # (L, T) matrices or lists
        c._stats.fold(n, {name: None if v is None else v[g] if uniform else [x[g] for x in v]
                          for name, v in mats.items()})
        c._stats.pending = []
