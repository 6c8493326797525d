"""Eviction, RoPE re-rotation and INT8 demotion of cache entries (seed 002 Conf-KV, seed 003 block eviction).
Part of the cache module: each operation changes a cache's tensors, live maps and statistics in one call, or
nothing.

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

from kvlab.cache.rope import rope_of

# Whether evictions of bank rows whose statistics wait in bank columns fill their dead columns (BufferLayer.drop's
# ``fill``: no holes read masked at every step, no compaction moving about half the row every few asks) instead of
# leaving holes. On since session 21: earlier A/Bs (docs/measured/fill_ab, session 18 on an Intel Xeon) compared the
# bench's median over periods, which passes over the compaction paid in one period of three; the periods' totals
# (bench evict --batch 8, 4,096 -> ~1,040, asked every 16, FILL on/off/on/off in one process on a 2-core AMD EPYC,
# ab_fill4_zen5.out) give H2O 1.057, 1.056 filled vs 1.109, 1.064 with holes, Scissorhands 1.078, 1.069 vs 1.106,
# 1.074, Conf-KV 1.055, 1.053 vs 1.070, 1.059; an in-process accounting of 13 periods (period_accounting) H2O 0.963
# vs 0.994. Only bank rows of a policy asked every N > 1 steps take this path; the studies' runs do not.
FILL = True
# Whether the other bank rows with attention statistics fill too: rows measured at their asked steps (a policy asked
# at every step, the bench's default). A one-query batched step reads their mass in column order and puts it in slot
# order before the statistics take it (kvlab.cache.batch); any other reader (a multi-token step, the capture's pass,
# a deferred replay, a read of keys / values) puts a permuted row back in order first. Off: at every step the fill's
# bookkeeping costs what the holes and their compaction cost (H2O, batch 8, 4,096 -> 1,024 on a 2-core AMD EPYC,
# session 25, docs/measured/period_accounting/every_step.py h2o 100 new,fillm, two runs: the edit 3.5 ms median
# filled vs 2.4-2.5 with holes, 3.7-3.8 vs 3.1-3.3 mean with the holes' compactions; the forwards alike; holes /
# filled 0.98 paired median, 1.01-1.02 summed). Filled rows have no compaction steps (about 35 ms every 46 steps with
# holes at that size): the switch is there for latency.
FILL_MEASURED = False


def fills(stats) -> bool:
    """Whether a bank row with attention statistics ``stats`` fills its evictions (:data:`FILL`,
    :data:`FILL_MEASURED`)."""
    return FILL and stats is not None and (stats.columns_deferred or FILL_MEASURED)


@dataclass(frozen=True)
class EvictReport:
    """What one :meth:`KVCache.evict` did: entries removed from layer 0 (``evicted_layers``: per
    layer), entries re-rotated, layer 0's length after, seconds spent compacting (every layer +
    mirror) and re-rotating."""

    evicted: int
    moved: int
    length: int
    compact_s: float
    rotate_s: float
    evicted_layers: tuple[int, ...] = ()


def _check_slots(slots, n: int, what: str) -> list[int]:
    if type(slots) is list and len(slots) == 1 and type(slots[0]) is int:   # one drop (asked every step): no set
        if not 0 <= slots[0] < n:
            raise ValueError(f"{what}: slots must lie in [0, {n}); got {slots[0]}..{slots[0]}")
        return list(slots)
    slots = list(slots)
    if not set(map(type, slots)) <= {int}:                # (plain ints, the usual case: no per-slot checks)
        for s in slots:
            if isinstance(s, bool) or not hasattr(s, "__index__"):
                raise ValueError(f"{what} holds {s!r}; slots must be ints")
        slots = [int(s) for s in slots]
    slots = sorted(slots)
    if len(set(slots)) != len(slots):
        raise ValueError(f"{what}: slots must be distinct")
    if slots and (slots[0] < 0 or slots[-1] >= n):
        raise ValueError(f"{what}: slots must lie in [0, {n}); got {slots[0]}..{slots[-1]}")
    return slots


@torch.inference_mode()
def evict(cache, slots: Sequence[int], *, model=None, rerotate: bool = False,
          layers: Sequence[Sequence[int]] | None = None) -> EvictReport:
    """See :meth:`kvlab.cache.KVCache.evict`."""
    mirror, store = cache._mirror, cache._store
    lives = mirror.lives
    if layers is None:
        drops = [_check_slots(slots, len(live), "slots") for live in lives]
    else:
        layers = list(layers)
        if len(layers) != len(lives):
            raise ValueError(f"layers has {len(layers)} slot lists for a cache of {len(lives)} layers")
        drops = [_check_slots(x, len(live), f"layers[{i}]") for i, (x, live) in enumerate(zip(layers, lives))]
    if rerotate and model is None:
        raise ValueError("rerotate=True needs model= (its rotary embedding gives the rotation)")
    uniform_drop = all(d == drops[0] for d in drops) and mirror.uniform
    if rerotate and not uniform_drop:
        _check_rerotate(mirror, drops)
    rope = rope_of(model) if rerotate else None
    t0 = time.perf_counter()
    if not any(drops):
        return EvictReport(0, 0, len(cache), 0.0, 0.0)
    if rerotate and store.int8 is not None:
        store.dequantize()
    keeps = None if uniform_drop else _keep_matrix(drops, lives)
    if keeps is None:
        keeps, memo = [], {}
        for d, live in zip(drops, lives):
            if not d:
                keeps.append(None)
                continue
            key = (len(live), tuple(d))
            if key not in memo:                # one kept-slot tensor per distinct (length, drops): shared by layers
                mask = torch.ones(len(live), dtype=torch.bool)
                mask[torch.tensor(d, dtype=torch.long)] = False
                memo[key] = mask.nonzero().squeeze(1)                            # (T_l',) kept slots
            keeps.append(memo[key])
    st = cache._stats
    # rows whose statistics wait in bank columns read their entries in any column order (a pooling row's step pools
    # in slot order, ColumnSink's ``slots``), and so do measured rows (a one-query batched step puts the mass in slot
    # order, FILL_MEASURED): their evictions fill the dead columns with the last survivors instead of leaving holes
    # (BufferLayer.drop; fills)
    store.keep(keeps, drops, fill=not rerotate and fills(st))
    # no failure point below but the mirror's pure-Python bookkeeping
    tick = mirror.next_tick()
    for i, d in enumerate(drops):
        if not d:
            continue
        if not uniform_drop or i == 0:
            live = lives[i]
            mirror.events.extend(tick, [live[s] for s in d], "evicted", -1 if uniform_drop else i)
        lives[i].drop_slots(d, keeps[i])        # d sorted: deleted from the back (C memmove); its row tensor follows
    if cache._stats is not None:
        cache._stats.keep(keeps)
    t1 = time.perf_counter()
    moved = 0
    if rerotate and mirror.live:
        p0 = mirror.ledger.position[mirror.live[0]]
        moved = move_to(cache, rope, list(range(p0, p0 + len(mirror.live))), tick)
    cache.check_lengths()
    return EvictReport(len(drops[0]), moved, len(cache), t1 - t0, time.perf_counter() - t1,
                       tuple(len(d) for d in drops))


def _keep_matrix(drops: list[list[int]], lives) -> list[torch.Tensor] | None:
    """Every layer the same length and dropping the same number of slots (a ranked policy's usual step): the kept
    slots of all layers as the rows of one ``(L, m)`` matrix, built at once. None otherwise (built per layer)."""
    n, k = len(lives[0]), len(drops[0])
    if not k or any(len(d) != k for d in drops) or any(len(live) != n for live in lives):
        return None
    L = len(drops)
    mask = torch.ones(L, n, dtype=torch.bool)
    mask[torch.arange(L).repeat_interleave(k), torch.tensor([s for d in drops for s in d], dtype=torch.long)] = False
    return list(mask.nonzero()[:, 1].view(L, n - k).unbind(0))                    # (m,) rows of one (L, m) matrix


def _check_rerotate(mirror, drops: list[list[int]]) -> None:
    """Per-layer drops with re-rotation: every layer's survivors move to the same consecutive positions
    (the next query has one position), so every layer must keep the same number of entries from the
    same first position."""
    after, first = set(), set()
    for d, live in zip(drops, mirror.lives):
        gone = set(d)
        kept = [s for s in range(len(live)) if s not in gone]
        after.add(len(kept))
        if kept:
            first.add(mirror.ledger.position[live[kept[0]]])
    if len(after) > 1 or len(first) > 1:
        raise ValueError("rerotate=True moves every layer's survivors to the same consecutive positions (the next "
                         "query has one position): every layer must keep the same number of entries from the same "
                         f"first position (kept {sorted(after)} entries from positions {sorted(first)})")


@torch.inference_mode()
def reposition(cache, model, positions: Sequence[int]) -> int:
    """See :meth:`kvlab.cache.KVCache.reposition`."""
    positions = [int(p) for p in positions]
    if len(positions) != len(cache):
        raise ValueError(f"positions has {len(positions)} entries for {len(cache)} slots")
    if len(set(positions)) != len(positions) or (positions and min(positions) < 0):
        raise ValueError("positions must be distinct non-negative ints")
    if not cache._mirror.uniform:
        raise ValueError("reposition needs one live set for all layers (the next query has one position)")
    rope = rope_of(model)
    if cache._store.int8 is not None:
        cache._store.dequantize()
    tick = cache._mirror.next_tick()
    moved = move_to(cache, rope, positions, tick)
    cache.check()
    return moved


def move_to(cache, rope, positions: list[int], tick: int) -> int:
    """On every layer, rotate each live entry whose position differs from ``positions[slot]`` there
    (FP storage; every layer holds ``len(positions)`` entries); one new ledger row per moved (row,
    new position), shared by the layers that move it alike; ``next_position = max(positions) + 1``.
    Returns layer 0's moved entries."""
    mirror = cache._mirror
    led = mirror.ledger
    made: dict[tuple[int, int], int] = {}
    moved = []
    for i, live in enumerate(mirror.lives):
        slots = [s for s, r in enumerate(live) if led.position[r] != positions[s]]
        moved.append(len(slots))
        if not slots:
            continue
        cache._store.rotate(i, rope, slots, [positions[s] - led.position[live[s]] for s in slots])
        for s in slots:
            key = (live[s], positions[s])
            if key not in made:
                r = live[s]
                made[key] = led.append([led.token_id[r]], [positions[s]], led.writer[r], led.step[r])[0]
                mirror.events.append(tick, r, "moved")
                mirror.events.append(tick, made[key], "moved_to")
            live[s] = made[key]
    if positions:
        cache.next_position = max(positions) + 1
    return moved[0] if moved else 0


@torch.inference_mode()
def quantize_older(cache, window: int, group: int | None = 64) -> int:
    """See :meth:`kvlab.cache.KVCache.quantize_older` (each layer by its own length; returns layer 0's
    count). ``group=None``: one scale per (head, channel) over the whole INT8 prefix (every entry
    older than the window joins it at once)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1 (newest entries kept in FP)")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise ValueError(f"group={group!r} must be an int >= 1 (entries per scale group) or None (one scale per "
                         "head and channel)")
    store = cache._store
    done = []
    least = 1 if group is None else group
    for i in range(store.num_layers):
        m = store.layer_len(i) - store.int8_len(i) - window
        if m >= least:
            store.quantize_prefix(i, m, per_channel=group is None)
        done.append(m if m >= least else 0)
    cache.check_lengths()
    return done[0] if done else 0
