"""Batch K/V buffers: per layer one buffer ``(B, H_kv, capacity, D)``, row ``b`` a cache of its own.

A :class:`Bank` holds, per layer, one preallocated buffer ``(B, H_kv, capacity, D)`` (keys
post-RoPE). Row ``b`` of layer ``i`` is a :class:`RowLayer`: a :class:`~.storage.BufferLayer` whose
buffer is the view ``bank.k[i][b:b+1]`` ``(1, H_kv, capacity, D)``. A row's
:class:`~kvlab.cache.KVCache` (:meth:`Bank.row_cache`) is therefore an ordinary batch-1 cache — its
own ledger, live maps, attention statistics, per-layer lengths and start column — and every edit
the cache knows (append, eviction with in-place compaction, refresh splices, INT8 demotion,
re-rotation) works on it unchanged, in place, inside the shared buffer. Only growth is shared: a
row that runs out of columns grows the whole layer (all rows; capacity doubles, so amortized).

The batched forward (:func:`kvlab.cache.batch.forward_rows`) runs over the bank's first ``width``
slots. When rows finish, :meth:`Bank.swap` moves a live row into a finished row's slot (each row's
content and :class:`RowLayer` objects move together, so every cache stays intact) and ``width``
shrinks: finished rows cost the forward nothing.

A deferred step's attention statistics (:class:`~kvlab.cache.deferred.ColumnSink`) wait in per-column sums the bank
keeps beside the buffers (:attr:`Bank.cols`, ``(B, capacity)`` per layer): they grow and swap with the buffers, and
every move of a row's entries (to the front, a compaction, an in-place keep) moves them along (:meth:`Bank.move_cols`).
"""
from __future__ import annotations

import torch

from kvlab.cache.buffer import keep_plan
from kvlab.cache.storage import MIN_CAPACITY, BufferLayer, KVStore


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
        self.width = batch          # slots [0, width) take part in a batched forward (see swap)
        # deferred attention statistics per bank column (kvlab.cache.deferred.ColumnSink), made on first use:
        # name -> per layer (B, capacity) float32; zero wherever no row has deferred steps pending
        self.cols: dict[str, list[torch.Tensor]] = {}
        self._blocks: dict[str, torch.Tensor] = {}   # name -> (L, B, capacity) whose layers ARE cols[name] (col_block)
        self.summed = [False] * batch   # row b's column sums may be nonzero (a sink added since they were zeroed)
        # column moves of filling evictions (buffer.fill_layers) not yet done: (row, layer, src, dst) per move; done
        # together, one op per layer and K/V, by flush_moves() before anything reads or edits the buffers
        self.moves: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._slots = None          # slot_offsets' (orders it was built from, width, (L, B, width) offsets)
        self._cols = None           # slot_columns' (extra, starts, lows, columns) for the current _slots

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
        self.flush_moves()
        old = self.capacity(i)
        if capacity <= old:
            return
        cap = max(capacity, 2 * old)
        for bufs in (self.k, self.v):
            b, h, _, d = bufs[i].shape
            new = torch.zeros(b, h, cap, d, dtype=self.dtype, device=self.device)              # (B, H_kv, cap', D)
            new[:, :, :old] = bufs[i]
            bufs[i] = new
        for ts in self.cols.values():
            new = self._zeros(ts[i].shape[0], cap)                                                 # (B, cap')
            new[:, :old] = ts[i]
            ts[i] = new
        self._blocks.clear()            # layer i left the blocks (col_block makes them again once capacities agree)
        for row in self.rows:
            row[i].bind()

    def column_stats(self, names) -> dict[str, list[torch.Tensor]]:
        """The per-column statistics ``names`` (each per layer ``(B, capacity)`` float32, zeros when new)."""
        for name in names:
            if name not in self.cols:
                self.cols[name] = [self._zeros(self.batch, self.capacity(i)) for i in range(self.num_layers)]
        return self.cols

    def col_block(self, name: str) -> torch.Tensor | None:
        """Every layer's column statistic ``name`` as one ``(L, B, capacity)`` tensor whose layers are
        ``cols[name]``'s tensors (views: an edit of either is an edit of both), so a step adds all layers at once;
        None when the layers' capacities differ. Made on first use and after a layer grew (one copy)."""
        block = self._blocks.get(name)
        if block is None:
            ts = self.cols[name]
            if len({int(t.shape[1]) for t in ts}) != 1:
                return None
            with torch.inference_mode(False):
                block = torch.stack(ts)                                                    # (L, B, capacity)
            ts[:] = list(block.unbind(0))
            self._blocks[name] = block
        return block

    def slot_offsets(self, width: int) -> torch.Tensor:
        """``(L, rows, width)`` long: per layer and row of the forward's slots, the column of each of its first
        ``width`` slots as an offset from the row's start (:attr:`~.buffer.BufferLayer.order` where a filling
        eviction permuted the row, the identity past it and on unpermuted rows). Kept while no row layer's order
        changes (orders are replaced, never edited in place): a step of rows asked every few steps rebuilds it once
        per ask."""
        orders = [lay.order for row in self.rows[:self.width] for lay in row]
        got = self._slots
        if got is not None and got[1] >= width and len(got[0]) == len(orders) and \
                all(a is b for a, b in zip(got[0], orders)):
            return got[2][..., :width]
        self._cols = None
        L, B, w = self.num_layers, self.width, width + 64
        out = torch.arange(w).repeat(L, B, 1)                                            # (L, B, w) identity
        for b, row in enumerate(self.rows[:B]):
            for i, lay in enumerate(row):
                if lay.order is not None:
                    k = min(int(lay.order.numel()), w)
                    out[i, b, :k] = lay.order[:k]
        self._slots = (orders, w, out.to(self.device))
        return self._slots[2][..., :width]

    def slot_columns(self, width: int, starts: torch.Tensor, lows: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """``(L, rows, w + extra)`` long, ``w >= width``: per layer and row, the column of each slot counted from the
        layer's first column read (``starts`` ``(L, rows)`` the rows' first columns, ``lows`` ``(L,)`` the layers'),
        as :meth:`slot_offsets` gives them; ``w`` (one past the columns, where a reader keeps a zero) for every column
        at or past ``w`` and for the ``extra`` slots appended (a pool's window past the end). Kept while the offsets,
        ``starts`` and ``lows`` stay (a step of rows asked every few steps builds it once per ask)."""
        self.slot_offsets(width)                               # (re)builds _slots; a rebuild drops _cols
        got, w = self._cols, self._slots[1]
        if got is not None and got[0] == extra and torch.equal(got[1], starts) and torch.equal(got[2], lows):
            return got[3]
        cols = (self._slots[2] + (starts - lows[:, None])[..., None]).clamp_(max=w)       # (L, rows, w)
        cols = torch.nn.functional.pad(cols, (0, extra), value=w)
        self._cols = (extra, starts.clone(), lows.clone(), cols)
        return cols

    def _zeros(self, *shape) -> torch.Tensor:
        """A float32 zeros tensor that edits in place in and out of inference mode (a batched step makes it)."""
        with torch.inference_mode(False):
            return torch.zeros(*shape, dtype=torch.float32, device=self.device)

    def move_cols(self, b: int, i: int, src: torch.Tensor, dst: int) -> None:
        """Row ``b``'s per-column statistics of layer ``i`` follow its entries: columns ``src`` (in order) move to
        ``dst, dst + 1, …``; every other column of the row is zero afterwards (nothing is kept for dead columns).
        Nothing to move when the row's sums are all zero (:attr:`summed`: an edit right after a fold)."""
        if not self.summed[b]:
            return
        for ts in self.cols.values():
            row = ts[i][b]                                                                  # (capacity,)
            vals = row.index_select(0, src.to(row.device))
            row.zero_()
            row[dst:dst + vals.shape[0]] = vals

    def move_cols_to(self, b: int, i: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row ``b``'s per-column statistics of layer ``i`` at columns ``src`` move to columns ``dst`` (distinct
        from them); nothing to move when the row's sums are all zero (:attr:`summed`)."""
        if not self.summed[b] or not self.cols:
            return
        s, d = src.to(self.device), dst.to(self.device)
        for ts in self.cols.values():
            row = ts[i][b]                                                                  # (capacity,)
            row.index_copy_(0, d, row.index_select(0, s))

    def zero_cols(self, b: int, i: int, lo: int, hi: int) -> None:
        """Row ``b``'s per-column statistics of layer ``i`` at columns ``[lo, hi)`` to zero (past the row's end)."""
        if self.summed[b]:
            for ts in self.cols.values():
                ts[i][b, lo:hi].zero_()

    def flush_moves(self) -> None:
        """Do the queued column moves (:attr:`moves`): per layer, every row's moves as one gather and one scatter
        of K and of V over the layer's ``(B·H_kv·capacity, D)`` rows."""
        if not self.moves:
            return
        q, self.moves = self.moves, []
        L = self.num_layers
        lid = torch.cat([x for _, x, _, _ in q])                                      # (N,) each move's layer
        row = torch.cat([torch.full((int(x.numel()),), r, dtype=torch.long) for r, _, x, _ in q])
        src, dst = torch.cat([x for _, _, x, _ in q]), torch.cat([y for _, _, _, y in q])
        order = torch.sort(lid, stable=True).indices                                  # layer by layer, queue order
        lid, row, src, dst = lid[order], row[order], src[order], dst[order]
        per = torch.bincount(lid, minlength=L).tolist()
        h = int(self.k[0].shape[1])
        caps = torch.tensor([self.capacity(i) for i in range(L)])[lid][:, None]      # (N, 1)
        heads = (row * h)[:, None] + torch.arange(h)                                 # (N, H_kv) rows of (B·H_kv)
        fs = (heads * caps + src[:, None]).reshape(-1).to(self.device)               # (N·H_kv,) flat source rows
        fd = (heads * caps + dst[:, None]).reshape(-1).to(self.device)
        at = 0
        for i, c in enumerate(per):
            if c:
                a, b = fs[at * h:(at + c) * h], fd[at * h:(at + c) * h]
                for t in (self.k[i], self.v[i]):                                     # (B, H_kv, cap, D)
                    with torch.inference_mode(t.is_inference()):
                        flat = t.view(-1, t.shape[-1])                               # (B·H_kv·cap, D)
                        flat.index_copy_(0, b, flat.index_select(0, a))
            at += c

    def compact_rows(self, lays) -> None:
        """Close the holes of several row layers of this bank at once (each a :class:`RowLayer` with holes, in slot
        order): per row layer the cheaper side of the holes moves (:func:`~.buffer.keep_plan`, as
        :meth:`~.buffer.BufferLayer.keep` would), queued as column moves and done by :meth:`flush_moves` (per layer
        one gather and one scatter of K and of V over every row), then per layer one gather and scatter of each
        per-column statistic (the columns left behind go to zero). The same columns, the same ``s`` and the same
        statistics as one :meth:`~.buffer.BufferLayer.compact` per row layer, in a few ops per layer instead of a
        dozen per row layer."""
        self.flush_moves()                      # earlier moves first: one layer's queued moves are one gather
        stats: dict[int, list] = {}             # per layer: the statistics' moves of rows whose sums may be nonzero
        plans: dict[tuple, tuple] = {}          # per hole pattern (rows and layers evicting alike share one)
        kv: dict[int, list] = {}                # per row: its layers' K/V moves, queued as one entry
        for lay in lays:
            s, p, n = lay.s, lay.p, lay.n
            key = (p, tuple(lay.holes))
            if key not in plans:
                live = lay.live_offsets()                                                   # (n,) offsets in [0, p)
                down, up = keep_plan(live, p)
                if up < down:   # the entries before the last hole move up next to the unmoved tail
                    plans[key] = (live[:up], torch.arange(p - n, p - n + up), p - n, torch.arange(0, p - n))
                else:           # the entries after the first hole move down
                    first = n - down
                    plans[key] = (live[first:], torch.arange(first, n), 0, torch.arange(n, p))
            src, dst, shift, gone = plans[key]                                              # offsets from s
            src, dst = src + s, dst + s                                                     # bank columns
            kv.setdefault(lay.row, []).append((lay.layer, src, dst))
            if self.summed[lay.row] and self.cols:
                stats.setdefault(lay.layer, []).append((lay.row, src, dst, gone + s))
            lay.s, lay.holes = s + shift, []
            lay._views()
        for r, moves in kv.items():
            sizes = torch.tensor([int(a.numel()) for _, a, _ in moves])
            self.moves.append((r, torch.tensor([i for i, _, _ in moves]).repeat_interleave(sizes),
                               torch.cat([a for _, a, _ in moves]), torch.cat([b for _, _, b in moves])))
        self.flush_moves()
        for i, moves in stats.items():          # the statistics follow; the columns left behind: zero
            cap = self.capacity(i)
            cs = torch.cat([r * cap + a for r, a, _, _ in moves]).to(self.device)         # flat (B·cap) columns
            cd = torch.cat([r * cap + b for r, _, b, _ in moves]).to(self.device)
            cz = torch.cat([r * cap + g for r, _, _, g in moves]).to(self.device)
            for ts in self.cols.values():
                flat = ts[i].view(-1)                                                      # (B·cap,)
                flat.index_copy_(0, cd, flat.index_select(0, cs))
                flat.index_fill_(0, cz, 0.0)

    _dead = None

    def dead_index(self, dead: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(layer, row, column)`` long tensors of every hole in ``dead`` (``(i, b, holes, s)`` per row layer with
        holes: its :attr:`~.buffer.BufferLayer.holes` list, replaced at each edit and never edited in place, and its
        start), rebuilt only when one of them changed: a batched step between evictions masks the same holes. One
        conversion for all row layers (a policy asked at every step changes every layer's holes at every step)."""
        got = self._dead
        if got is None or len(got[0]) != len(dead) or any(
                x[0] != y[0] or x[1] != y[1] or x[2] is not y[2] or x[3] != y[3] for x, y in zip(got[0], dead)):
            sizes = torch.tensor([len(h) for _, _, h, _ in dead])
            cols = torch.tensor([o for _, _, h, _ in dead for o in h], dtype=torch.long) + \
                torch.tensor([s for _, _, _, s in dead], dtype=torch.long).repeat_interleave(sizes)
            idx = (torch.tensor([i for i, _, _, _ in dead]).repeat_interleave(sizes).to(self.device),
                   torch.tensor([b for _, b, _, _ in dead]).repeat_interleave(sizes).to(self.device),
                   cols.to(self.device))
            self._dead = got = (list(dead), idx)
        return got[1]

    def clear_cols(self, b: int, i: int | None = None) -> None:
        """Zero row ``b``'s per-column statistics (of layer ``i``; None: every layer)."""
        for ts in self.cols.values():
            for t in (ts if i is None else [ts[i]]):
                t[b].zero_()
        if i is None:
            self.summed[b] = False

    def row_cache(self, b: int):
        """A new, empty :class:`~kvlab.cache.KVCache` over row ``b`` (its layers reset to length 0)."""
        from kvlab.cache.kvcache import KVCache

        self._check_row(b)
        for lay in self.rows[b]:
            lay.s = lay.n = 0
            lay.holes, lay.order = [], None
            lay.bind()
        self.clear_cols(b)
        return KVCache(hf=KVStore(list(self.rows[b])))

    def adopt(self, b: int, src):
        """Row ``b`` as a copy of the cache ``src`` (tensors copied once into the row; ledger, live maps
        and statistics copied): the overfill student's ``C_0``."""
        if src.n_int8:
            raise ValueError("adopt copies full-precision caches only (src holds INT8 entries)")
        src._settle()                       # its deferred statistics folded in (they may live in a bank's columns)
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

    @torch.no_grad()
    def swap(self, a: int, b: int) -> None:
        """Exchange slots ``a`` and ``b``: every layer's data and the two rows' :class:`RowLayer` objects, so
        each row's cache keeps its content and now lives in the other slot (``rows[a]`` is the old
        ``rows[b]``). Copies two rows' buffers; used when a finished row leaves the batched forward."""
        self._check_row(a)
        self._check_row(b)
        if a == b:
            return
        self.flush_moves()
        for bufs in (self.k, self.v, *self.cols.values()):
            for t in bufs:                                                                 # (B, H_kv, cap, D)
                tmp = t[a].clone()                                                         # (H_kv, cap, D)
                t[a].copy_(t[b])
                t[b].copy_(tmp)
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]
        self.summed[a], self.summed[b] = self.summed[b], self.summed[a]
        for r in (a, b):
            for lay in self.rows[r]:
                lay.row = r
                lay.bind()

    def set_width(self, width: int) -> None:
        """Batched forwards run over slots ``[0, width)`` (rows past it have finished)."""
        if isinstance(width, bool) or not isinstance(width, int) or not 1 <= width <= self.batch:
            raise ValueError(f"width={width!r} must be an int in [1, {self.batch}]")
        self.width = width

    def _check_row(self, b: int) -> None:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch:
            raise ValueError(f"row={b!r} must be an int in [0, {self.batch})")

    def nbytes(self) -> int:
        return sum(2 * t.numel() * t.element_size() for t in self.k)


class RowLayer(BufferLayer):
    """Row ``row`` of layer ``layer`` of a :class:`Bank`: a BufferLayer over the view ``bank.k[layer][row:row+1]``.
    Growth goes through the bank (the whole layer grows); everything else is BufferLayer's, in place. Evictions
    leave holes (``lazy``): the batched forward masks them and the row compacts once they pass ``compact_at()``.
    """

    lazy = True

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

    def _to_front(self) -> None:
        s, p = self.s, self.p
        super()._to_front()
        if s and self.bank.cols:                                    # the per-column statistics move along
            self.bank.move_cols(self.row, self.layer, torch.arange(s, s + p), 0)

    def _touch(self) -> None:
        if self.bank.moves:
            self.bank.flush_moves()

    def _queued(self) -> bool:
        return any(r == self.row for r, _, _, _ in self.bank.moves)

    @staticmethod
    def _move_layers(lays, counts: list[int], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Queued in the bank (:meth:`Bank.flush_moves`: every row's moves of an asked step in one op per layer);
        the column statistics, when the row has any, move now."""
        bank, row = lays[0].bank, lays[0].row
        if bank.summed[row] and bank.cols:
            for lay, a, b in zip(lays, src.split(counts), dst.split(counts)):
                if a.numel():
                    bank.move_cols_to(row, lay.layer, a, b)
        layer = torch.repeat_interleave(torch.tensor([lay.layer for lay in lays]), torch.tensor(counts))   # (N,)
        bank.moves.append((row, layer, src, dst))

    def _cut(self, lo: int, hi: int) -> None:
        self.bank.zero_cols(self.row, self.layer, lo, hi)

    def _reorder(self, src: torch.Tensor) -> None:
        super()._reorder(src)
        if self.bank.cols:
            self.bank.move_cols(self.row, self.layer, src, self.s)

    def keep(self, idx: torch.Tensor, plan: tuple[int, int] | None = None) -> None:
        if self.sparse:
            self.compact()                                          # (calls keep without holes)
            plan = None
        s = self.s
        super().keep(idx, plan)
        if self.bank.cols:                                          # kept entries' columns, in order, from s on
            self.bank.move_cols(self.row, self.layer, idx + s, self.s)

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
        self.s, self.n, self.holes, self.order = 0, t, [], None
        self.bank.clear_cols(self.row, self.layer)
        self._views()
