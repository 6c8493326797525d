"""One layer's full-precision K/V buffer (:class:`BufferLayer`) and the plan of an in-place keep
(:func:`keep_plan`); part of :mod:`.storage`, which re-exports both."""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 64


class BufferLayer(DynamicLayer):
    """One layer's FP entries: ``buf_k`` / ``buf_v`` (1, H_kv, capacity, D), the used part being
    buffer columns ``[s, s + n)``; ``keys`` / ``values`` are views of it. Appends write after the used
    part; when the end of the buffer is reached the used part moves back to column 0 (if at most 3/4
    full) or the capacity doubles. Eviction (:meth:`keep`) moves whichever side of the removed
    entries is smaller: the entries after the first removed one move down, or the entries before the
    last removed one move up (and ``s`` grows) — so dropping the oldest non-sink entry of a sliding
    window moves the few sinks, not the whole window."""

    lazy = False        # True (a bank row): drop() leaves holes, compacted when they pass compact_at()
    _order_row = None   # (block, i, order): order was row i of block when fill_layers set it (live_offsets_of)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.n = 0
        self.s = 0
        self.holes: list[int] = []      # dead columns (offsets from s, sorted) inside the used part [s, s + p)
        # None, or the live entries' columns are not in slot order: slot j's entry lies at offset order[j] from s
        # (long, CPU; entries appended since the last eviction at their own slot: the identity, kept past n in order
        # so that the slot -> offset map of n entries is the view order[:n]); a permuted layer holds no holes
        self.order: torch.Tensor | None = None
        self.buf_k = self.buf_v = None

    @property
    def sparse(self) -> bool:
        """The live entries are not the dense, ordered columns ``[s, s + n)`` (holes or a permuted order): a read
        of ``keys`` / ``values`` or an edit in slot order compacts first."""
        return bool(self.holes) or self.order is not None

    @property
    def p(self) -> int:
        """Columns the used part spans: the ``n`` live entries plus the holes among them."""
        return self.n + len(self.holes)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "BufferLayer":
        lay = cls()
        lay.assign(k, v)
        return lay

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self._alloc(key_states, max(MIN_CAPACITY, 2 * key_states.shape[-2]))
        self.is_initialized = True

    def _alloc(self, like: torch.Tensor, capacity: int) -> None:
        b, h, _, d = like.shape
        k = torch.empty(b, h, capacity, d, dtype=like.dtype, device=like.device)     # (1, H_kv, cap, D)
        v = torch.empty_like(k)
        if self.buf_k is not None and self.n:
            k[:, :, :self.n] = self.keys
            v[:, :, :self.n] = self.values
        self.buf_k, self.buf_v, self.s = k, v, 0
        self._views()

    _stale = False      # keys / values need rebuilding from (buf, s, n)

    def _views(self) -> None:
        """``s`` / ``n`` / the buffers changed: ``keys`` / ``values`` are rebuilt when next read (a batched
        step changes every row and layer's ``n`` but reads few of them in Python)."""
        self._stale = True

    def _fresh(self) -> None:
        self._touch()
        if self.sparse:
            self.compact()
        self._keys = self.buf_k.narrow(2, self.s, self.n)          # the used part [s, s + n)
        self._values = self.buf_v.narrow(2, self.s, self.n)
        self._stale = False

    @property
    def keys(self) -> torch.Tensor | None:
        if self._stale:
            self._fresh()
        return self._keys

    @keys.setter
    def keys(self, t) -> None:          # DynamicLayer.__init__ sets None; nothing else assigns it
        self._keys = t

    @property
    def values(self) -> torch.Tensor | None:
        if self._stale:
            self._fresh()
        return self._values

    @values.setter
    def values(self, t) -> None:
        self._values = t

    @property
    def capacity(self) -> int:
        return 0 if self.buf_k is None else int(self.buf_k.shape[2])

    def _to_front(self) -> None:
        """Move the used part to buffer column 0 (in place)."""
        self._touch()
        if self.s:
            n, s = self.p, self.s
            src_k, src_v = self.buf_k[:, :, s:s + n], self.buf_v[:, :, s:s + n]
            if s < n:                                             # overlapping ranges: copy via a temporary
                src_k, src_v = src_k.clone(), src_v.clone()
            self.buf_k[:, :, :n] = src_k
            self.buf_v[:, :, :n] = src_v
            self.s = 0
            self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``key_states`` / ``value_states`` (1, H_kv, m, D); returns the used views."""
        self._touch()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.sparse:
            self.compact()
        m = key_states.shape[-2]
        self.reserve(m)
        end = self.s + self.n
        self.buf_k[:, :, end:end + m] = key_states
        self.buf_v[:, :, end:end + m] = value_states
        self.n += m
        self._views()
        return self.keys, self.values

    def reserve(self, m: int) -> None:
        """Make room for ``m`` appends after the used part: move it to the front (if at most 3/4 full
        afterwards) or grow the capacity."""
        p = self.p
        if self.s + p + m > self.capacity:
            if 4 * (p + m) <= 3 * self.capacity:                  # room at the front: at least cap/4 appends away
                self._to_front()
            else:
                self._alloc(self.buf_k, max(2 * self.capacity, p + m))

    def get_seq_length(self) -> int:
        return self.n

    def assign(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Replace the whole content with ``k, v`` (1, H_kv, T, D) (copied into the buffer)."""
        self._touch()
        t = k.shape[-2]
        if not self.is_initialized or t > self.capacity or self.buf_k.dtype != k.dtype:
            self.buf_k = self.buf_v = None
            self.n = 0
            self.dtype, self.device = k.dtype, k.device
            self._alloc(k, max(MIN_CAPACITY, 2 * t))
            self.is_initialized = True
        self.buf_k[:, :, :t] = k
        self.buf_v[:, :, :t] = v
        self.s, self.n, self.holes, self.order = 0, t, [], None
        self._views()

    def drop(self, slots: Sequence[int], fill: bool = False) -> None:
        """Remove the live entries ``slots`` (sorted ints). A :attr:`lazy` layer marks their columns dead
        (``holes``: nothing moves; a batched forward masks them, :mod:`.batch`) and compacts once the holes
        pass :meth:`compact_at`; any other layer, or a read of ``keys`` / ``values``, compacts at once.
        ``fill`` (a lazy layer): no holes are left — the survivors among the last ``len(slots)`` columns move into
        the dead columns before them (at most ``len(slots)`` entries move, :meth:`_fill`), so the used part stays
        dense and the columns leave slot order (:attr:`order`); for rows whose readers do not need neighbouring
        columns to be neighbouring entries (a batched step attends in any column order)."""
        if not slots:
            return
        if self.lazy and fill:
            self._fill(slots)
            return
        if self.order is not None:
            self.compact()
        if not self.lazy:
            gone = set(slots)
            self.keep(torch.tensor([j for j in range(self.n) if j not in gone], dtype=torch.long))
            return
        holes, new, k = self.holes, [], 0
        for j in slots:                                   # live slot j's column: j + the holes before it
            o = j + k
            while k < len(holes) and holes[k] <= o:
                k += 1
                o = j + k
            new.append(o)
        self.holes = sorted(holes + new)                  # a new list (readers key on the old one)
        self.n -= len(slots)
        if len(self.holes) > self.compact_at():
            self.compact()
        else:
            self._views()

    def compact_at(self) -> int:
        """Holes a lazy layer tolerates: about sqrt(2n) — the extra columns a step reads (half of them on average)
        against the entries a compaction moves (spread over the steps that made the holes)."""
        return max(16, int((2 * self.n) ** 0.5))

    def live_offsets(self) -> torch.Tensor:
        """The live entries' columns as offsets from ``s``, in slot order (``(n,)`` long, CPU): the used part's
        ``p`` columns, holes left out (or the permuted :attr:`order`)."""
        if self.order is not None:
            o = self.order
            if o.numel() < self.n:                          # entries appended past the identity tail kept
                self.order = o = torch.cat([o, torch.arange(o.numel(), 2 * self.n)])
            return o[:self.n]
        if not self.holes:
            return torch.arange(self.n)
        alive = torch.ones(self.p, dtype=torch.bool)
        alive[torch.tensor(self.holes, dtype=torch.long)] = False
        return alive.nonzero().squeeze(1)

    def compact(self) -> None:
        """Close the holes: the live entries move together, in order (:meth:`keep` over the used columns); a
        permuted layer's entries move back into slot order."""
        self._touch()
        if self.order is not None:
            self._unpermute()
            return
        if not self.holes:
            return
        live = self.live_offsets()
        self.n, self.holes = self.p, []
        self.keep(live)

    def _fill(self, slots: Sequence[int]) -> None:
        """:meth:`drop` with ``fill`` on this layer alone (:func:`fill_layers` of one layer)."""
        keep = torch.ones(self.n, dtype=torch.bool)
        keep[torch.tensor(list(slots), dtype=torch.long)] = False
        fill_layers([self], keep.nonzero().view(1, -1))                              # (1, m) kept slots

    def _cut(self, lo: int, hi: int) -> None:
        """Columns ``[lo, hi)`` left the used part (a bank row's column statistics there go to zero)."""

    def _touch(self) -> None:
        """Before the buffers are read or edited (a bank row: its bank's queued moves are done first)."""

    def _queued(self) -> bool:
        """Moves of this layer's columns wait (a bank row: in its bank's queue, :meth:`fill_layers`)."""
        return False

    @staticmethod
    def _move_layers(lays, counts: list[int], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Column moves on each layer of one cache: layer ``i`` moves the next ``counts[i]`` columns of the flat
        ``src`` (long, CPU) to those of ``dst`` (distinct from them; a bank row queues them in its bank: every row's
        moves in one op per layer)."""
        for lay, a, b in zip(lays, src.split(counts), dst.split(counts)):
            if a.numel():
                lay._touch()
                a, b = a.to(lay.buf_k.device), b.to(lay.buf_k.device)
                lay.buf_k.index_copy_(2, b, lay.buf_k.index_select(2, a))
                lay.buf_v.index_copy_(2, b, lay.buf_v.index_select(2, a))

    def _unpermute(self) -> None:
        """A permuted layer's entries back into slot order in ``[s, s + n)`` (one gather)."""
        offs = self.live_offsets()
        self.order = None
        if not torch.equal(offs, torch.arange(self.n)):
            src = offs + self.s
            self._reorder(src)
        self._views()

    def _reorder(self, src: torch.Tensor) -> None:
        """Columns ``src`` (long, CPU; ``n`` of them) to ``[s, s + n)`` in that order."""
        self._touch()
        d = src.to(self.buf_k.device)
        with torch.inference_mode(self.buf_k.is_inference()):      # (a buffer made in inference mode edits in it)
            self.buf_k[:, :, self.s:self.s + self.n] = self.buf_k.index_select(2, d)
            self.buf_v[:, :, self.s:self.s + self.n] = self.buf_v.index_select(2, d)

    def keep(self, idx: torch.Tensor, plan: tuple[int, int] | None = None) -> None:
        """Keep the entries ``idx`` (sorted slots, (m,), CPU) in place, in order. ``plan`` =
        :func:`keep_plan` ``(idx, n)`` (computed if None)."""
        self._touch()
        if self.sparse:
            self.compact()
            plan = None
        m = int(idx.numel())
        down, up = keep_plan(idx, self.n) if plan is None else plan
        if up < down:       # the `up` entries before the last removed one move up next to the unmoved tail
            if up:
                src = idx[:up].to(self.buf_k.device) + self.s
                dst = self.s + self.n - m
                self.buf_k[:, :, dst:dst + up] = self.buf_k.index_select(2, src)    # gather, then copy
                self.buf_v[:, :, dst:dst + up] = self.buf_v.index_select(2, src)
            self.s += self.n - m
        elif down:          # the `down` entries after the first removed one move down
            first = m - down
            src = idx[first:].to(self.buf_k.device) + self.s
            self.buf_k[:, :, self.s + first:self.s + m] = self.buf_k.index_select(2, src)
            self.buf_v[:, :, self.s + first:self.s + m] = self.buf_v.index_select(2, src)
        self.n = m
        self._views()

    def truncate(self, n: int) -> None:
        if self.sparse:
            self.compact()
        if n < self.n:
            self.n = n
            self._views()

    def drop_front(self, m: int) -> None:
        """Remove the first ``m`` entries (no copy: the used part starts ``m`` columns later)."""
        if self.sparse:
            self.compact()
        if m:
            self.s += m
            self.n -= m
            self._views()

    def clone_layer(self) -> "BufferLayer":
        self._touch()
        lay = BufferLayer()
        if self.is_initialized:
            lay.dtype, lay.device = self.dtype, self.device
            lay.buf_k, lay.buf_v, lay.n, lay.s = self.buf_k.clone(), self.buf_v.clone(), self.n, self.s
            lay.holes = list(self.holes)
            lay.order = None if self.order is None else self.order.clone()
            lay.is_initialized = True
            lay._views()
        return lay


def keep_plan(idx: torch.Tensor, n: int) -> tuple[int, int]:
    """How many entries each way of keeping slots ``idx`` (sorted, of ``n``) moves: ``(down, up)``.
    ``down``: the kept entries from the first removed slot on; ``up``: the kept entries before the last
    removed slot (the rest stays where it is either way)."""
    m = int(idx.numel())
    gaps = idx - torch.arange(m)            # removed slots before each kept one: nondecreasing, 0 .. n - m
    down = m - int((gaps == 0).sum())
    up = int((gaps < n - m).sum())
    return down, up


def fill_layers(lays: Sequence[BufferLayer], keep: torch.Tensor, per: int | None = None) -> None:
    """:meth:`BufferLayer.drop` with ``fill`` on every layer of one cache at once: ``keep`` ``(L, m)`` the kept slots
    of each layer (sorted), every layer a lazy one holding ``n`` entries. The bookkeeping is one ``(L, m)`` pass;
    each layer then moves its survivors past column ``m`` into its freed columns. ``per``: ``lays`` are the layers of
    several caches (bank rows of one bank, :func:`~kvlab.cache.evict_rows.evict_rows`), ``per`` consecutive ones
    each; None: one cache."""
    per = per or len(lays)
    if any(lays[j]._queued() for j in range(0, len(lays), per)):   # these rows' earlier moves first (a bank queues
        lays[0]._touch()                                            # each row's once)
    for lay in lays:
        if lay.holes:
            lay.compact()
    L, m = keep.shape
    n = lays[0].n
    offs = live_offsets_of(lays, n)                                                  # (L, n) slot -> offset
    kept = offs.gather(1, keep)                                                      # (L, m) survivors' offsets
    gone = torch.ones(L, n, dtype=torch.bool)
    gone.scatter_(1, keep, False)
    freed = offs[gone].view(L, n - m)                                                # (L, n - m) freed offsets
    out = kept >= m                                                                  # (L, m) survivors to move
    counts = out.sum(1).tolist()
    if any(counts):
        free = torch.where(freed < m, freed, n).sort(1).values                      # (L, n - m) those < m first
        s0 = torch.tensor([lay.s for lay in lays])[:, None]                          # (L, 1) each layer's start
        firsts = torch.arange(n - m)[None, :] < torch.tensor(counts)[:, None]        # (L, n - m) the first c_l
        src, dst = (kept + s0)[out], (free + s0)[firsts]                             # layer by layer, flat
        kept = torch.where(out, free.gather(1, (out.cumsum(1) - 1).clamp(min=0)), kept)
        at = 0
        for j in range(0, len(lays), per):                                           # one cache's layers at a time
            c = sum(counts[j:j + per])
            if c:
                lays[j]._move_layers(lays[j:j + per], counts[j:j + per], src[at:at + c], dst[at:at + c])
            at += c
    kept = torch.cat([kept, torch.arange(m, m + _tail(m)).expand(L, -1)], 1)       # (L, m + tail) identity after m
    for i, (lay, order) in enumerate(zip(lays, kept.unbind(0))):   # rows of one block: live_offsets_of reads it whole
        lay._cut(lay.s + m, lay.s + lay.n)
        lay.n = m
        lay.order = order
        lay._order_row = (kept, i, order)
        lay._views()


def live_offsets_of(lays: Sequence[BufferLayer], n: int) -> torch.Tensor:
    """:meth:`BufferLayer.live_offsets` of several layers holding ``n`` entries each, hole-free, as one ``(len, n)``
    long tensor. When their orders are the rows of one block, in order (what :func:`fill_layers` leaves behind: a
    filling eviction at every step reads them at the next step and the next eviction), a view of that block; else
    stacked."""
    got = lays[0]._order_row
    base = got[0] if got is not None else None
    if base is not None and base.shape[0] == len(lays) and base.shape[1] >= n and all(
            (r := lay._order_row) is not None and r[0] is base and r[1] == i and r[2] is lay.order
            for i, lay in enumerate(lays)):
        return base[:, :n]
    if all(lay.order is None and not lay.holes for lay in lays):
        return torch.arange(n).expand(len(lays), n)
    return torch.stack([lay.live_offsets() for lay in lays])


def _tail(m: int) -> int:
    """Identity entries kept past a permuted layer's ``m`` entries (its next appends' slots), before a regrowth."""
    return max(64, m // 4)
