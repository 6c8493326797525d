"""Model forwards over a :class:`~kvlab.cache.KVCache`: append (prefill / decode step) and the probe.
Part of the cache module: a forward appends to tensors and live maps together; the probe leaves the cache as it was.

:func:`forward` runs the model over the cache's storage, then records the new entries in the
mirror and the attention statistics; on any error it rolls all three back, so the cache is as it
was. :func:`probe_last` re-runs the last entry as a batch on a throwaway view and changes nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvlab.cache import attn_fn
from kvlab.cache.mass import KWARG as MASS_KWARG
from kvlab.cache.mass import MassSink
from kvlab.core.compat import cache_kwarg


@torch.inference_mode()
def forward(cache, model, token_ids: Sequence[int] | torch.Tensor, *, writer: str, step: int = -1,
            positions: Sequence[int] | None = None, logits: str = "last", attention: bool = False) -> torch.Tensor:
    """See :meth:`kvlab.cache.KVCache.forward`."""
    if attention and cache._stats is None:
        raise ValueError("attention=True needs cache.track_attention(ema_decay) first")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
    n = ids.numel()
    if n == 0:
        raise ValueError("token_ids must hold at least one token")
    if logits not in ("last", "all"):
        raise ValueError(f"logits={logits!r} must be 'last' or 'all'")
    if positions is None:
        positions = range(cache.next_position, cache.next_position + n)
    positions = [int(p) for p in positions]
    if len(positions) != n:
        raise ValueError(f"positions has {len(positions)} entries for {n} tokens")
    device = next(model.parameters()).device
    store, mirror = cache._store, cache._mirror
    before = [len(x) for x in mirror.lives]
    n_rows = len(mirror.ledger)
    try:
        if ragged(store) or attention:
            attn_fn.use(model)          # each layer attends over its own length; the mass comes from it
        store.materialize()
        kwargs = dict(input_ids=ids.to(device).view(1, n),                                  # (1, n)
                      position_ids=torch.tensor([positions], device=device),               # (1, n)
                      **{cache_kwarg(model): store.hf}, use_cache=True, logits_to_keep=0 if logits == "all" else 1)
        if attention:                   # the attention function hands each layer's mass to the sink
            st = cache._stats
            sink = MassSink(st.window, st.below, st.query_decay)
            out = model(**kwargs, **{MASS_KWARG: sink})
            L = store.num_layers
            mass = [m[0] for m in sink.layers("mass", L)]                                  # L x (T_l,)
            low = [m[0] for m in sink.layers("low", L)] if st.below else None
            ema_mass = [m[0] for m in sink.layers("ema", L)] if st.query_decay is not None else None
        else:
            out = model(**kwargs)
            mass = low = ema_mass = None
        store.dematerialize()
        _record(cache, ids.tolist(), positions, writer, step, mass, low, before, ema_mass)
    except BaseException:
        store.dematerialize()
        rollback_append(cache, before, n_rows)
        raise
    cache.next_position = max(cache.next_position, max(positions) + 1)
    out_logits = out.logits[0]                                                             # (n or 1, V)
    return out_logits if logits == "all" else out_logits[-1]


def _record(cache, ids: list[int], positions: list[int], writer: str, step: int, mass, low, before: list[int],
            ema_mass=None) -> None:
    """The mirror and statistics side of an append whose K/V the storage already holds."""
    store, mirror = cache._store, cache._mirror
    rows = mirror.ledger.append(ids, positions, writer, step)
    mirror.set_layers(store.num_layers)
    mirror.extend(rows)
    if cache._stats is not None:
        cache._stats.set_layers(store.num_layers, before[0], store.device)
        cache._stats.append(len(ids), mass, low, ema_mass)
    cache.check_lengths()           # the new rows are valid by construction: lengths are what can slip


def commit_append(cache, ids: list[int], positions: list[int], writer: str, step: int, mass, low,
                  before: list[int], ema_mass=None) -> None:
    """Record ``ids`` (whose K/V a batched forward appended to ``cache``'s storage: every layer one
    longer than ``before``) in the mirror and statistics; on error undo the append, storage included."""
    n_rows = len(cache._mirror.ledger)
    try:
        _record(cache, ids, positions, writer, step, mass, low, before, ema_mass)
    except BaseException:
        rollback_append(cache, before, n_rows)
        raise
    cache.next_position = max(cache.next_position, max(positions) + 1)


def ragged(store) -> bool:
    """Layers hold different numbers of entries (then the model needs the ``"kvlab"`` attention function)."""
    lengths = store.layer_lengths()
    return bool(lengths) and min(lengths) != max(lengths)


def rollback_append(cache, lengths: list[int], n_rows: int) -> None:
    """Undo a failed append: layer ``i`` back to ``lengths[i]`` entries (one length: every layer) and
    the ledger to ``n_rows`` rows (rows no one saw)."""
    layers = max(cache._store.num_layers, len(lengths))
    lengths = lengths * layers if len(lengths) == 1 else lengths
    cache._store.truncate(lengths)
    cache._mirror.ledger.truncate(n_rows)
    cache._mirror.truncate_layers(lengths)
    if cache._stats is not None and len(cache._stats.data["acc"]) == len(lengths):
        cache._stats.truncate(lengths)


@torch.inference_mode()
def probe_last(cache, model, n_copies: int) -> torch.Tensor:
    """See :meth:`kvlab.cache.KVCache.probe_last`."""
    if isinstance(n_copies, bool) or not isinstance(n_copies, int) or n_copies < 1:
        raise ValueError(f"n_copies={n_copies!r} must be a positive int (batch of passes)")
    if not len(cache):
        raise ValueError("probe_last needs a non-empty cache (prefill first)")
    led = cache.ledger
    row = cache.live[-1]
    if any(not live or live[-1] != row for live in cache._mirror.lives):
        raise ValueError("probe_last needs the newest entry live on every layer")
    token, position = led.token_id[row], led.position[row]
    store = cache._store
    tmp = store.prefix_view([n - 1 for n in store.layer_lengths()], n_copies)
    if ragged(store):
        attn_fn.use(model)
    device = next(model.parameters()).device
    out = model(input_ids=torch.full((n_copies, 1), token, dtype=torch.long, device=device),  # (n, 1)
                position_ids=torch.full((n_copies, 1), position, dtype=torch.long, device=device),
                **{cache_kwarg(model): tmp}, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]                                                            # (n, V)
