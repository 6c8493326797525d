"""The token mirror of a :class:`~kvlab.cache.KVCache`: the ledger plus the live map, in pure Python.

* the **ledger** (:class:`~kvlab.cache.ledger.Ledger`) — append-only: every entry ever written
  (token id, absolute RoPE position, writer, decode step); rows are never rewritten or reordered;
* the **live map** — ``slot -> ledger row`` for the entries the cache holds now, in slot order;
* the **event log** — what each edit tick did to which rows (``evicted``, ``moved``, ``inserted``…);
  a row's status is derived from it (:meth:`Mirror.ledger_status`).

No tensors here: the cache edits its storage (:mod:`.storage`) and this mirror in the same call.
"""
from __future__ import annotations

from typing import Sequence

from .ledger import EventLog, Ledger, Row
from .plan import _ORIGIN_EVENTS, _REMOVAL_EVENTS


class Mirror:
    """Ledger + live map + event log + the edit-tick counter."""

    def __init__(self, ledger: Ledger | None = None, live: list[int] | None = None):
        self.ledger = ledger if ledger is not None else Ledger()
        self.live: list[int] = live if live is not None else []
        self.events = EventLog()   # append-only edit history: surgery ticks and evictions
        self.ticks = 0             # edit ticks attempted (surgery and eviction)

    def check(self) -> None:
        if self.live and (min(self.live) < 0 or max(self.live) >= len(self.ledger)):
            raise AssertionError("live map points outside the ledger")

    def copy(self) -> "Mirror":
        new = Mirror(self.ledger.copy(), list(self.live))
        new.events, new.ticks = self.events.copy(), self.ticks
        return new

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

    def slots_at(self, positions: Sequence[int]) -> dict[int, int]:
        """``{position: slot}`` for those of ``positions`` that exactly one live slot holds."""
        pos = self.ledger.position
        where: dict[int, int] = {}
        seen: set[int] = set()
        for s, r in enumerate(self.live):
            p = pos[r]
            if p in seen:
                where.pop(p, None)
            else:
                seen.add(p)
                where[p] = s
        return {int(p): where[int(p)] for p in positions if int(p) in where}

    def slots_of(self, positions: Sequence[int], name: str) -> list[int]:
        """Live slots holding each absolute position.

        ValueError naming the first position that no live slot holds, or that several hold: an
        interior ``insert`` may give new entries positions its right neighbours already have (see
        :meth:`KVCache.apply`), and then "the entry at position p" is ambiguous — rather than pick one
        slot silently, position-addressed edits (``splice_positions``, ``append_from``) refuse.
        """
        pos = self.ledger.position
        where: dict[int, list[int]] = {}
        for s, r in enumerate(self.live):
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
        """Status of every ledger row, derived (rows are never edited): ``live`` if in the live map,
        else its last removal event (``deleted``/``replaced``/``superseded``/``evicted``/``moved``),
        else ``dropped``."""
        status = ["dropped"] * len(self.ledger)
        for r, ev in zip(self.events.row, self.events.event):
            if ev in _REMOVAL_EVENTS:
                status[r] = _REMOVAL_EVENTS[ev]
        for r in self.live:
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
