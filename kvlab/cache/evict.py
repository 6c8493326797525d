"""Eviction, RoPE re-rotation and INT8 demotion of cache entries (issue 9; seed 002, seed 003).

Each operation validates first, then edits storage (:mod:`.storage`), mirror (:mod:`.mirror`) and
attention statistics (:mod:`.stats`) in one call. Re-rotation (:func:`reposition`) moves entries
to new positions by rotating their post-RoPE keys (:mod:`.rope`); the mirror records the moved
entries as new ledger rows (events ``moved`` / ``moved_to``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .rope import rope_of


@dataclass(frozen=True)
class EvictReport:
    """What one :meth:`KVCache.evict` did: entries removed, entries re-rotated, length after,
    seconds spent compacting (gather of every layer + mirror) and re-rotating."""

    evicted: int
    moved: int
    length: int
    compact_s: float
    rotate_s: float


@torch.inference_mode()
def evict(cache, slots: Sequence[int], *, model=None, rerotate: bool = False,
          layers: Sequence[Sequence[int]] | None = None) -> EvictReport:
    """See :meth:`kvlab.cache.KVCache.evict`."""
    n = len(cache)
    if layers is not None:
        layers = [list(x) for x in layers]
        if len(layers) != cache.num_layers:
            raise ValueError(f"layers has {len(layers)} slot lists for a cache of {cache.num_layers} layers")
        if any(sorted(x) != sorted(layers[0]) for x in layers):
            raise ValueError("layers drops different slots on different layers; this cache keeps one live set "
                             "for all layers")
        slots = layers[0]
    slots = list(slots)
    for s in slots:
        if isinstance(s, bool) or not hasattr(s, "__index__"):
            raise ValueError(f"slots holds {s!r}; slots must be ints")
    slots = sorted(int(s) for s in slots)
    if len(set(slots)) != len(slots):
        raise ValueError("slots must be distinct")
    if slots and (slots[0] < 0 or slots[-1] >= n):
        raise ValueError(f"slots must lie in [0, {n}); got {slots[0]}..{slots[-1]}")
    if rerotate and model is None:
        raise ValueError("rerotate=True needs model= (its rotary embedding gives the rotation)")
    rope = rope_of(model) if rerotate else None
    t0 = time.perf_counter()
    if not slots:
        return EvictReport(0, 0, n, 0.0, 0.0)
    store, mirror = cache._store, cache._mirror
    if rerotate and store.n_int8:
        store.dequantize()
    mask = torch.ones(n, dtype=torch.bool)
    mask[torch.tensor(slots, dtype=torch.long)] = False
    keep_t = mask.nonzero().squeeze(1)                                              # (T',) kept slots
    store.keep(keep_t)
    # no failure point below but the mirror's pure-Python bookkeeping
    removed = [mirror.live[s] for s in slots]
    mirror.live = [r for r, k in zip(mirror.live, mask.tolist()) if k]
    if cache._stats is not None:
        cache._stats.keep(keep_t)
    tick = mirror.next_tick()
    for r in removed:
        mirror.events.append(tick, r, "evicted")
    t1 = time.perf_counter()
    moved = 0
    if rerotate and mirror.live:
        p0 = mirror.ledger.position[mirror.live[0]]
        moved = move_to(cache, rope, list(range(p0, p0 + len(mirror.live))), tick)
    cache.check()
    return EvictReport(len(slots), moved, len(cache), t1 - t0, time.perf_counter() - t1)


@torch.inference_mode()
def reposition(cache, model, positions: Sequence[int]) -> int:
    """See :meth:`kvlab.cache.KVCache.reposition`."""
    positions = [int(p) for p in positions]
    if len(positions) != len(cache):
        raise ValueError(f"positions has {len(positions)} entries for {len(cache)} slots")
    if len(set(positions)) != len(positions) or (positions and min(positions) < 0):
        raise ValueError("positions must be distinct non-negative ints")
    rope = rope_of(model)
    if cache.n_int8:
        cache._store.dequantize()
    tick = cache._mirror.next_tick()
    moved = move_to(cache, rope, positions, tick)
    cache.check()
    return moved


def move_to(cache, rope, positions: list[int], tick: int) -> int:
    """Rotate every live entry whose position differs from ``positions[slot]`` there (FP storage);
    new ledger rows for the moved entries; ``next_position = max(positions) + 1``."""
    mirror = cache._mirror
    led = mirror.ledger
    old = [led.position[r] for r in mirror.live]
    slots = [s for s, (a, b) in enumerate(zip(old, positions)) if a != b]
    if slots:
        cache._store.rotate(rope, slots, [positions[s] - old[s] for s in slots])
        for s in slots:
            r = mirror.live[s]
            new = led.append([led.token_id[r]], [positions[s]], led.writer[r], led.step[r])[0]
            mirror.events.append(tick, r, "moved")
            mirror.events.append(tick, new, "moved_to")
            mirror.live[s] = new
    if positions:
        cache.next_position = max(positions) + 1
    return len(slots)


@torch.inference_mode()
def quantize_older(cache, window: int, group: int = 64) -> int:
    """See :meth:`kvlab.cache.KVCache.quantize_older`."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1 (newest entries kept in FP)")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"group={group!r} must be an int >= 1 (entries per scale group)")
    m = len(cache) - cache.n_int8 - window
    if m < group:
        return 0
    cache._store.quantize_prefix(m)
    cache.check()
    return m
