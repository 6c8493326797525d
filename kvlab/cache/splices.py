"""Copy edits between two caches of the same model geometry (refresh, seed 000) and cropping.

Each function validates everything (tokens, positions, geometry) on every layer before touching a
tensor, then edits the storage and the mirror together. Layers are handled one by one over their
own live sets: an entry a layer no longer holds (evicted there) is skipped on that layer. Every
source ledger row copied gets one new row (carrying the source's writer and step), shared by all
layers that hold it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvlab.cache.forward import rollback_append


def _copy_rows(cache, src, rows: Sequence[int]) -> dict[int, int]:
    """New ledger rows of ``cache`` copying ``src``'s ``rows`` (each once): ``{src row: new row}``."""
    led, sled = cache.ledger, src.ledger
    return {r: led.copy_row(sled, r) for r in dict.fromkeys(rows)}


@torch.inference_mode()
def splice_last(cache, src, k: int) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.splice_last`."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} must be a non-negative int (entries to splice)")
    if k == 0:
        return []
    mine_l, theirs_l = cache._mirror.lives, src._mirror.lives
    if len(mine_l) != len(theirs_l):
        raise ValueError(f"src has {src.num_layers} layers, this cache {cache.num_layers}")
    led, sled = cache.ledger, src.ledger
    for mine, theirs in zip(mine_l, theirs_l):
        if k > len(mine) or k > len(theirs):
            raise ValueError(f"k={k} exceeds cache lengths (this {len(mine)}, src {len(theirs)})")
        for a, b in zip(mine[-k:], theirs[-k:]):
            if (led.token_id[a], led.position[a]) != (sled.token_id[b], sled.position[b]):
                raise ValueError(f"splice_last: entries differ (token {led.token_id[a]}@{led.position[a]} vs "
                                 f"{sled.token_id[b]}@{sled.position[b]}); both caches must end on the same tokens")
    cache._store.check_geometry(src._store)
    new = _copy_rows(cache, src, [r for theirs in theirs_l for r in theirs[-k:]])
    for i, (mine, theirs) in enumerate(zip(mine_l, theirs_l)):
        n, m = len(mine), len(theirs)
        sk, sv = src._store.read_slots(i, range(m - k, m))                         # (1, H_kv, k, D)
        cache._store.write_slots(i, range(n - k, n), sk, sv)
        mine[-k:] = [new[r] for r in theirs[-k:]]
    return list(range(len(cache) - k, len(cache)))


@torch.inference_mode()
def splice_positions(cache, src, positions: Sequence[int]) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.splice_positions`."""
    positions = [int(p) for p in positions]
    if not positions:
        return []
    if len(set(positions)) != len(positions):
        raise ValueError("positions must be distinct")
    mirror, smirror = cache._mirror, src._mirror
    if len(mirror.lives) != len(smirror.lives):
        raise ValueError(f"src has {src.num_layers} layers, this cache {cache.num_layers}")
    missing = set(positions) - set(mirror.held(positions))
    if missing:
        mirror.slots_of([min(missing)], "this cache")          # raises, naming the position
    led, sled = cache.ledger, src.ledger
    plan = []                                                   # per layer: (my slots, src slots)
    pos = led.position
    for i in range(len(mirror.lives)):
        held = {pos[r] for r in mirror.lives[i]}
        mine_pos = [p for p in positions if p in held]            # this layer's share (evicted ones skipped)
        mine = mirror.slots_of(mine_pos, "this cache", layer=i)
        theirs = smirror.slots_of(mine_pos, "src", layer=i)
        for a, b in zip(mine, theirs):
            if led.token_id[mirror.lives[i][a]] != sled.token_id[smirror.lives[i][b]]:
                raise ValueError(f"splice_positions: token {led.token_id[mirror.lives[i][a]]} vs "
                                 f"{sled.token_id[smirror.lives[i][b]]} at position "
                                 f"{led.position[mirror.lives[i][a]]}; both caches must hold the same tokens there")
        plan.append((mine, theirs))
    cache._store.check_geometry(src._store)
    new = _copy_rows(cache, src, [smirror.lives[i][b] for i, (_, theirs) in enumerate(plan) for b in theirs])
    for i, (mine, theirs) in enumerate(plan):
        if mine:
            sk, sv = src._store.read_slots(i, theirs)                              # (1, H_kv, n, D)
            cache._store.write_slots(i, mine, sk, sv)
        for a, b in zip(mine, theirs):
            mirror.lives[i][a] = new[smirror.lives[i][b]]
    return plan[0][0]


@torch.inference_mode()
def append_from(cache, src, n: int) -> list[int]:
    """See :meth:`kvlab.cache.KVCache.append_from`."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n={n!r} must be a positive int (entries to append)")
    positions = list(range(cache.next_position, cache.next_position + n))
    smirror = src._mirror
    theirs_l = [smirror.slots_of(positions, "src", layer=i) for i in range(len(smirror.lives))]
    if len(cache):
        cache._store.check_geometry(src._store)
    before, n_rows = [len(x) for x in cache._mirror.lives], len(cache.ledger)
    try:
        new = _copy_rows(cache, src, [smirror.lives[i][b] for i, theirs in enumerate(theirs_l) for b in theirs])
        for i, theirs in enumerate(theirs_l):
            k, v = src._store.read_slots(i, theirs)                                # (1, H_kv, n, D)
            cache._store.append(i, k, v)
        mirror = cache._mirror
        mirror.set_layers(cache._store.num_layers)
        for live, theirs, slive in zip(mirror.lives, theirs_l, smirror.lives):
            live.extend(new[slive[b]] for b in theirs)
        if cache._stats is not None:
            cache._stats.set_layers(cache.num_layers, before[0], cache._store.device)
            cache._stats.append(n, None)
        cache.check()
    except BaseException:
        rollback_append(cache, before, n_rows)
        raise
    cache.next_position += n
    return list(range(before[0], len(cache)))


@torch.inference_mode()
def crop(cache, n: int) -> None:
    """See :meth:`kvlab.cache.KVCache.crop`."""
    if not isinstance(n, int) or not 0 <= n <= len(cache):
        raise ValueError(f"n={n!r} must be an int in [0, {len(cache)}]")
    if not cache._mirror.uniform:
        raise ValueError("crop(n) keeps the first n slots, which differ per layer after per-layer eviction; "
                         "evict by slot per layer instead (KVCache.evict(layers=...))")
    if n < cache.n_int8:
        cache._store.dequantize()
    lengths = [n] * max(1, cache.num_layers)
    cache._store.truncate(lengths)
    cache._mirror.truncate_layers(lengths)
    if cache._stats is not None and cache.num_layers:
        cache._stats.truncate(lengths)
