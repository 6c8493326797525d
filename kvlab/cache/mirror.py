"""The token mirror of a :class:`~kvlab.cache.KVCache`: the ledger plus the live map, in pure Python.

* the **ledger** (:class:`~kvlab.cache.ledger.Ledger`) — append-only: every entry ever written
  (token id, absolute RoPE position, writer, decode step); rows are never rewritten or reordered;
* the **live maps** — per layer, ``slot -> ledger row`` for the entries that layer holds now, in
  slot order. Every layer has its own (per-layer eviction); ``live`` is layer 0's. A cache whose
  layers all hold the same rows is *uniform*;
* the **event log** — what each edit tick did to which rows (``evicted``, ``moved``, ``inserted``…);
  a row's status is derived from it (:meth:`Mirror.ledger_status`).

No cache tensors here (:func:`positions_tensor` reads positions as a tensor; each live map is an
:class:`~kvlab.cache.intlist.IntList` that keeps its rows as one between steps): the cache edits its storage
(:mod:`.storage`) and this mirror in the same call.
"""
from __future__ import annotations

from array import array
from collections import abc
from operator import itemgetter
from typing import Sequence

import torch

from kvlab.cache.intlist import IntList, int_list
from kvlab.cache.ledger import EventLog, Ledger, Row
from kvlab.cache.plan import _ORIGIN_EVENTS, _REMOVAL_EVENTS


def _gather(values: list, rows: list[int]) -> tuple:
    """``tuple(values[r] for r in rows)``, in C (``itemgetter``)."""
    if len(rows) > 1:
        return itemgetter(*rows)(values)
    return (values[rows[0]],) if rows else ()


class LivePositions(abc.Sequence):
    """One layer's live positions as a read-only sequence, gathered from the ledger only when read whole:
    ``len`` and a slot or a slice cost nothing per entry. It stays what it was when taken (the ledger's positions
    never change): taken from an :class:`~kvlab.cache.intlist.IntList` (a cache's live map) it reads the list's
    first ``len`` ledger rows, and the list hands it a copy of them just before any edit other than an append
    (:meth:`IntList.watch`; a view released before the cache's edit costs no copy at all); from anything else it
    copies the rows when taken. Equal to the tuple of the same positions.

    :meth:`rows_tensor` reads the rows as a tensor: the IntList's own (kept up to date from then on, so the next read
    is a prefix of it) while only appends have followed, else converted from the copy. Until then the list keeps no
    tensor: a policy that never reads positions as a tensor (most ranked ones) costs no conversion per layer and row
    at any step."""

    __slots__ = ("_pos", "_rows", "_t", "_src", "_ver", "_n", "__weakref__")

    def __init__(self, position: list, rows: Sequence[int]):
        self._pos, self._t = position, None
        if isinstance(rows, IntList):                           # the list's prefix until it is edited
            self._src, self._ver, self._n, self._rows = rows, rows.version, len(rows), None
            rows.watch(self)
        else:
            self._src = self._ver = None
            self._rows = list(rows)
            self._n = len(self._rows)

    def _detach(self, src) -> None:
        """``src`` (the list taken from) is about to be edited: keep a copy of its first ``len`` rows."""
        if self._rows is None and self._src is src:
            self._rows = list.__getitem__(src, slice(0, self._n))

    def _list(self) -> list:
        """The live map's ledger rows (a new list while they are still the source list's prefix)."""
        rows = self._rows
        return list.__getitem__(self._src, slice(0, self._n)) if rows is None else rows

    def _appended_only(self) -> bool:
        """Taken from an IntList that has only been appended to since: the snapshot is the list's prefix."""
        src = self._src
        return src is not None and src.version == self._ver and len(src) >= self._n

    def rows_tensor(self) -> torch.Tensor:
        """The ledger rows of the live slots as an int64 ``(len,)`` tensor, as they were when taken."""
        n = self._n
        if self._appended_only():
            return self._src.tensor()[:n]                        # only appends since: the snapshot is its prefix
        return torch.frombuffer(array("q", self._list()), dtype=torch.int64) if n else torch.zeros(0, dtype=torch.int64)

    def _tuple(self) -> tuple:
        if self._t is None:
            self._t = _gather(self._pos, self._list())
        return self._t

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        if isinstance(i, slice):
            if self._t is not None:
                return self._t[i]
            rows = self._rows
            return _gather(self._pos, rows[i] if rows is not None else
                           list.__getitem__(self._src, slice(*i.indices(self._n))))
        j = int(i)
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError(f"slot {i} of {self._n} live slots")
        rows = self._rows
        return self._pos[int((self._src if rows is None else rows)[j])]

    def __iter__(self):
        return iter(self._tuple())

    def __eq__(self, other) -> bool:
        if isinstance(other, LivePositions):
            if other._pos is self._pos:                         # one ledger: equal rows give equal positions
                if self._n == other._n and self._src is not None and self._src is other._src and \
                        self._appended_only() and other._appended_only():
                    return True                                 # two prefixes of one list, equally long
                if self._list() == other._list():
                    return True
            return self._tuple() == other._tuple()
        return self._tuple() == tuple(other) if isinstance(other, (tuple, list)) else NotImplemented

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        return repr(self._tuple())


def positions_tensor(seqs: Sequence, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Slots ``lo .. hi - 1`` of several layers' live positions (each a :class:`LivePositions` or a sequence,
    equally long) as one int64 ``(G, hi - lo)`` tensor. Live sets read from one ledger are gathered there in C
    (no per-entry Python); anything else is converted as given."""
    hi = len(seqs[0]) if hi is None else hi
    live = [s for s in seqs if isinstance(s, LivePositions)]
    if len(live) == len(seqs) and len({id(s._pos) for s in live}) == 1 and hi > lo:
        n = len(live[0])
        if all(x._appended_only() and len(x._src) == n and len(x) == n for x in live):
            rows = IntList.tensors([x._src for x in live])[:, lo:hi]    # the live maps unchanged since: all at once
        else:
            rows = torch.stack([s.rows_tensor()[lo:hi] for s in live])                        # (G, hi - lo) ledger rows
        pos = live[0]._pos
        table = pos.tensor() if isinstance(pos, IntList) else torch.frombuffer(array("q", pos), dtype=torch.int64)
        return table[rows]                                                                     # ledger positions
    return torch.tensor([list(s[lo:hi]) for s in seqs], dtype=torch.int64).view(len(seqs), max(hi - lo, 0))


class Mirror:
    """Ledger + per-layer live maps + event log + the edit-tick counter.

    Before the first write the number of layers is unknown: ``lives`` holds one list, and
    :meth:`set_layers` replicates it once the storage has layers."""

    def __init__(self, ledger: Ledger | None = None, live: list[int] | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.lives = [live if live is not None else []]
        self.events = EventLog()   # append-only edit history: surgery ticks and evictions
        self.ticks = 0             # edit ticks attempted (surgery and eviction)

    @property
    def lives(self) -> list[IntList]:
        """Per layer, the live map (slot -> ledger row) as an :class:`~kvlab.cache.intlist.IntList`; assigning a
        list of lists stores each as one (copied)."""
        return self._lives

    @lives.setter
    def lives(self, maps) -> None:
        self._lives = [int_list(x) for x in maps]

    @property
    def live(self) -> list[int]:
        """Layer 0's live map."""
        return self.lives[0]

    @live.setter
    def live(self, rows: list[int]) -> None:
        """Set the same live map on every layer."""
        self.lives = [list(rows) for _ in self.lives]

    def set_layers(self, layers: int) -> None:
        """Give a uniform mirror one live map per layer (``layers`` of them)."""
        if layers and len(self.lives) != layers:
            if not self.uniform:
                raise AssertionError(f"mirror has {len(self.lives)} ragged live maps, storage {layers} layers")
            self.lives = [list(self.lives[0]) for _ in range(layers)]

    @property
    def uniform(self) -> bool:
        """Every layer holds the same rows."""
        first = self.lives[0]
        n = len(first)
        return all(len(x) == n for x in self.lives) and all(x is first or x == first for x in self.lives[1:])

    def extend(self, rows: Sequence[int]) -> None:
        """Append ``rows`` to every layer's live map."""
        for x in self.lives:
            x.extend(rows)

    def truncate_layers(self, lengths: Sequence[int]) -> None:
        for x, n in zip(self.lives, lengths):
            del x[n:]

    def check(self) -> None:
        n = len(self.ledger)
        for i, live in enumerate(self.lives):
            if live and (min(live) < 0 or max(live) >= n):
                raise AssertionError(f"live map of layer {i} points outside the ledger")

    def copy(self) -> "Mirror":
        new = Mirror(self.ledger.copy())
        new.lives = self.lives                    # copied, each with its cached tensor (never edited in place)
        new.events, new.ticks = self.events.copy(), self.ticks
        return new

    def layer_positions(self) -> tuple[tuple[int, ...], ...]:
        pos = self.ledger.position
        if self.uniform:
            return (_gather(pos, self.live),) * len(self.lives)
        return tuple(_gather(pos, live) for live in self.lives)

    def live_positions(self) -> tuple:
        """:meth:`layer_positions` as :class:`LivePositions` (what an eviction policy's view carries): per
        layer, gathered only if a policy reads them whole."""
        pos = self.ledger.position
        if self.uniform:
            return (LivePositions(pos, self.live),) * len(self.lives)
        return tuple(LivePositions(pos, live) for live in self.lives)

    def held(self, positions: Sequence[int]) -> list[int]:
        """Those of ``positions`` that some layer holds (in the order given)."""
        pos = self.ledger.position
        have = {pos[r] for live in self.lives for r in live}
        return [int(p) for p in positions if int(p) in have]

    def next_tick(self) -> int:
        tick = self.ticks
        self.ticks += 1
        return tick

    # ------------------------------------------------------------------ columns of the live entries

    @property
    def token_ids(self) -> list[int]:
        tid = self.ledger.token_id
        return [tid[i] for i in self.live]

    @property
    def positions(self) -> list[int]:
        pos = self.ledger.position
        return [pos[i] for i in self.live]

    @property
    def writers(self) -> list[str]:
        w = self.ledger.writer
        return [w[i] for i in self.live]

    def rows(self) -> list[Row]:
        return [self.ledger.row(i) for i in self.live]

    def to_frame(self):
        """The live map as a DataFrame: slot, ledger row, token id, position, writer, step."""
        import pandas as pd

        led = self.ledger
        return pd.DataFrame({
            "slot": range(len(self.live)),
            "row": self.live,
            "token_id": [led.token_id[i] for i in self.live],
            "position": [led.position[i] for i in self.live],
            "writer": [led.writer[i] for i in self.live],
            "step": [led.step[i] for i in self.live],
        })

    # ------------------------------------------------------------------ position lookups

    def slots_at(self, positions: Sequence[int], layer: int = 0) -> dict[int, int]:
        """``{position: slot}`` for those of ``positions`` that exactly one live slot of ``layer`` holds."""
        pos = self.ledger.position
        where: dict[int, int] = {}
        seen: set[int] = set()
        for s, r in enumerate(self.lives[layer]):
            p = pos[r]
            if p in seen:
                where.pop(p, None)
            else:
                seen.add(p)
                where[p] = s
        return {int(p): where[int(p)] for p in positions if int(p) in where}

    def slots_of(self, positions: Sequence[int], name: str, layer: int = 0) -> list[int]:
        """Live slots of ``layer`` holding each absolute position.

        ValueError naming the first position that no live slot holds, or that several hold: an
        interior ``insert`` may give new entries positions its right neighbours already have (see
        :meth:`KVCache.apply`), and then "the entry at position p" is ambiguous — rather than pick one
        slot silently, position-addressed edits (``splice_positions``, ``append_from``) refuse.
        """
        pos = self.ledger.position
        where: dict[int, list[int]] = {}
        for s, r in enumerate(self.lives[layer]):
            where.setdefault(pos[r], []).append(s)
        out = []
        for p in positions:
            slots = where.get(p)
            if not slots:
                raise ValueError(f"{name} holds no entry at position {p}")
            if len(slots) > 1:
                raise ValueError(f"{name} holds {len(slots)} entries at position {p} (slots {slots}), e.g. after an "
                                 "interior insert reused its right neighbours' positions; a position-addressed edit is "
                                 "ambiguous there — address entries by slot (splice_last) or rebuild the cache")
            out.append(slots[0])
        return out

    # ------------------------------------------------------------------ ledger status

    def ledger_status(self) -> list[str]:
        """Status of every ledger row, derived (rows are never edited): ``live`` if some layer's live
        map holds it, else its last removal event (``deleted``/``replaced``/``superseded``/``evicted``
        /``moved``), else ``dropped``."""
        status = ["dropped"] * len(self.ledger)
        for r, ev in zip(self.events.row, self.events.event):
            if ev in _REMOVAL_EVENTS:
                status[r] = _REMOVAL_EVENTS[ev]
        for live in self.lives:
            for r in live:
                status[r] = "live"
        return status

    def ledger_frame(self):
        """The whole ledger as a DataFrame with a derived ``status`` and the ``origin`` event of each row."""
        import pandas as pd

        led = self.ledger
        origin = ["written"] * len(led)
        for r, ev in zip(self.events.row, self.events.event):
            if ev in _ORIGIN_EVENTS:
                origin[r] = ev
        return pd.DataFrame({"row": range(len(led)), "token_id": led.token_id, "position": led.position,
                             "writer": led.writer, "step": led.step, "origin": origin,
                             "status": self.ledger_status()})
