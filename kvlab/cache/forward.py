"""Model forwards over a :class:`~kvlab.cache.KVCache`: append (prefill / decode step) and the probe.

:func:`forward` runs the model over the cache's storage, then records the new entries in the
mirror and the attention statistics; on any error it rolls all three back, so the cache is as it
was. :func:`probe_last` re-runs the last entry as a batch on a throwaway view and changes nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .attention import QueryCapture


@torch.inference_mode()
def forward(cache, model, token_ids: Sequence[int] | torch.Tensor, *, writer: str, step: int = -1,
            positions: Sequence[int] | None = None, logits: str = "last", attention: bool = False) -> torch.Tensor:
    """See :meth:`kvlab.cache.KVCache.forward`."""
    if attention and cache.attn is None:
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
    before = len(mirror.live)
    n_rows = len(mirror.ledger)
    nq = store.n_int8
    try:
        store.materialize()
        kwargs = dict(input_ids=ids.to(device).view(1, n),                                  # (1, n)
                      position_ids=torch.tensor([positions], device=device),               # (1, n)
                      past_key_values=store.hf, use_cache=True, logits_to_keep=0 if logits == "all" else 1)
        if attention:
            with QueryCapture(model) as cap:
                out = model(**kwargs)
            mass = cap.mass(lambda i: store.hf.layers[i].keys, n, window=cache._stats.window,
                            below=cache._stats.below)                                      # (L, T)
            low = cap.low
        else:
            out = model(**kwargs)
            mass = low = None
        store.dematerialize(nq)
        rows = mirror.ledger.append(ids.tolist(), positions, writer, step)
        mirror.live.extend(rows)
        if cache._stats is not None:
            cache._stats.append(n, store.num_layers, mass, low)
        cache.check()
    except BaseException:
        store.dematerialize(nq)
        rollback_append(cache, before, n_rows)
        raise
    cache.next_position = max(cache.next_position, max(positions) + 1)
    out_logits = out.logits[0]                                                             # (n or 1, V)
    return out_logits if logits == "all" else out_logits[-1]


def rollback_append(cache, length: int, n_rows: int) -> None:
    """Undo a failed append: back to ``length`` entries and ``n_rows`` ledger rows (rows no one saw)."""
    cache._store.truncate(length)
    cache._mirror.ledger.truncate(n_rows)
    del cache._mirror.live[length:]
    if cache._stats is not None:
        cache._stats.truncate(length)


@torch.inference_mode()
def probe_last(cache, model, n_copies: int) -> torch.Tensor:
    """See :meth:`kvlab.cache.KVCache.probe_last`."""
    if isinstance(n_copies, bool) or not isinstance(n_copies, int) or n_copies < 1:
        raise ValueError(f"n_copies={n_copies!r} must be a positive int (batch of passes)")
    if not len(cache):
        raise ValueError("probe_last needs a non-empty cache (prefill first)")
    led = cache.ledger
    row = cache.live[-1]
    token, position = led.token_id[row], led.position[row]
    tmp = cache._store.prefix_view(len(cache) - 1, n_copies)
    device = next(model.parameters()).device
    out = model(input_ids=torch.full((n_copies, 1), token, dtype=torch.long, device=device),  # (n, 1)
                position_ids=torch.full((n_copies, 1), position, dtype=torch.long, device=device),
                past_key_values=tmp, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]                                                            # (n, V)
