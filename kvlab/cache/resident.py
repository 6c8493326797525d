"""Resident eviction: the rows of a batch evicting one entry per layer at every step, their eviction state held as
bank-wide tensors while they decode. Part of the cache module: it alone edits the rows' tensors while they are
resident, and hands the caches back whole.

The batched loop (:mod:`.batch`, :mod:`.evict_rows`) keeps every row's state in Python per row and layer: live maps,
holes, statistics matrices, events. At batch 8 and 30 layers that is 240 row layers to walk at every step, a few
milliseconds on top of a 40-ms forward whatever the policy decides. A :class:`Resident` takes the rows of a bank
whose every layer holds ``n`` entries (the policy's budget) and keeps, per layer, row and bank column::

    key[l, b, c]        the entry's slot order (its slot when checked in; each new entry the next number)
    positions[l, b, c]  its absolute position
    rows[l, b, c]       its ledger row
    stats[name][l, b, c] its attention statistics (acc, ema, count, low: those the cache tracks)

each ``(L, B, n + 1)``: ``n`` live entries and one free column, the one the last eviction freed. A step writes each
row's new entry into that free column of every layer (nothing moves, no holes, no mask: every column is live),
measures its attention in the same pass (the ``"kvlab"`` attention function's mass, one ``(L, B, n + 1)`` block) and
folds it into the statistics with one op each. The policy then names, per layer and row, the column to drop
(:class:`ColumnView`, ``column_drop``: one masked ``argmin``); :meth:`Resident.evict` frees those columns for the next
step. Keys are post-RoPE and a one-query step attends over a set, so the column order does not matter.

:meth:`Resident.close` hands the caches back as the batched loop would have left them: each layer's entries in slot
order in the row's first ``n`` columns, its live map, statistics, events (one ``evicted`` event per layer, or one for
all layers when they dropped the same row) and next position. The ledger is appended at every step. While resident,
a row's cache refuses every use (its storage, mirror and statistics are out on loan); ``with Resident(...)`` closes
on exit. The statistics are the batched loop's numbers computed over another column order (equal within fp32
tolerance; the decisions and logits match it: tests/test_resident.py).
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
    position, slot order, ledger row); ``newest_key``: the key of the step's new entry (a layer's newest ``w`` slots
    are the keys above ``newest_key - w``); ``budget``: the entries each layer keeps (``C - 1``); ``step``."""

    stats: dict
    positions: torch.Tensor
    key: torch.Tensor
    rows: torch.Tensor
    newest_key: int
    budget: int
    step: int


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


class Resident:
    """Rows ``caches`` (rows ``0 .. B-1`` of ``bank``, ``B`` = its width) held as bank-wide tensors (module
    docstring). Every layer of every row must hold the same ``n`` entries in position order, full precision, with
    statistics (if tracked) unpooled; ``n`` is the budget every step keeps. ValueError naming what does not fit,
    nothing changed."""

    def __init__(self, bank, caches):
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
        n = len(caches[0]._mirror.lives[0])
        L = bank.num_layers
        sts = [c._stats for c in caches]
        if len({st is None for st in sts}) != 1:
            raise ValueError("caches: some rows track attention statistics and some do not")
        if sts[0] is not None and (len({(st.ema_decay, st.below, st.pool, st.window) for st in sts}) != 1
                                   or sts[0].pool != 1):
            raise ValueError("caches: resident rows need one statistics setting, unpooled (pool=1)")
        positions, rows = [], []
        for b, c in enumerate(caches):
            pos = c._mirror.ledger.position
            for i, live in enumerate(c._mirror.lives):
                if len(live) != n:
                    raise ValueError(f"caches[{b}] layer {i} holds {len(live)} entries, layer 0 of row 0 {n}: "
                                     "resident rows hold the same count on every layer (evict to the budget first)")
            per = [[pos[r] for r in live] for live in c._mirror.lives]
            if any(p[j] >= p[j + 1] for p in per for j in range(n - 1)):
                raise ValueError(f"caches[{b}]: a layer's positions do not increase along its slots (a re-rotation or "
                                 "an interior insert): resident rows keep slot order by position")
            positions.append(per)
            rows.append([list(live) for live in c._mirror.lives])
        if n < 1:
            raise ValueError("caches are empty: prefill and evict to the budget first")
        self.bank, self.caches, self.n, self.L, self.B = bank, caches, n, L, B
        self.C = C = n + 1
        dev = bank.device
        for i in range(L):                                      # every row layer dense at the front, room for one more
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
        pad = lambda x, v: torch.nn.functional.pad(x, (0, 1), value=v)   # noqa: E731 the free column
        self.positions = pad(torch.tensor(positions, dtype=torch.long).transpose(0, 1), -1).to(dev)   # (L, B, C)
        self.rows = pad(torch.tensor(rows, dtype=torch.long).transpose(0, 1), -1).to(dev)             # (L, B, C)
        self.key = pad(torch.arange(n, device=dev).expand(L, B, n), n).contiguous()                     # (L, B, C)
        self.next_key = n
        self.stats: dict[str, torch.Tensor] = {}
        self.setting = None
        if sts[0] is not None:
            st = sts[0]
            self.setting = (st.window, st.below, st.ema_decay)
            for name in st.names:
                self.stats[name] = pad(torch.stack([s._stack(name) for s in sts], 1).float().to(dev), 0.0)
            self._block = torch.empty(L, B, C, dtype=torch.float32, device=dev)
        self.free = torch.full((L, B), n, dtype=torch.long, device=dev)    # (L, B): the column each writes next
        self.next_pos = [c.next_position for c in caches]
        # uniform rows (every layer the same rows) log one event per eviction when every layer drops the same row
        self.uniform = [c._mirror.uniform for c in caches]
        self.log: list[tuple[torch.Tensor, list[bool]]] = []            # per eviction: (L, B) rows, uniform before
        self._loans = [(c._store, c._mirror, c._stats) for c in caches]
        for c in caches:
            c._store, c._mirror, c._stats = _Away("storage"), _Away("mirror"), _Away("statistics")
        self.closed = False

    # ------------------------------------------------------------------ a step

    def _live(self) -> None:
        if self.closed:
            raise ValueError("this Resident is closed: its rows are caches again")

    @torch.inference_mode()
    def step(self, model, tokens, *, writer: str, steps) -> torch.Tensor:
        """One batched forward: row ``b`` appends ``tokens[b]`` (an int) at its next position, written into each
        layer's free column; the statistics take the step's attention mass. Returns logits ``(B, V)``. Needs the
        last step's :meth:`evict` first (each layer's one free column). On error nothing changes."""
        self._live()
        B, L, C = self.B, self.L, self.C
        if self.free is None:
            raise ValueError("Resident.step: the last step evicted nothing; call evict(columns) after each step")
        tokens, steps = list(tokens), list(steps)
        if len(tokens) != B or len(steps) != B:
            raise ValueError(f"tokens and steps need one entry per row ({B})")
        ids = [int(t) for t in tokens]
        dev = self.bank.device
        sink = None
        if self.setting is not None:
            window, below, _ = self.setting
            sink = MassSink(window, below, None, low_later=True)
            sink.block = self._block
        layers = [_StepLayer(self.bank, i, self.free[i], C) for i in range(L)]    # new entry at (b, free[i, b])
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev).view(B, 1)                     # (B, 1)
        pos_t = torch.tensor(self.next_pos, dtype=torch.long, device=dev).view(B, 1)           # (B, 1)
        kwargs = {MASKS_KWARG: [None] * L}                      # every column is live: no mask
        if sink is not None:
            kwargs[MASS_KWARG] = sink
        explicit = explicit_step(model)
        if explicit is not None:
            logits = explicit(ids_t, pos_t, _StepCache(layers), 1, **kwargs)
        else:
            attn_fn.use(model)
            logits = model(input_ids=ids_t, position_ids=pos_t, **{cache_kwarg(model): _StepCache(layers)},
                           use_cache=True, logits_to_keep=1, **kwargs).logits
        # committed from here on (the forward wrote only the free columns)
        at = self.free[..., None]                                                              # (L, B, 1)
        new_rows = [c_m.ledger.append([t], [p], writer, int(s))[0]
                    for (_, c_m, _), t, p, s in zip(self._loans, ids, self.next_pos, steps)]
        self.key.scatter_(2, at, self.next_key)
        self.positions.scatter_(2, at, pos_t.view(1, B, 1).expand(L, B, 1))
        self.rows.scatter_(2, at, torch.tensor(new_rows, dtype=torch.long, device=dev).view(1, B, 1).expand(L, B, 1))
        if sink is not None:
            m = self._block                                                                    # (L, B, C) mass
            st = self.stats
            for name in st:
                st[name].scatter_(2, at, 0.0)                   # the new entry's statistics start at zero
            beta = self.setting[2]
            st["acc"] += m
            st["ema"] = beta * st["ema"] + (1.0 - beta) * m
            st["count"] += 1.0
            if "low" in st:
                st["low"] += (m < 1.0 / torch.as_tensor(C, dtype=m.dtype, device=dev)).float()
        self.next_key += 1
        self.next_pos = [p + 1 for p in self.next_pos]
        self.free = None
        return logits[:, -1, :]                                                                # (B, V)

    def view(self, step: int) -> ColumnView:
        """The columns a policy decides from after a step (:class:`ColumnView`)."""
        self._live()
        return ColumnView(stats=dict(self.stats), positions=self.positions, key=self.key, rows=self.rows,
                          newest_key=self.next_key - 1, budget=self.n, step=step)

    def evict(self, columns: torch.Tensor) -> None:
        """Drop, per layer and row, the entry in column ``columns[l, b]`` (``(L, B)`` long, a policy's
        ``column_drop``); the next step writes there."""
        self._live()
        if self.free is not None:
            raise ValueError("Resident.evict: each step evicts once (this step's columns are already free)")
        cols = torch.as_tensor(columns)
        if tuple(cols.shape) != (self.L, self.B) or cols.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"columns must be an (L, B) = ({self.L}, {self.B}) integer tensor, got "
                             f"{tuple(cols.shape)} {cols.dtype}")
        cols = cols.to(device=self.bank.device, dtype=torch.long)
        if bool(((cols < 0) | (cols >= self.C)).any()):
            raise ValueError(f"columns must lie in [0, {self.C})")
        gone = self.rows.gather(2, cols[..., None])[..., 0]                                    # (L, B) ledger rows
        same = (gone == gone[:1]).all(0).tolist()                                              # (B,)
        self.log.append((gone, list(self.uniform)))
        self.uniform = [u and s for u, s in zip(self.uniform, same)]
        self.free = cols

    # ------------------------------------------------------------------ handing the caches back

    @torch.inference_mode()
    def close(self) -> list:
        """The rows as caches again (module docstring); returns them. A step not followed by an eviction leaves its
        rows one entry longer."""
        if self.closed:
            return self.caches
        L, B, C = self.L, self.B, self.C
        key = self.key if self.free is None else self.key.scatter(2, self.free[..., None], torch.iinfo(torch.long).max)
        n = C if self.free is None else self.n
        perm = key.argsort(-1)[..., :n]                                                       # (L, B, n) slot order
        bank = self.bank
        for i in range(L):
            idx = perm[i][:, None, :, None]                                                   # (B, 1, n, 1)
            for buf in (bank.k[i], bank.v[i]):
                part = buf[:B]                                                                 # (B, H_kv, cap, D)
                got = part.gather(2, idx.expand(B, part.shape[1], n, part.shape[3]))
                part[:, :, :n] = got
        rows = self.rows.gather(2, perm).cpu()                                                 # (L, B, n)
        stats = {name: t.gather(2, perm) for name, t in self.stats.items()}
        events = [(gone.cpu().tolist(), uni) for gone, uni in self.log]
        for b, (c, (store, mirror, st)) in enumerate(zip(self.caches, self._loans)):
            c._store, c._mirror, c._stats = store, mirror, st
            for lay in store.layers:
                lay.s, lay.n, lay.holes, lay.order = 0, n, [], None
                lay._order_row = None
                lay._views()
            bank.clear_cols(b)
            for gone, uni in events:
                tick = mirror.next_tick()
                col = [g[b] for g in gone]
                if uni[b] and all(r == col[0] for r in col):
                    mirror.events.extend(tick, [col[0]], "evicted", -1)
                else:
                    for i, r in enumerate(col):
                        mirror.events.extend(tick, [r], "evicted", i)
            mirror.lives = [IntList(x) for x in rows[:, b].tolist()]
            if st is not None:
                for name, t in stats.items():
                    st._set(name, t[:, b].clone())
            c.next_position = self.next_pos[b]
            c.check()
        self.closed = True
        return self.caches

    def __enter__(self) -> "Resident":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
