"""A list of ints that keeps an ``int64`` tensor of itself between reads: the live maps (slot -> ledger row) and the
ledger's positions. Part of the cache module's mirror; it holds no cache tensor.

An eviction policy that ranks by position (Conf-KV's recency) reads every live slot's position at every step, per
row and layer. Converting a Python list to a tensor costs about 70 ns per entry: at batch 8, 30 layers and 2,048
live entries that is most of Conf-KV's decision time. An :class:`IntList` converts once and then follows its edits:

* appends (``append``, ``extend``, ``+=``: the decode loop's only edit of a step) leave the tensor a valid prefix;
  the next :meth:`IntList.tensor` converts just the new tail;
* :meth:`IntList.drop_slots` (eviction) removes slots and gathers the tensor's kept entries in the same call;
* every other edit (item or slice assignment, ``del``, ``insert``, ``pop``, ``remove``, ``clear``, ``sort``,
  ``reverse``, ``*=``) drops the tensor and bumps :attr:`IntList.version`, so a reader holding an older snapshot
  knows it can no longer take the tensor's prefix (:class:`kvlab.cache.mirror.LivePositions`).

The tensor is never edited in place (each update makes a new one), so a reader may keep the one it got.

A snapshot of the list (:class:`kvlab.cache.mirror.LivePositions`, an eviction view's live positions) holds the list
and its length, not a copy: the list hands each live snapshot its own copy of the prefix just before an edit other
than an append (:meth:`IntList.watch`). A batch evicting at every step takes 240 snapshots of about a thousand
entries per step; copied at once, those lists were most of what Python's garbage collector traversed (about 1 ms per
step at batch 8), while a view released before the edit (the decode loop's and the benchmarks' order) costs no copy.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import torch


class IntList(list):
    """A ``list`` of ints with a cached ``(len,)`` int64 tensor of itself (module docstring)."""

    _t: torch.Tensor | None = None       # a tensor of self[:len(_t)], or None
    version: int = 0                     # edits other than appends (and drop_slots)

    def _edit(self) -> None:
        self._release()
        self._t = None
        self.version += 1

    def watch(self, snap) -> None:
        """``snap`` reads this list's first ``snap._n`` entries until an edit other than an append: before that edit
        the list calls ``snap._detach(self)`` (the snapshot copies its prefix) if ``snap`` is still alive."""
        w = self.__dict__.get("_snaps")
        if w is None:
            self._snaps = w = []
        elif len(w) >= self.__dict__.get("_snaps_cap", 64):   # snapshots no edit followed: keep the live ones (and
            w[:] = [r for r in w if r() is not None]        # prune again only once as many more came: amortized)
            self._snaps_cap = max(64, 2 * len(w))
        w.append(weakref.ref(snap))

    def __getstate__(self):                         # (pickling, copy: the snapshots' weak references stay)
        d = dict(self.__dict__)
        d.pop("_snaps", None)
        d.pop("_snaps_cap", None)
        return d

    def _release(self) -> None:
        """Before an edit other than an append: every live snapshot copies its prefix (:meth:`watch`)."""
        w = self.__dict__.get("_snaps")
        if w:
            for r in w:
                snap = r()
                if snap is not None:
                    snap._detach(self)
            w.clear()

    def __setitem__(self, i, v):
        self._edit()
        super().__setitem__(i, v)

    def __delitem__(self, i):
        self._edit()
        super().__delitem__(i)

    def __imul__(self, k):
        self._edit()
        return super().__imul__(k)

    def insert(self, i, v):
        self._edit()
        super().insert(i, v)

    def pop(self, *a):
        self._edit()
        return super().pop(*a)

    def remove(self, v):
        self._edit()
        super().remove(v)

    def clear(self):
        self._edit()
        super().clear()

    def sort(self, *a, **k):
        self._edit()
        super().sort(*a, **k)

    def reverse(self):
        self._edit()
        super().reverse()

    @property
    def tensor_len(self) -> int:
        """How many leading entries the cached tensor covers (0: none cached): :meth:`tensor` converts the rest."""
        return 0 if self._t is None else int(self._t.shape[0])

    def tensor(self) -> torch.Tensor:
        """The whole list as an int64 ``(len,)`` tensor (CPU): the cached one, extended by the appended tail."""
        t, n = self._t, len(self)
        if t is None or t.shape[0] > n:
            t = torch.tensor(self, dtype=torch.int64) if n else torch.zeros(0, dtype=torch.int64)
        elif t.shape[0] < n:
            t = torch.cat([t, torch.tensor(self[t.shape[0]:], dtype=torch.int64)])
        self._t = t
        return t

    @staticmethod
    def tensors(lists: Sequence["IntList"]) -> torch.Tensor:
        """:meth:`tensor` of several equally long lists as the rows of one int64 ``(G, len)`` tensor. When their
        cached tensors are equally long (a batch's live maps after the same edits and appends), the cached parts are
        stacked and the appended tails converted together, three ops for all of them instead of a conversion per
        list; each list then keeps its row (a view, never edited in place) as its tensor."""
        n = len(lists[0])
        k = lists[0].tensor_len
        if any(len(x) != n or x.tensor_len != k for x in lists) or k == 0 or k > n:
            return torch.stack([x.tensor() for x in lists]) if lists else torch.zeros(0, n, dtype=torch.int64)
        if k == n:
            out = torch.stack([x._t for x in lists])                                        # (G, n)
        else:
            tail = torch.tensor([x[k:] for x in lists], dtype=torch.int64)                  # (G, n - k) appended
            out = torch.cat([torch.stack([x._t for x in lists]), tail], 1)                  # (G, n)
        for x, row in zip(lists, out.unbind(0)):
            x._t = row
        return out

    def drop_slots(self, slots: Sequence[int], kept: torch.Tensor | None = None) -> None:
        """Delete the entries at ``slots`` (sorted, distinct). ``kept``: the remaining indices into the list before
        the call (sorted, ``(len - len(slots),)``); with it a cached tensor that covers the whole list follows by one
        gather, without it the tensor is dropped."""
        self._release()
        t = self._t
        whole = t is not None and t.shape[0] == len(self)
        for s in reversed(slots):                       # from the back: O(len) memmove each, in C
            list.__delitem__(self, s)
        self.version += 1
        self._t = (t.index_select(0, kept.to(t.device)) if whole and kept is not None
                   and int(kept.shape[0]) == len(self) else None)

    def copy(self) -> "IntList":
        new = IntList(self)
        new._t = self._t                                # never edited in place: safe to share
        return new


def int_list(x) -> IntList:
    """``x`` as an :class:`IntList` (an IntList is copied with its tensor; anything else is listed)."""
    return x.copy() if isinstance(x, IntList) else IntList(x)
