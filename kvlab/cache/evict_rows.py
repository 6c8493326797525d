"""Per-layer evictions of several bank rows at once (a batch's ask): the same edits as one
:meth:`KVCache.evict` per row, with the per-row tensor work done once for all rows. Part of the cache module:
each row's tensors, live maps and statistics change in this one call, or nothing does.

A batch's rows asked at the same step by a ranked policy each drop ``k`` entries of every layer from layers of
``n`` entries (the budget's overflow: one per step asked at every step, the period's appends asked every few).
Row by row that is, per row, a keep matrix ``(L, m)``, a filling pass over its layers (or the layers' holes), a
gather of each statistic and the live maps' bookkeeping. :func:`evict_rows` validates every row first (nothing
changes when one row's slots are bad), then builds one keep tensor ``(R, L, m)``, fills all rows' layers in one
pass (:func:`~.buffer.fill_layers`; the bank queues every row's column moves and does them in one op per layer) and
gathers every row's statistics in one op per statistic (:func:`~.stats.keep_rows`); the live maps and the event
log stay per row and layer (Python lists). Rows that do not fit (INT8 entries, layers of different lengths or
drops, caches outside one bank) take :meth:`KVCache.evict`, after the same validation.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch

from kvlab.cache import evict as _evict
from kvlab.cache.buffer import fill_layers
from kvlab.cache.evict import EvictReport
from kvlab.cache.stats import keep_rows as keep_stats_rows


def _checked(caches, layers) -> list[list[list[int]]]:
    """Every row's per-layer slot lists, sorted and validated as :meth:`KVCache.evict` does (ValueError naming the
    row; nothing edited)."""
    if len(caches) != len(layers):
        raise ValueError(f"layers has {len(layers)} entries for {len(caches)} caches: one per-layer slot list each")
    out = []
    for r, (c, per) in enumerate(zip(caches, layers)):
        lives = c._mirror.lives
        per = list(per)
        if len(per) != len(lives):
            raise ValueError(f"layers[{r}] has {len(per)} slot lists for a cache of {len(lives)} layers")
        out.append([_evict._check_slots(x, len(live), f"layers[{r}][{i}]")
                    for i, (x, live) in enumerate(zip(per, lives))])
    return out


def _batchable(caches, drops) -> bool:
    """Whether ``caches`` (two or more) evict together: rows of one bank, FP only, every layer of every row holding
    the same ``n`` entries and dropping the same ``k >= 1``, attention statistics on all rows or none."""
    if len(caches) < 2:
        return False
    lay0 = caches[0]._store.layers[0] if caches[0]._store.layers else None
    bank = getattr(lay0, "bank", None)
    if bank is None:
        return False
    n, k = len(caches[0]._mirror.lives[0]), len(drops[0][0])
    if not k or len({c._stats is None for c in caches}) != 1 or len({id(c) for c in caches}) != len(caches):
        return False
    L = len(caches[0]._mirror.lives)
    for c, d in zip(caches, drops):
        lays = c._store.layers
        if c._store.n_int8 or len(lays) != L or len(d) != L or any(getattr(lay, "bank", None) is not bank or
                                                                   not lay.lazy for lay in lays):
            return False
        if any(len(x) != n for x in c._mirror.lives) or any(len(x) != k for x in d):
            return False
    return True


@torch.inference_mode()
def evict_rows(caches: Sequence, layers: Sequence[Sequence[Sequence[int]]]) -> list[EvictReport]:
    """``caches[r].evict((), layers=layers[r])`` for every ``r`` (per-layer evictions, no re-rotation), the same
    result, at once where the rows fit (see the module docstring). Every row is validated before any is edited.
    Each report's ``compact_s`` is the row's share of the time."""
    caches = list(caches)
    for c in caches:
        c._settle()
    drops = _checked(caches, layers)
    if not _batchable(caches, drops):
        return [c.evict((), layers=d) for c, d in zip(caches, drops)]
    t0 = time.perf_counter()
    R, L = len(caches), len(drops[0])
    n, k = len(caches[0]._mirror.lives[0]), len(drops[0][0])
    D = torch.tensor(drops, dtype=torch.long)                                        # (R, L, k) sorted per layer
    mask = torch.ones(R * L, n, dtype=torch.bool)
    mask.scatter_(1, D.view(R * L, k), False)
    keep = mask.nonzero()[:, 1].view(R, L, n - k)                                    # (R, L, m) kept slots
    sts = [c._stats for c in caches]
    # rows whose statistics wait in bank columns (or measured rows, evict.FILL_MEASURED) fill their dead columns
    # (evict.fills: as KVCache.evict decides)
    fills = [_evict.fills(st) for st in sts]
    lays = [lay for c in caches for lay in c._store.layers]
    if all(fills):
        fill_layers(lays, keep.view(R * L, n - k), per=L)                             # every row's layers at once
    else:
        for c, d, f, kp in zip(caches, drops, fills, keep.unbind(0)):
            if f:
                c._store.keep(list(kp.unbind(0)), d, fill=True)
            else:                                       # lazy FP layers (as checked): each marks its holes
                for lay, x in zip(c._store.layers, d):
                    lay.drop(x)
    # no failure point below but the mirrors' pure-Python bookkeeping
    for c, d, kp in zip(caches, drops, keep.unbind(0)):
        mirror = c._mirror
        lives = mirror.lives
        uniform_drop = all(x == d[0] for x in d) and mirror.uniform
        tick = mirror.next_tick()
        for i, (x, kpi) in enumerate(zip(d, kp.unbind(0))):
            if not uniform_drop or i == 0:
                live = lives[i]
                mirror.events.extend(tick, [live[s] for s in x], "evicted", -1 if uniform_drop else i)
            lives[i].drop_slots(x, kpi)
    if sts[0] is not None:
        keep_stats_rows(sts, keep)
    share = (time.perf_counter() - t0) / R
    for c in caches:
        c.check_lengths()
    return [EvictReport(k, 0, len(c), share, 0.0, (k,) * L) for c in caches]
