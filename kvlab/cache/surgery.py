"""Cache surgery (seed 004, "Step 4"): one tick of delete / insert / replace_pair / add actions.
Part of the cache module: a tick changes tensors and live map together, or, failing after validation, rebuilds the
cache from its live map.

:func:`apply` validates the whole action list (:func:`~kvlab.cache.plan.plan_actions`), computes
the K/V of every new block over its original left context (reads only), then cuts storage and
live map by the same layout (:meth:`Storage.splice`), optionally re-rotates survivors to their
final positions, and runs the adds as one forward. Any failure after validation rebuilds the cache
from its pre-tick live map (no snapshot) and raises :class:`SurgeryError`. Semantics in
:meth:`kvlab.cache.KVCache.apply`.
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence

import torch

from kvlab.cache.evict import move_to
from kvlab.cache.plan import SPLICE_MODES, SurgeryError, TickPlan, TickReport, plan_actions
from kvlab.cache.rope import rope_of
from kvlab.core.compat import cache_kwarg


def _vocab_size(model) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def _no_fault(stage: str) -> None:
    return None


@torch.inference_mode()
def apply(cache, actions: Sequence[Mapping], model, *, writer: str, step: int = -1, splice: str = "gather",
          fault_hook: Callable[[str], None] | None = None, rerotate: bool = False) -> TickReport:
    """Execute an action list as one tick; tensors and live map are cut by the same layout.

    Actions (every position is a slot of the cache as it is *before* the tick):

    * ``{'action': 'delete', 'pos': s}`` — drop slot ``s``;
    * ``{'action': 'insert', 'pos': s, 'token_ids': [...]}`` — new tokens right before slot
      ``s`` (``s == len(cache)``: at the end, before any ``add``);
    * ``{'action': 'replace_pair', 'original_pos1': p1, 'original_pos2': p2, 'new_token_ids': [...]}``
      — drop ``p1 < p2``, put the new tokens where ``p1`` was (slots between stay, after them);
    * ``{'action': 'add', 'token_id': t}`` — append ``t`` (adds run last, in list order).

    The meaning is the seed's sequential algorithm: actions run in descending slot order
    (at one slot, the removal before the insert), a replace_pair as delete ``p2``, delete
    ``p1``, insert at ``p1``, then the adds. The whole list is validated first
    (:func:`~kvlab.cache.plan.plan_actions`: ranges, ``p1 < p2``, overlapping spans, vocabulary, cache == map
    length); an invalid list raises ``ValueError`` and changes nothing. Because descending
    order never moves a slot left of the current action, every inserted block sees the
    *original* left context ``[0, s)``; so the K/V of all blocks are computed first (reads
    only), then each layer is rebuilt with ONE ``torch.cat`` of kept runs and new blocks
    (``splice="per_row"``: the seed's naive per-row ``torch.cat`` sequence, kept for the
    benchmark), then the adds run as one forward over the edited cache.

    Positions (no-shift): surviving entries keep the RoPE position they were written at —
    nothing is re-rotated, the ledger is never rewritten, so deleting leaves a gap in
    positions. A block inserted at slot ``s`` gets consecutive positions starting right
    after its left neighbour's (``positions[s-1] + 1``; 0 at slot 0); at the end
    (``s == len``) it starts at ``next_position``, exactly where decoding would put it, so
    an insert at the end equals decoding those tokens. Positions of a long interior insert
    may reach or pass those of its right neighbours (RoPE sees only relative distance);
    ``next_position`` becomes ``max(next_position, newest + 1)``, so decoding continues
    above every live position.

    Positions with ``rerotate=True`` (final positions): entries left of the first edited slot
    keep their positions; from the first edit on, every entry of the edited cache gets
    consecutive positions (left neighbour + 1) — new blocks are computed at those final
    positions (over the original left context ``[0, s)``), and surviving right neighbours are
    moved there by rotating their post-RoPE keys by the delta (:func:`~kvlab.cache.evict.reposition`, one
    operation: keys rotated, new ledger rows, events ``moved``). So an interior insert no
    longer collides with its right neighbour, and a delete closes its gap. ``next_position``
    becomes the last entry's position + 1 before the adds run.

    INT8 entries (:meth:`KVCache.quantize_older`) are dequantized before the tick; surgery edits a
    full-precision cache. Attention statistics follow their entries (zeros for new ones).

    Failure after validation (OOM, a model error, ``fault_hook``): no VRAM snapshot is
    kept; the live map is reset to its pre-tick content (a list of ints, the mirror) and
    every layer is recomputed from those tokens at their recorded positions, then
    :class:`SurgeryError` is raised. The tick is all-or-nothing; cache and map agree.

    ``fault_hook`` is for tests: it is called with a stage name (``"compute:j"``,
    ``"splice:i"``, ``"map"``, ``"add"``) before each stage; raising there injects a failure.
    Returns a :class:`TickReport` (``logits``: next-token logits after the last ``add``).
    """
    if splice not in SPLICE_MODES:
        raise ValueError(f"splice={splice!r} must be one of {SPLICE_MODES}")
    if not isinstance(writer, str) or not writer:
        raise ValueError(f"writer={writer!r} must be a non-empty string naming the model that computes new K/V")
    if not isinstance(step, int) or isinstance(step, bool):
        raise ValueError(f"step={step!r} must be an int (decode step; -1 for none)")
    try:
        cache.check()
    except AssertionError as e:
        raise ValueError(f"cache and live map disagree before the tick ({e}); rebuild the cache first") from e
    if not cache._mirror.uniform:
        raise ValueError("surgery addresses slots shared by all layers, but this cache's layers hold different "
                         "entries (per-layer eviction); run surgery before per-layer eviction")
    geo = cache.geometry()
    if geo:
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        if getattr(cfg, "num_hidden_layers", geo["layers"]) != geo["layers"]:
            raise ValueError(f"model has {cfg.num_hidden_layers} layers, the cache {geo['layers']}; surgery needs "
                             "the model that wrote this cache (or one with the same KV geometry)")
        mdtype = str(next(model.parameters()).dtype)
        if mdtype != geo["dtype"]:
            raise ValueError(f"model dtype {mdtype} differs from the cache's {geo['dtype']}; load the model in "
                             f"{geo['dtype']}")
    plan = plan_actions(actions, len(cache), _vocab_size(model))
    rope = rope_of(model) if rerotate else None
    if cache._store.int8 is not None:
        cache._store.dequantize()
    final = _final_positions(cache, plan) if rerotate else None
    hook = fault_hook if fault_hook is not None else _no_fault
    tick = cache._mirror.next_tick()
    pre_live, pre_next = list(cache.live), cache.next_position
    t = {"compute": 0.0, "splice": 0.0, "add": 0.0}
    nbytes = 0
    logits = None
    try:
        t0 = time.perf_counter()
        blocks = []                                   # per block: (positions, [(K, V) per layer])
        for j, b in enumerate(plan.blocks):
            hook(f"compute:{j}")
            pos = (final[1][j] if final is not None
                   else _block_positions(cache, b.anchor, len(b.token_ids), plan.length))
            blocks.append((pos, _kv_over_prefix(cache, model, b.anchor, b.token_ids, pos)))
        t1 = time.perf_counter()
        if plan.deleted or plan.blocks:
            nbytes = _splice(cache, plan, blocks, writer, step, tick, hook, splice)
            if final is not None:
                hook("rerotate")
                move_to(cache, rope, final[0], tick)
        t2 = time.perf_counter()
        if plan.adds:
            hook("add")
            logits = cache.forward(model, plan.adds, writer=writer, step=step, logits="last")
            for r in cache.live[-len(plan.adds):]:
                cache.events.append(tick, r, "added")
        t3 = time.perf_counter()
        t = {"compute": t1 - t0, "splice": t2 - t1, "add": t3 - t2}
    except BaseException as e:   # incl. KeyboardInterrupt: never leave cache and map out of step
        _rebuild(cache, model, pre_live, pre_next, writer, step, tick)
        if not isinstance(e, Exception):
            raise
        raise SurgeryError(f"tick {tick} failed ({type(e).__name__}: {e}); the cache was rebuilt from the "
                           f"live map's {len(pre_live)} tokens and the tick discarded") from e
    return TickReport(tick=tick, actions=len(plan.actions), deleted=len(plan.deleted),
                      inserted=sum(len(b.token_ids) for b in plan.blocks), added=len(plan.adds),
                      length=len(cache), next_position=cache.next_position, splice=splice,
                      splice_bytes=nbytes, compute_s=t["compute"], splice_s=t["splice"], add_s=t["add"],
                      logits=logits)


def _final_positions(cache, plan: TickPlan) -> tuple[list[int], list[list[int]]]:
    """Final positions for a rerotating tick: per slot of the edited cache (before adds), per block."""
    pos = cache.positions
    out: list[int] = []
    per_block: dict[int, list[int]] = {}
    shifted, expected = False, 0
    for kind, a, b in plan.layout:
        if kind == "old":
            if not shifted and a == expected:
                out.extend(pos[a:b])
                expected = b
                continue
            shifted = True
            n = b - a
        else:
            shifted = True
            n = len(plan.blocks[a].token_ids)
        start = out[-1] + 1 if out else 0
        new = list(range(start, start + n))
        out.extend(new)
        if kind == "new":
            per_block[a] = new
    return out, [per_block[j] for j in range(len(plan.blocks))]


def _block_positions(cache, anchor: int, n: int, length: int) -> list[int]:
    if anchor == length:
        start = cache.next_position
    elif anchor == 0:
        start = 0
    else:
        start = cache.ledger.position[cache.live[anchor - 1]] + 1
    return list(range(start, start + n))


def _kv_over_prefix(cache, model, s: int, token_ids: Sequence[int], positions: list[int]):
    """K/V of ``token_ids`` at ``positions`` attending to slots ``[0, s)``; ``cache`` is only read."""
    tmp = cache._store.prefix_view([s] * cache.num_layers)
    device = next(model.parameters()).device
    n = len(token_ids)
    model(input_ids=torch.tensor([list(token_ids)], device=device),               # (1, n)
          position_ids=torch.tensor([positions], device=device),                  # (1, n)
          **{cache_kwarg(model): tmp}, use_cache=True, logits_to_keep=1)
    return [(lay.keys[:, :, -n:, :], lay.values[:, :, -n:, :]) for lay in tmp.layers]  # (1, H_kv, n, D)


def _splice(cache, plan: TickPlan, blocks, writer: str, step: int, tick: int, hook, mode: str) -> int:
    """The coupled edit: every layer's K and V and the live map, by the same plan. Returns bytes written."""
    nbytes = cache._store.splice(plan, blocks, hook, mode)
    hook("map")
    mirror = cache._mirror
    mirror.set_layers(cache._store.num_layers)      # an empty cache's first layers come from the blocks
    if cache._stats is not None:
        idx = plan.apply_to_list(list(range(plan.length)), [[-1] * len(b.token_ids) for b in plan.blocks])
        cache._stats.remap(idx)
    new_rows = []
    for b, (pos, _) in zip(plan.blocks, blocks):
        new_rows.append(mirror.ledger.append(b.token_ids, pos, writer, step))
    removed = {s: mirror.live[s] for s in plan.deleted}
    mirror.live = plan.apply_to_list(mirror.live, new_rows)
    for s in sorted(removed):
        mirror.events.append(tick, removed[s], plan.deleted[s])
    for b, rows in zip(plan.blocks, new_rows):
        for r in rows:
            mirror.events.append(tick, r, "inserted" if b.kind == "insert" else "replacement")
    if new_rows:
        cache.next_position = max(cache.next_position, max(p for pos, _ in blocks for p in pos) + 1)
    cache.check()
    return nbytes


def _rebuild(cache, model, live: list[int], next_position: int, writer: str, step: int, tick: int) -> None:
    """Recompute every layer from the tokens of ``live`` at their recorded positions (no snapshot)."""
    mirror = cache._mirror
    led = mirror.ledger
    tokens = [led.token_id[r] for r in live]
    positions = [led.position[r] for r in live]
    stale = list(dict.fromkeys(live + mirror.live))
    cache._store.clear()
    mirror.live = []
    cache.next_position = next_position
    if cache._stats is not None:        # the history of the rebuilt entries is not recoverable: zeros
        cache._stats.truncate([0] * len(cache._stats.data["acc"]))
    if tokens:
        try:
            cache.forward(model, tokens, writer=writer, step=step, positions=positions)
        except Exception as e:      # forward rolled itself back: the cache is empty and consistent
            raise SurgeryError(f"tick {tick} failed and so did the rebuild ({type(e).__name__}: {e}); the cache "
                               f"is now empty; its tokens were {tokens} at positions {positions}") from e
    for r in stale:
        mirror.events.append(tick, r, "superseded")
    for r in mirror.live:
        mirror.events.append(tick, r, "rebuilt")
    cache.check()
