"""The token mirror of a KV cache, in Python: the append-only ledger and the surgery event log (the ledger's
positions an :class:`~kvlab.cache.intlist.IntList`, which policies that rank by position read as a tensor).

Rows are never rewritten or reordered; a row's status (live, deleted, replaced, …) is derived from
the cache's live map and the event log (see :meth:`kvlab.cache.KVCache.ledger_status`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvlab.cache.intlist import IntList


@dataclass(frozen=True)
class Row:
    """One ledger row: a K/V entry as written."""

    index: int       # ledger row number
    token_id: int
    position: int    # absolute RoPE position the K/V was computed at
    writer: str      # which model wrote it ("teacher", "student", ...)
    step: int        # decode step at which it was written (-1: prompt prefill)


class Ledger:
    """Append-only record of every cache entry ever written (columnar, for speed)."""

    __slots__ = ("token_id", "position", "writer", "step")

    def __init__(self):
        self.token_id: list[int] = []
        self.position: IntList = IntList()        # read whole as a tensor by position-ranking policies
        self.writer: list[str] = []
        self.step: list[int] = []

    def __len__(self) -> int:
        return len(self.token_id)

    def append(self, token_ids: Sequence[int], positions: Sequence[int], writer: str, step: int) -> list[int]:
        start = len(self.token_id)
        self.token_id.extend(int(t) for t in token_ids)
        self.position.extend(int(p) for p in positions)
        self.writer.extend([writer] * len(token_ids))
        self.step.extend([int(step)] * len(token_ids))
        return list(range(start, len(self.token_id)))

    def copy_row(self, src: "Ledger", i: int) -> int:
        """Append a copy of ``src``'s row ``i`` (an entry whose K/V were copied over); its new index."""
        return self.append([src.token_id[i]], [src.position[i]], src.writer[i], src.step[i])[0]

    def truncate(self, n: int) -> None:
        """Roll back rows appended by a call that failed (only ever used for rows no one saw)."""
        for col in (self.token_id, self.position, self.writer, self.step):
            del col[n:]

    def row(self, i: int) -> Row:
        return Row(i, self.token_id[i], self.position[i], self.writer[i], self.step[i])

    def copy(self) -> "Ledger":
        new = Ledger()
        for name in self.__slots__:
            setattr(new, name, list(getattr(self, name)))
        new.position = self.position.copy()
        return new


class EventLog:
    """Append-only edit history: (tick, ledger row, event, layer). ``layer`` is -1 when the event
    concerns every layer, else the one layer whose live set it changed (per-layer eviction).
    Ledger rows themselves are never edited."""

    __slots__ = ("tick", "row", "event", "layer")

    def __init__(self):
        self.tick: list[int] = []
        self.row: list[int] = []
        self.event: list[str] = []
        self.layer: list[int] = []

    def __len__(self) -> int:
        return len(self.row)

    def append(self, tick: int, row: int, event: str, layer: int = -1) -> None:
        self.tick.append(int(tick))
        self.row.append(int(row))
        self.event.append(event)
        self.layer.append(int(layer))

    def extend(self, tick: int, rows: Sequence[int], event: str, layer: int = -1) -> None:
        """:meth:`append` of each of ``rows`` (ints), the same tick, event and layer."""
        k = len(rows)
        self.tick.extend([int(tick)] * k)
        self.row.extend(map(int, rows))
        self.event.extend([event] * k)
        self.layer.extend([int(layer)] * k)

    def copy(self) -> "EventLog":
        new = EventLog()
        new.tick, new.row, new.event, new.layer = list(self.tick), list(self.row), list(self.event), list(self.layer)
        return new

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"tick": self.tick, "row": self.row, "event": self.event, "layer": self.layer})
