"""Continue generation from an existing (possibly edited) :class:`~kvlab.cache.KVCache`.

After surgery the cache's length no longer says where the sequence ends: positions come from the
mirror (``cache.next_position``, kept by :meth:`KVCache.apply`). :func:`continue_from` steps the
same machinery as :class:`kvlab.decode.Decoding` (``token_stats``, ``choose``, ``StepRecord``)
from such a cache, passing explicit positions through :meth:`KVCache.forward`.

Two ways in, matching the decode loop's "cache lags the last token by one" convention:

* ``last_token=y`` — ``y`` was emitted but its K/V are not in the cache yet (what
  ``Decoding`` leaves: ``d.cache`` + ``d.tokens[-1]``); it is written first, at ``next_position``;
* ``logits=z`` — the cache already holds everything and ``z`` are its next-token logits (e.g.
  ``TickReport.logits`` after a tick whose ``add`` appended ``y``).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from .cache import KVCache
from .decode import Sampling, StepRecord, _eos_ids, _sync, choose, token_stats


def continue_from(cache: KVCache, lm, last_token: int | None = None, *, logits: torch.Tensor | None = None,
                  max_new_tokens: int = 32, sampling: Sampling | None = None, writer: str = "teacher",
                  ignore_eos: bool = True, first_step: int = 1) -> Iterator[StepRecord]:
    """Yield one :class:`StepRecord` per new token, decoding ``lm`` on ``cache`` (edited in place).

    Arguments are checked here, before the first step. ``first_step`` numbers the records (and
    the ledger's ``step`` column) so a continued run can follow the original one.
    """
    if (last_token is None) == (logits is None):
        raise ValueError("pass exactly one of last_token (emitted, not yet in the cache) or logits "
                         "(the cache's next-token logits, e.g. TickReport.logits)")
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a kvlab KVCache, got {type(cache).__name__}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int")
    if not isinstance(first_step, int) or first_step < 1:
        raise ValueError(f"first_step={first_step!r} must be an int >= 1")
    sampling = sampling if sampling is not None else Sampling()
    if not isinstance(sampling, Sampling):
        raise ValueError("sampling must be a kvlab.Sampling(temperature=..., top_p=..., seed=...)")
    vocab = int(lm.model.get_input_embeddings().weight.shape[0])
    if last_token is not None and (isinstance(last_token, bool) or not isinstance(last_token, int)
                                   or not 0 <= last_token < vocab):
        raise ValueError(f"last_token={last_token!r} must be a token id in [0, {vocab})")
    if logits is not None and tuple(logits.shape) != (vocab,):
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected ({vocab},)")
    if last_token is None and not len(cache):
        raise ValueError("the cache is empty; pass last_token to start from a token")
    cache.check()
    return _steps(cache, lm, last_token, logits, max_new_tokens, sampling, writer, ignore_eos, first_step)


def _steps(cache, lm, prev, logits, n, sampling, writer, ignore_eos, first_step) -> Iterator[StepRecord]:
    gen = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    eos = _eos_ids(lm)
    elapsed = 0.0
    for k in range(n):
        step = first_step + k
        t0 = time.perf_counter()
        if logits is None or k > 0:
            logits = cache.forward(lm.model, [prev], writer=writer, step=step - 1)
        logp, ent, top1, margin = token_stats(logits)
        token_id = choose(logits, sampling, gen)
        _sync(lm.device)
        wall = time.perf_counter() - t0
        elapsed += wall
        prev = token_id
        yield StepRecord(step=step, token_id=token_id, token=lm.tokenizer.decode([token_id]),
                         position=cache.next_position, logprob=float(logp[token_id]), entropy_bits=ent,
                         top1_prob=top1, margin=margin, cache_len=len(cache), source=writer, refreshed=False,
                         evicted=0, wall_s=wall, elapsed_s=elapsed)
        if token_id in eos and not ignore_eos:
            return
