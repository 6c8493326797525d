"""Resident eviction: the rows of a batch evicting at every step, their eviction state held as bank-wide tensors
while they decode. Part of the cache module: it alone edits the rows' tensors while they are resident, and hands the
caches back whole.

The batched loop (:mod:`.batch`, :mod:`.evict_rows`) keeps every row's state in Python per row and layer: live maps,
holes, statistics matrices, events. At batch 8 and 30 layers that is 240 row layers to walk at every step, a few
milliseconds on top of a 40-ms forward whatever the policy decides. A :class:`Resident` takes the rows of a bank
and keeps, per layer, row and bank column::

    live[l, b, c]        whether the column holds an entry (the others are free)
    key[l, b, c]         the entry's slot order (its slot when checked in, aligned on the newest; each new entry
                         the next number)
    positions[l, b, c]   its absolute position
    rows[l, b, c]        its ledger row
    stats[name][l, b, c] its attention statistics (acc, ema, count, low: those the cache tracks)
    order[l, b, j]       slot j's column, live slots first (with ``slots``, or statistics pooled over neighbours)

each ``(L, B, C)``, ``C`` the most entries a layer holds in a step (a budget of ``n`` and the step's new entry:
``n + 1``). A step writes each row's new entry into a free column of every layer (nothing moves; no mask while every
column read is live), measures its attention in the same pass (the ``"kvlab"`` attention function's mass, one
``(L, B, C)`` block) and folds it into the statistics with one op each. The policy then names what goes
(:class:`ColumnView`, ``column_drop``: one column per layer and row, one masked ``argmin``, or a mask for more: a
cut to a tighter budget, a block); :meth:`Resident.evict` frees those columns for the next steps, and packs the live
entries back to the front when a bulk drop frees a quarter of the columns read. Keys are post-RoPE and a one-query
step attends over a set, so the column order does not matter.

:meth:`Resident.close` hands the caches back as the batched loop would have left them: each layer's entries in slot
order in the row's first columns, its live map, statistics, events (one ``evicted`` event per layer, or one for all
layers when they dropped the same rows while holding the same rows) and next position. The ledger is appended at
every step. While resident, a row's cache refuses every use (its storage, mirror and statistics are out on loan);
``with Resident(...)`` closes on exit. The statistics are the batched loop's numbers computed over another column
order (equal within fp32 tolerance; the decisions and logits match it: tests/test_resident.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.cache import attn_fn
from kvlab.cache.batch import MASKS_KWARG, _StepCache, _StepLayer
from kvlab.cache.intlist import IntList
from kvlab.cache.mass import KWARG as MASS_KWARG
from kvlab.cache.mass import MassSink
from kvlab.cache.step import explicit_step
from kvlab.core.compat import cache_kwarg


@dataclass(frozen=True)
class ColumnView:
    """What a policy decides from over a resident bank's columns (read only). ``stats``: name -> ``(L, B, C)``
    float32 (the statistics the cache tracks); ``positions`` / ``key`` / ``rows``: ``(L, B, C)`` long (absolute
    position, slot order, ledger row); ``live``: ``(L, B, C)`` bool, the columns holding an entry (the others are
    free: read nothing there); ``newest_key``: the key of the step's new entry (a layer's newest ``w`` slots are the
    keys above ``newest_key - w``); ``records``: each row's
    step record (entropy, top-1, margin: Conf-KV's confidence) or None; ``vocab_size``; ``step``; ``order``: each
    layer's columns in slot order, its live ones first (a resident bank made with ``slots``), else None."""

    stats: dict
    positions: torch.Tensor
    key: torch.Tensor
    rows: torch.Tensor
    live: torch.Tensor
    newest_key: int
    step: int
    records: tuple | None = None
    vocab_size: int | None = None
    order: torch.Tensor | None = None       # (L, B, C) long: slot j's column (live slots first); kept when ``slots``

    def counts(self) -> torch.Tensor:
        """``(L, B)`` long: the entries each layer of each row holds (the step's new one included)."""
        return self.live.sum(-1)


class _Away:
    """A resident row's storage, mirror and statistics while it is out on loan: every use raises."""

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name):
        raise ValueError(f"this cache's {object.__getattribute__(self, '_what')} is resident in a "
                         "kvlab.cache.resident.Resident (its rows evict at every step): close it (Resident.close(), or "
                         "leave its with block) before using the cache")

    def __len__(self):
        self.__getattr__("__len__")


_BIG = torch.iinfo(torch.long).max
PACK_AT = 0.75      # a bulk drop that leaves fewer live entries than this share of the columns read packs them


class Resident:
    """Rows ``caches`` (rows ``0 .. B-1`` of ``bank``, ``B`` = its width) held as bank-wide tensors (module
    docstring). Every layer's live map must hold its entries in position order, full precision, with statistics (if
    tracked) in one setting. ``capacity``: columns per layer and row, the most entries a layer holds in a step (its
    budget plus the step's new entry; default: the longest layer + 1). ``slots``: keep each layer's slot order
    (:attr:`ColumnView.order`: a policy that reads entries by slot, block eviction; statistics pooled over
    neighbouring slots keep it whatever ``slots`` says). ValueError naming what does not fit, nothing changed."""

    def __init__(self, bank, caches, capacity: int | None = None, slots: bool = False):
        caches = list(caches)
        B = bank.width
        if len(caches) != B:
            raise ValueError(f"caches has {len(caches)} rows; a resident bank takes all {B} rows of its width")
        for b, c in enumerate(caches):
            if c is None or not bank.owns(b, c):
                raise ValueError(f"caches[{b}] is not row {b} of this bank")
            if c.n_int8:
                raise ValueError(f"caches[{b}] holds INT8 entries: resident rows are full precision")
        for c in caches:
            c._settle()                                         # deferred statistics folded in first
        L = bank.num_layers
        sts = [c._stats for c in caches]
        if len({st is None for st in sts}) != 1:
            raise ValueError("caches: some rows track attention statistics and some do not")
        if sts[0] is not None and len({(st.ema_decay, st.below, st.pool, st.window) for st in sts}) != 1:
            raise ValueError("caches: resident rows need one statistics setting")
        lens = [[len(live) for live in c._mirror.lives] for c in caches]                       # (B, L)
        top = max(max(x) for x in lens)
        if min(min(x) for x in lens) < 1:
            raise ValueError("caches: every layer needs an entry (prefill first)")
        C = top + 1 if capacity is None else capacity
        if isinstance(C, bool) or not isinstance(C, int) or C < top + 1:
            raise ValueError(f"capacity={capacity!r} must be an int >= the longest layer + 1 ({top + 1})")
        positions = torch.full((L, B, C), -1, dtype=torch.long)
        rows = torch.full((L, B, C), -1, dtype=torch.long)
        key = torch.full((L, B, C), -1, dtype=torch.long)
        for b, c in enumerate(caches):
            pos = c._mirror.ledger.position
            for i, live in enumerate(c._mirror.lives):
                p = [pos[r] for r in live]
                if any(p[j] >= p[j + 1] for j in range(len(p) - 1)):
                    raise ValueError(f"caches[{b}] layer {i}: positions do not increase along its slots (a re-rotation "
                                     "or an interior insert): resident rows keep slot order by position")
                n = len(p)
                positions[i, b, :n] = torch.tensor(p)
                rows[i, b, :n] = torch.tensor(list(live))
                key[i, b, :n] = torch.arange(top - n, top)      # every layer's newest entry: key top - 1
        self.bank, self.caches, self.L, self.B, self.C = bank, caches, L, B, C
        self.budget = top                                       # the longest layer when checked in
        dev = bank.device
        for i in range(L):                                      # every row layer dense at the front, room for C
            if bank.capacity(i) < C:
                bank.grow(i, C)
        bank.flush_moves()
        for c in caches:
            for lay in c._store.layers:
                if lay.sparse:
                    lay.compact()
                lay._to_front()
                lay._touch()
        bank.flush_moves()
        self.positions, self.rows, self.key = positions.to(dev), rows.to(dev), key.to(dev)     # (L, B, C)
        n_lb = torch.tensor(lens, dtype=torch.long).T                                         # (L, B)
        self.live = (torch.arange(C)[None, None, :] < n_lb[..., None]).to(dev)                # (L, B, C)
        self.next_key = top
        self.width = top                                        # columns [0, width) hold every live entry
        self.stats: dict[str, torch.Tensor] = {}
        self.setting = None
        self.pool = sts[0].pool if sts[0] is not None else 1
        # slot j's column, live slots first then the free columns (a permutation): kept for slot readers and pooling
        self.order = torch.arange(C, device=dev).expand(L, B, C).contiguous() if (slots or self.pool > 1) else None
        if sts[0] is not None:
            st = sts[0]
            self.setting = (st.window, st.below, st.ema_decay)
            for name in st.names:
                t = torch.zeros(L, B, C, dtype=torch.float32)
                for b, s in enumerate(sts):
                    for i, x in enumerate(s.data[name]):
                        t[i, b, :x.shape[0]] = x.float().cpu()
                self.stats[name] = t.to(dev)
            self._block = torch.zeros(L, B, C, dtype=torch.float32, device=dev)
        self.next_pos = [c.next_position for c in caches]
        # the events close() writes: per step the rows appended, then the step's drops: (L, B, k) rows (slot order),
        # (L, B) counts (None: one each), or None when nothing went; replayed from the rows each layer held
        self._held = [[list(live) for live in c._mirror.lives] for c in caches]
        self.appended: list[list[int]] = []
        self.log: list[tuple | None] = []
        self.stepped = False                                    # a step not yet followed by its evict()
        self._loans = [(c._store, c._mirror, c._stats) for c in caches]
        for c in caches:
            c._store, c._mirror, c._stats = _Away("storage"), _Away("mirror"), _Away("statistics")
        self.closed = False

    # ------------------------------------------------------------------ a step

    def _live(self) -> None:
        if self.closed:
            raise ValueError("this Resident is closed: its rows are caches again")

    @torch.inference_mode()
    def step(self, model, tokens, *, writer: str, steps, measure: bool = True) -> torch.Tensor:
        """One batched forward: row ``b`` appends ``tokens[b]`` (an int) at its next position, written into each
        layer's first free column; the statistics (if tracked) take the step's attention mass, or with ``measure``
        False only the new entry's zeros (the batched loop's unmeasured step). Returns logits ``(B, V)``. Needs the
        last step's :meth:`evict` first. On error nothing changes."""
        self._live()
        B, L, C = self.B, self.L, self.C
        if self.stepped:
            raise ValueError("Resident.step: the last step is not evicted yet; call evict(...) after each step (an "
                             "all-False mask drops nothing)")
        tokens, steps = list(tokens), list(steps)
        if len(tokens) != B or len(steps) != B:
            raise ValueError(f"tokens and steps need one entry per row ({B})")
        ids = [int(t) for t in tokens]
        dev = self.bank.device
        if self.order is None:
            free = (~self.live).to(torch.uint8).argmax(-1)                                    # (L, B) first free
        else:                                                   # the first column past the live slots: slot order
            count = self.live.sum(-1)                                                          # (L, B) kept
            free = self.order.gather(2, count.clamp_max(C - 1)[..., None])[..., 0]
        if not bool(self.live.gather(2, free[..., None]).logical_not().all()):
            raise ValueError(f"a layer holds {C} entries, the resident capacity: evict before the next step")
        W = max(self.width, int(free.max()) + 1)                                             # columns read
        seen = self.live[..., :W].scatter(2, free[..., None], True)                          # (L, B, W) after the write
        kwargs = {MASKS_KWARG: [None] * L}                      # every column read is live: no mask
        if not bool(seen.all()):
            add = torch.zeros(L, B, W, dtype=torch.float32, device=dev).masked_fill_(~seen, float("-inf"))
            kwargs[MASKS_KWARG] = [add[i, :, None, None, :] for i in range(L)]              # (B, 1, 1, W) additive
        sink = None
        if self.setting is not None and measure:
            window, below, _ = self.setting
            sink = MassSink(window, below, None, low_later=True)
            sink.block = self._block
            kwargs[MASS_KWARG] = sink
        layers = [_StepLayer(self.bank, i, free[i], W) for i in range(L)]          # new entry at (b, free[i, b])
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev).view(B, 1)                     # (B, 1)
        pos_t = torch.tensor(self.next_pos, dtype=torch.long, device=dev).view(B, 1)           # (B, 1)
        explicit = explicit_step(model)
        if explicit is not None:
            logits = explicit(ids_t, pos_t, _StepCache(layers), 1, **kwargs)
        else:
            attn_fn.use(model)
            logits = model(input_ids=ids_t, position_ids=pos_t, **{cache_kwarg(model): _StepCache(layers)},
                           use_cache=True, logits_to_keep=1, **kwargs).logits
        # committed from here on (the forward wrote only free columns)
        at = free[..., None]                                                                   # (L, B, 1)
        new_rows = [c_m.ledger.append([t], [p], writer, int(s))[0]
                    for (_, c_m, _), t, p, s in zip(self._loans, ids, self.next_pos, steps)]
        self.appended.append(new_rows)
        self.live.scatter_(2, at, True)
        self.key.scatter_(2, at, self.next_key)
        self.positions.scatter_(2, at, pos_t.view(1, B, 1).expand(L, B, 1))
        self.rows.scatter_(2, at, torch.tensor(new_rows, dtype=torch.long, device=dev).view(1, B, 1).expand(L, B, 1))
        for t in self.stats.values():
            t.scatter_(2, at, 0.0)                              # the new entry's statistics start at zero
        if sink is not None:
            m = raw = self._block[..., :W]                                                     # (L, B, W) mass
            if self.pool > 1:                                   # max-pooled over the next pool - 1 slots
                m = self._pooled(count + 1)[..., :W]
            st = self.stats
            beta = self.setting[2]
            st["acc"][..., :W] += m
            st["ema"][..., :W].mul_(beta).add_((1.0 - beta) * m)           # beta·ema + (1 - beta)·m, in place
            st["count"][..., :W] += 1.0
            if "low" in st:                                     # below the uniform share of the entries it saw
                n = seen.sum(-1, keepdim=True).to(m.dtype)                                     # (L, B, 1)
                st["low"][..., :W] += ((raw < 1.0 / n) & seen).float()
        self.width = W
        self.next_key += 1
        self.next_pos = [p + 1 for p in self.next_pos]
        self.stepped = True
        return logits[:, -1, :]                                                                # (B, V)

    def _pooled(self, count: torch.Tensor) -> torch.Tensor:
        """The step's mass ``(L, B, C)`` max-pooled in slot order over each entry and the next ``pool - 1``
        (:func:`~kvlab.cache.stats.max_pool_next`, the window cut at the layer's last slot), back in column order
        (free columns 0)."""
        L, B, C = self.L, self.B, self.C
        valid = torch.arange(C, device=count.device) < count[..., None]                       # (L, B, C) slots
        ms = self._block.gather(2, self.order).masked_fill(~valid, float("-inf"))              # slot order
        padded = torch.nn.functional.pad(ms.view(L * B, 1, C), (0, self.pool - 1), value=float("-inf"))
        pooled = torch.nn.functional.max_pool1d(padded, self.pool, stride=1).view(L, B, C).masked_fill(~valid, 0.0)
        return torch.empty_like(pooled).scatter_(2, self.order, pooled)

    def view(self, step: int, records=None, vocab_size: int | None = None) -> ColumnView:
        """The columns a policy decides from after a step (:class:`ColumnView`); ``records``: each row's step record
        (a policy that reads its confidence needs them)."""
        self._live()
        return ColumnView(stats=dict(self.stats), positions=self.positions, key=self.key, rows=self.rows,
                          live=self.live, newest_key=self.next_key - 1, step=step,
                          records=None if records is None else tuple(records), vocab_size=vocab_size,
                          order=self.order)

    @torch.inference_mode()
    def evict(self, drop: torch.Tensor) -> None:
        """Drop the entries a policy's ``column_drop`` names: ``(L, B)`` long, one column per layer and row, or an
        ``(L, B, C)`` bool mask (any number, none included). The freed columns take the next steps' entries."""
        self._live()
        if not self.stepped:
            raise ValueError("Resident.evict: each step evicts once (this step's eviction is done)")
        L, B, C = self.L, self.B, self.C
        d = torch.as_tensor(drop).to(self.bank.device)
        if tuple(d.shape) == (L, B) and d.dtype in (torch.int64, torch.int32):       # one column per layer and row
            d = d.long()
            if bool(((d < 0) | (d >= C)).any()):
                raise ValueError(f"columns must lie in [0, {C})")
            at = d[..., None]                                                                  # (L, B, 1)
            if not bool(self.live.gather(2, at).all()):
                raise ValueError("drop names a free column (no entry there)")
            self.log.append((self.rows.gather(2, at), None))                                   # (L, B, 1) rows
            self.live.scatter_(2, at, False)
            self._reorder()
            self.stepped = False
            return
        if tuple(d.shape) != (L, B, C) or d.dtype != torch.bool:
            raise ValueError(f"drop must be an (L, B) = ({L}, {B}) integer tensor of columns or an (L, B, C) = "
                             f"({L}, {B}, {C}) bool mask, got {tuple(d.shape)} {d.dtype}")
        mask = d
        if bool((mask & ~self.live).any()):
            raise ValueError("drop names a free column (no entry there)")
        k = mask.sum(-1)                                                                       # (L, B)
        kmax = int(k.max())
        self.log.append(None)
        if kmax:
            order = torch.where(mask, self.key, _BIG).argsort(-1)[..., :kmax]                  # slot order
            self.log[-1] = (self.rows.gather(2, order), k)                                     # (L, B, kmax) rows
            self.live &= ~mask
            if kmax > 1 and float(self.live[..., :self.width].sum()) < PACK_AT * L * B * self.width:
                self._pack()                                    # a bulk drop's free columns: packed
            else:
                self._reorder()
        self.stepped = False

    def _reorder(self) -> None:
        """After a drop: the slot order without the dropped slots (live slots first, in their order; a stable
        partition of :attr:`order`)."""
        if self.order is not None:
            gone = ~self.live.gather(2, self.order)                                            # (L, B, C) by slot
            self.order = self.order.gather(2, gone.to(torch.uint8).argsort(dim=-1, stable=True))

    def _slot_perm(self) -> torch.Tensor:
        """``(L, B, C)``: each layer's live columns in slot order, then its free ones."""
        return torch.where(self.live, self.key, _BIG).argsort(-1)

    def _to_front(self, perm: torch.Tensor) -> None:
        """Every layer's K/V columns ``perm[l, b]`` (``(L, B, m)``) moved, in that order, to its first ``m`` columns
        (one gather per buffer)."""
        B, m = self.B, perm.shape[-1]
        for i in range(self.L):
            idx = perm[i][:, None, :, None]                                                   # (B, 1, m, 1)
            for buf in (self.bank.k[i], self.bank.v[i]):
                part = buf[:B]                                                                 # (B, H_kv, cap, D)
                part[:, :, :m] = part.gather(2, idx.expand(B, part.shape[1], m, part.shape[3]))

    def _pack(self) -> None:
        """Every layer's live entries moved to its first columns in slot order (one gather per buffer and per-column
        tensor), so a step reads no more columns than the longest layer holds."""
        L, B = self.L, self.B
        perm = self._slot_perm()                                                               # (L, B, C) live first
        top = int(self.live.sum(-1).max())
        self._to_front(perm[..., :top])
        for name in ("positions", "rows", "key", "live"):
            setattr(self, name, getattr(self, name).gather(2, perm))
        for name, t in self.stats.items():
            self.stats[name] = t.gather(2, perm)
        if self.order is not None:
            self.order = torch.arange(self.C, device=perm.device).expand(L, B, self.C).contiguous()
        self.width = top

    # ------------------------------------------------------------------ handing the caches back

    @torch.inference_mode()
    def close(self) -> list:
        """The rows as caches again (module docstring); returns them."""
        if self.closed:
            return self.caches
        L, B = self.L, self.B
        n_lb = self.live.sum(-1)                                                               # (L, B)
        top = int(n_lb.max())
        perm = self._slot_perm()[..., :top]                                                    # (L, B, top) slot order
        bank = self.bank
        self._to_front(perm)
        rows = self.rows.gather(2, perm).cpu().tolist()                                        # L x B x top
        stats = {name: t.gather(2, perm).cpu() for name, t in self.stats.items()}
        counts = n_lb.cpu().tolist()
        events = [None if e is None else (e[0].cpu().tolist(), [[1] * B] * L if e[1] is None else e[1].cpu().tolist())
                  for e in self.log]
        for b, (c, (store, mirror, st)) in enumerate(zip(self.caches, self._loans)):
            c._store, c._mirror, c._stats = store, mirror, st
            ns = [counts[i][b] for i in range(L)]
            for lay, n in zip(store.layers, ns):
                lay.s, lay.n, lay.holes, lay.order = 0, n, [], None
                lay._order_row = None
                lay._views()
            bank.clear_cols(b)
            self._events(mirror, b, events)
            mirror.lives = [IntList(rows[i][b][:n]) for i, n in enumerate(ns)]
            if st is not None:
                for name, t in stats.items():
                    if len(set(ns)) == 1:
                        st._set(name, t[:, b, :ns[0]].to(st.device).clone())
                    else:
                        st._set_layers(name, [t[i, b, :n].to(st.device).clone() for i, n in enumerate(ns)])
            c.next_position = self.next_pos[b]
            c.check()
        self.closed = True
        return self.caches

    def _events(self, mirror, b: int, events: list) -> None:
        """Row ``b``'s ``evicted`` events, as the batched loop logs them: one tick per step that dropped anything, one
        event per layer and row, or one per row for all layers (layer -1) when every layer dropped the same rows
        while all held the same rows (:attr:`Mirror.uniform`, followed here through each layer's row set and its
        difference from layer 0's)."""
        L = self.L
        held = [set(x) for x in self._held[b]]
        diff = [held[i] ^ held[0] for i in range(L)]                     # rows where layer i and layer 0 differ
        for new, e in zip(self.appended, events):
            for x in held:                                              # the step's entry joins every layer
                x.add(new[b])
            if e is None:
                continue
            gone, k = e
            per = [gone[i][b][:k[i][b]] for i in range(L)]
            if not any(per):
                continue
            tick = mirror.next_tick()
            if not any(diff) and all(x == per[0] for x in per):
                mirror.events.extend(tick, per[0], "evicted", -1)
            else:
                for i, x in enumerate(per):
                    if x:
                        mirror.events.extend(tick, x, "evicted", i)
            for x, d in zip(held, per):
                x.difference_update(d)
            for i in range(1, L):
                for r in set(per[0]).union(per[i]):
                    if (r in held[0]) != (r in held[i]):
                        diff[i].add(r)
                    else:
                        diff[i].discard(r)

    def __enter__(self) -> "Resident":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
