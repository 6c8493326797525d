"""K/V storage with a batch dimension: B sequences decoded in one forward, each row its own cache.

A :class:`Bank` holds, per layer, one preallocated buffer ``(B, H_kv, capacity, D)`` (keys
post-RoPE). Row ``b`` of layer ``i`` is a :class:`RowLayer`: a :class:`~.storage.BufferLayer` whose
buffer is the view ``bank.k[i][b:b+1]`` ``(1, H_kv, capacity, D)``. A row's
:class:`~kvlab.cache.KVCache` (:meth:`Bank.row_cache`) is therefore an ordinary batch-1 cache — its
own ledger, live maps, attention statistics, per-layer lengths and start column — and every edit
the cache knows (append, eviction with in-place compaction, refresh splices, INT8 demotion,
re-rotation) works on it unchanged, in place, inside the shared buffer. Only growth is shared: a
row that runs out of columns grows the whole layer (all rows; capacity doubles, so amortized).

:func:`forward_rows` is the batched decode step: one model forward over all B rows, each row
appending one token at its own position (``position_ids`` ``(B, 1)``). Row ``b``'s new key is
written at its column ``s_b + n_b`` of every layer; the ``"kvlab"`` attention function
(:mod:`.attn_fn`) gets each layer's per-row mask ``(B, 1, 1, W)`` (True on the row's used columns
and its new one; padding and other rows' garbage masked) through the forward's kwargs. Rows with
nothing to do this step (finished, or waiting on a refresh's logits) ride along as dummies: they
write a throwaway column past their used part and see only it; their cache is unchanged. After
the forward each active row commits its column (lengths + 1), ledger row, live maps and attention
mass — or, on any error, no row commits anything. No step copies a cache.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from . import attn_fn
from .attention import QueryCapture
from .storage import MIN_CAPACITY, BufferLayer, KVStore
from kvlab.core.compat import cache_kwarg

MASKS_KWARG = "kvlab_masks"


class Bank:
    """Per-layer batch buffers ``k[i]`` / ``v[i]``, each ``(B, H_kv, capacity_i, D)``, and their row layers."""

    def __init__(self, batch: int, layers: int, kv_heads: int, head_dim: int, *, dtype, device,
                 capacity: int = MIN_CAPACITY):
        for name, v in (("batch", batch), ("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim),
                        ("capacity", capacity)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        self.batch, self.dtype, self.device = batch, dtype, torch.device(device)
        shape = (batch, kv_heads, max(MIN_CAPACITY, capacity), head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]   # (B, H_kv, cap, D)
        self.v = [torch.zeros_like(t) for t in self.k]
        self.rows = [[RowLayer(self, b, i) for i in range(layers)] for b in range(batch)]

    @classmethod
    def for_model(cls, model, batch: int, capacity: int = MIN_CAPACITY) -> "Bank":
        """A bank shaped for ``model``'s KV geometry, dtype and device."""
        cfg = model.config
        heads = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or heads
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        p = next(model.parameters())
        return cls(batch, cfg.num_hidden_layers, hkv, d, dtype=p.dtype, device=p.device, capacity=capacity)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def capacity(self, i: int) -> int:
        return int(self.k[i].shape[2])

    def grow(self, i: int, capacity: int) -> None:
        """Layer ``i``'s buffers to at least ``capacity`` columns (all rows keep their columns)."""
        old = self.capacity(i)
        if capacity <= old:
            return
        cap = max(capacity, 2 * old)
        for bufs in (self.k, self.v):
            b, h, _, d = bufs[i].shape
            new = torch.zeros(b, h, cap, d, dtype=self.dtype, device=self.device)              # (B, H_kv, cap', D)
            new[:, :, :old] = bufs[i]
            bufs[i] = new
        for row in self.rows:
            row[i].bind()

    def row_cache(self, b: int):
        """A new, empty :class:`~kvlab.cache.KVCache` over row ``b`` (its layers reset to length 0)."""
        from .kvcache import KVCache

        self._check_row(b)
        for lay in self.rows[b]:
            lay.s = lay.n = 0
            lay.bind()
        return KVCache(hf=KVStore(list(self.rows[b])))

    def adopt(self, b: int, src):
        """Row ``b`` as a copy of the cache ``src`` (tensors copied once into the row; ledger, live maps
        and statistics copied): the overfill student's ``C_0``."""
        if src.n_int8:
            raise ValueError("adopt copies full-precision caches only (src holds INT8 entries)")
        if src.num_layers != self.num_layers:
            raise ValueError(f"src has {src.num_layers} layers, the bank {self.num_layers}")
        new = self.row_cache(b)
        for i, lay in enumerate(new._store.layers):
            k, v = src._store.full_kv(i)
            lay.assign(k, v)
        new._mirror = src._mirror.copy()
        new._stats = src._stats.copy() if src._stats is not None else None
        new.next_position = src.next_position
        new.check()
        return new

    def owns(self, b: int, cache) -> bool:
        """``cache``'s storage is row ``b`` of this bank (no edit replaced its layers)."""
        lays = cache._store.layers
        return len(lays) == self.num_layers and all(x is y for x, y in zip(lays, self.rows[b]))

    def _check_row(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch:
            raise ValueError(f"row={b!r} must be an int in [0, {self.batch})")

    def nbytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self.k)


class RowLayer(BufferLayer):
    """Row ``row`` of layer ``layer`` of a :class:`Bank`: a BufferLayer over the view ``bank.k[layer][row:row+1]``.
    Growth goes through the bank (the whole layer grows); everything else is BufferLayer's, in place."""

    def __init__(self, bank: Bank, row: int, layer: int):
        super().__init__()
        self.bank, self.row, self.layer = bank, row, layer
        self.dtype, self.device = bank.dtype, bank.device
        self.is_initialized = True
        self.bind()

    def bind(self) -> None:
        r = self.row
        self.buf_k = self.bank.k[self.layer][r:r + 1]                                         # (1, H_kv, cap, D)
        self.buf_v = self.bank.v[self.layer][r:r + 1]
        self._views()

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def _alloc(self, like: torch.Tensor, capacity: int) -> None:
        self.bank.grow(self.layer, capacity)
        self._to_front()

    def assign(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dtype != self.bank.dtype:
            raise ValueError(f"row layer holds {self.bank.dtype}; got {k.dtype}")
        t = k.shape[-2]
        if t > self.capacity:
            self.bank.grow(self.layer, max(MIN_CAPACITY, 2 * t))
        self.buf_k[:, :, :t] = k
        self.buf_v[:, :, :t] = v
        self.s, self.n = 0, t
        self._views()


class _StepLayer(DynamicLayer):
    """One layer of the throwaway cache a batched step runs on: writes row ``b``'s new key at column
    ``cols[b]`` of the bank's buffer and returns the first ``width`` columns (views)."""

    def __init__(self, bank: Bank, i: int, cols: torch.Tensor, width: int):
        super().__init__()
        self.bank, self.i, self.cols, self.width = bank, i, cols, width
        self.rows = torch.arange(bank.batch, device=bank.device)
        self.is_initialized = True
        self.dtype, self.device = bank.dtype, bank.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = self.bank.k[self.i], self.bank.v[self.i]                     # (B, H_kv, cap, D)
        n = key_states.shape[2]
        if n == 1:
            k[self.rows, :, self.cols] = key_states[:, :, 0].to(k.dtype)     # (B, H_kv, D) at (b, cols[b])
            v[self.rows, :, self.cols] = value_states[:, :, 0].to(v.dtype)
        else:
            idx = self.cols[:, None] + torch.arange(n, device=self.cols.device)                  # (B, n)
            k[self.rows[:, None], :, idx] = key_states.transpose(1, 2).to(k.dtype)               # (B, n, H_kv, D)
            v[self.rows[:, None], :, idx] = value_states.transpose(1, 2).to(v.dtype)
        self.keys, self.values = k[:, :, :self.width], v[:, :, :self.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width - 1


class _StepCache(Cache):
    def __init__(self, layers):
        super().__init__(layers=layers)


@torch.inference_mode()
def forward_rows(bank: Bank, model, caches: Sequence, tokens: Sequence, *, writer: str,
                 steps: Sequence[int], attention: Sequence[bool] | None = None) -> torch.Tensor:
    """One batched forward. ``caches[b]`` is row ``b``'s KVCache (from :meth:`Bank.row_cache` /
    :meth:`Bank.adopt`) or None (a dummy row this time); ``tokens[b]`` the token (a decode step) or
    token list (a teacher catching up; rows may differ in length: padded, the padding never
    committed) it appends at its ``next_position`` on; ``steps[b]`` its ledger step.
    ``attention[b]``: measure row ``b``'s attention mass (needs ``track_attention``; rows of the
    longest length only). Returns logits ``(B, V)``: each row's after its last token (dummies'
    are meaningless). All-or-nothing: on error no row's cache changes."""
    B = bank.batch
    if len(caches) != B or len(tokens) != B or len(steps) != B:
        raise ValueError(f"caches, tokens and steps need one entry per row ({B})")
    attention = list(attention) if attention is not None else [False] * B
    active = [b for b in range(B) if caches[b] is not None]
    if not active:
        raise ValueError("forward_rows needs at least one active row")
    seqs: list[list[int] | None] = [None] * B
    for b in active:
        c, t = caches[b], tokens[b]
        if not bank.owns(b, c):
            raise ValueError(f"row {b}: its cache is not row {b} of this bank (an edit replaced its storage)")
        if t is None:
            raise ValueError(f"row {b}: an active row needs a token")
        seqs[b] = [int(t)] if isinstance(t, int) or (isinstance(t, torch.Tensor) and t.dim() == 0) \
            else [int(x) for x in t]                        # a decode step's int: no tensor built per row
        if not seqs[b]:
            raise ValueError(f"row {b}: tokens[{b}] is empty")
    n_max = max(len(seqs[b]) for b in active)
    for b in active:
        if attention[b] and caches[b]._stats is None:
            raise ValueError(f"row {b}: attention=True needs cache.track_attention(ema_decay) first")
        if attention[b] and len(seqs[b]) != n_max:
            raise ValueError(f"row {b}: attention mass needs the row's tokens to fill the batch ({n_max}), got "
                             f"{len(seqs[b])}")
    device = bank.device
    L = bank.num_layers
    materialized = []
    try:
        for b in active:
            caches[b]._store.materialize()
            materialized.append(b)
        cols, starts = [], []                                   # B x L: each row's new column, first column seen
        for b, row in enumerate(bank.rows):                     # one pass: n_max free columns per row and layer
            c_row, s_row = [], []
            for lay in row:
                if lay.s > max(16, lay.n // 4):                 # attention reads columns [0, s + n]: keep rows near
                    lay._to_front()                             # the front (amortized: once per n/4 columns)
                lay.reserve(n_max)                              # (growth keeps every other row's s and n)
                c_row.append(lay.s + lay.n)
                s_row.append(lay.s)
            cols.append(c_row)
            starts.append(s_row if caches[b] is not None else c_row)
        cols_t = torch.tensor(cols, dtype=torch.long, device=device).T                    # (L, B)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device).T                # (L, B)
        widths = (cols_t.max(dim=1).values + n_max).tolist()
        W = max(widths)
        ar = torch.arange(W, device=device)
        last = cols_t[..., None] + torch.arange(n_max, device=device)                     # (L, B, n) query j's column
        masks = (ar >= starts_t[..., None, None]) & (ar <= last[..., None])                # (L, B, n, W)
        step_cache = _StepCache([_StepLayer(bank, i, cols_t[i], widths[i]) for i in range(L)])
        per_layer = [masks[i, :, None, :, :widths[i]] for i in range(L)]                  # (B, 1, n, W_i)
        ids = torch.tensor([(s or [0]) + [0] * (n_max - len(s or [0])) for s in seqs], dtype=torch.long,
                           device=device)                                                 # (B, n)
        nxt = [caches[b].next_position if caches[b] is not None else 0 for b in range(B)]
        pos = torch.tensor(nxt, dtype=torch.long, device=device)[:, None] + torch.arange(n_max, device=device)
        keep = sorted({len(seqs[b]) - 1 for b in active})                                 # logits needed
        attn_fn.use(model)
        kwargs = dict(input_ids=ids, position_ids=pos, **{cache_kwarg(model): step_cache}, use_cache=True,
                      logits_to_keep=1 if n_max == 1 else torch.tensor(keep, device=device),
                      **{MASKS_KWARG: per_layer})
        want = [b for b in active if attention[b]]
        if want:
            with QueryCapture(model) as cap:
                out = model(**kwargs)
        else:
            out = model(**kwargs)
        for b in active:                                        # the new columns join each active row
            for lay in bank.rows[b]:
                lay.n += len(seqs[b])
                lay._views()
        masses = {}
        try:
            if want:                                            # all measured rows at once (QueryCapture.mass_rows)
                settings = {b: (caches[b]._stats.window, caches[b]._stats.below, caches[b]._stats.query_decay)
                            for b in want}
                masses = cap.mass_rows(want, n_max, lambda i, group: _group_keys(bank, i, group),
                                       lambda b, i: bank.rows[b][i].n, settings)
        except BaseException:
            for b in active:
                for lay in bank.rows[b]:
                    lay.n -= len(seqs[b])
                    lay._views()
            raise
    except BaseException:
        for b in materialized:
            caches[b]._store.dematerialize()
        raise
    from .forward import commit_append

    for b in active:
        c = caches[b]
        c._store.dematerialize()
        before = [len(x) for x in c._mirror.lives]
        mass, low, ema_mass = masses.get(b, (None, None, None))
        p0 = c.next_position
        commit_append(c, seqs[b], list(range(p0, p0 + len(seqs[b]))), writer, int(steps[b]), mass, low, before,
                      ema_mass)
    logits = out.logits                                                                   # (B, k, V)
    if n_max == 1:
        return logits[:, -1, :]                                                           # (B, V)
    pick = torch.tensor([keep.index(len(s) - 1) if s else 0 for s in seqs], device=logits.device)
    return logits[torch.arange(B, device=logits.device), pick]                            # (B, V)


def _group_keys(bank: Bank, i: int, group: list[int]) -> torch.Tensor:
    """Layer ``i``'s keys of the rows ``group`` (all the same length ``T``), ``(G, H_kv, T, D)``: a view of
    the bank when they are consecutive rows starting at the same column, else one copy of their views."""
    lays = [bank.rows[b][i] for b in group]
    s, t = lays[0].s, lays[0].n
    if all(lay.s == s for lay in lays) and group == list(range(group[0], group[0] + len(group))):
        return bank.k[i][group[0]:group[0] + len(group), :, s:s + t]                     # (G, H_kv, T, D) view
    return torch.cat([lay.keys for lay in lays])                                          # (G, H_kv, T, D)
