"""Copy edits between two caches of the same model geometry (refresh, seed 000) and cropping.

Each function validates everything (tokens, positions, geometry) before touching a tensor, then
edits the storage and the mirror together: the rewritten slots get new ledger rows carrying the
source's writer and step.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .forward import rollback_append


@torch.inference_mode()
def splice_last(cache, src, k: int) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.splice_last`."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be a non-negative int (entries to splice)")
    if k == 0:
        return []
    if k > len(cache) or k > len(src):
        raise ValueError(f"k={k} exceeds cache lengths (this {len(cache)}, src {len(src)})")
    mine, theirs = cache.live[-k:], src.live[-k:]
    led, sled = cache.ledger, src.ledger
    for a, b in zip(mine, theirs):
        if (led.token_id[a], led.position[a]) != (sled.token_id[b], sled.position[b]):
            raise ValueError(f"splice_last: entries differ (token {led.token_id[a]}@{led.position[a]} vs "
                             f"{sled.token_id[b]}@{sled.position[b]}); both caches must end on the same tokens")
    cache._store.check_geometry(src._store)
    n = len(cache)
    di = list(range(n - k, n))
    si = list(range(len(src) - k, len(src)))
    for i in range(cache.num_layers):
        sk, sv = src._store.read_slots(i, si)                                      # (1, H_kv, k, D)
        cache._store.write_slots(i, di, sk, sv)
    cache.live[-k:] = [led.copy_row(sled, b) for b in theirs]
    return di


@torch.inference_mode()
def splice_positions(cache, src, positions: Sequence[int]) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.splice_positions`."""
    positions = [int(p) for p in positions]
    if not positions:
        return []
    if len(set(positions)) != len(positions):
        raise ValueError("positions must be distinct")
    mine, theirs = cache._mirror.slots_of(positions, "this cache"), src._mirror.slots_of(positions, "src")
    led, sled = cache.ledger, src.ledger
    for a, b in zip(mine, theirs):
        if led.token_id[cache.live[a]] != sled.token_id[src.live[b]]:
            raise ValueError(f"splice_positions: token {led.token_id[cache.live[a]]} vs "
                             f"{sled.token_id[src.live[b]]} at position {led.position[cache.live[a]]}; "
                             "both caches must hold the same tokens there")
    cache._store.check_geometry(src._store)
    for i in range(cache.num_layers):
        sk, sv = src._store.read_slots(i, theirs)                                  # (1, H_kv, n, D)
        cache._store.write_slots(i, mine, sk, sv)
    for a, b in zip(mine, theirs):
        cache.live[a] = led.copy_row(sled, src.live[b])
    return mine


@torch.inference_mode()
def append_from(cache, src, n: int) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.append_from`."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n={n!r} must be a positive int (entries to append)")
    positions = list(range(cache.next_position, cache.next_position + n))
    theirs = src._mirror.slots_of(positions, "src")
    if len(cache):
        cache._store.check_geometry(src._store)
    before, n_rows = len(cache.live), len(cache.ledger)
    try:
        for i in range(src.num_layers):
            k, v = src._store.read_slots(i, theirs)                                # (1, H_kv, n, D)
            cache._store.append(i, k, v)
        cache.live.extend(cache.ledger.copy_row(src.ledger, src.live[b]) for b in theirs)
        if cache._stats is not None:
            cache._stats.append(n, cache.num_layers, None)
        cache.check()
    except BaseException:
        rollback_append(cache, before, n_rows)
        raise
    cache.next_position += n
    return list(range(before, len(cache)))


@torch.inference_mode()
def crop(cache, n: int) -> None:
    """See :meth:`kvlab.cache.KVCache.crop`."""
    if not isinstance(n, int) or not 0 <= n <= len(cache):
        raise ValueError(f"n={n!r} must be an int in [0, {len(cache)}]")
    if n < cache.n_int8:
        cache._store.dequantize()
    cache._store.truncate(n)
    del cache.live[n:]
    if cache._stats is not None:
        cache._stats.truncate(n)
