"""The eviction side of the decode loop: attention tracking for the policy and the evict phase, as
:class:`EvictPhases`, a mixin that :class:`kvlab.decode.Decoding` inherits (these methods read and set its
state). The policy decides (:mod:`kvlab.decode.protocols`); the cache acts (``KVCache.evict``)."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from kvlab.cache import KVCache
from kvlab.cache.attention import attention_modules
from kvlab.cache.deferred import defers
from kvlab.cache.inputs import LayerInputs
from kvlab.decode.protocols import EvictView, evict_attr, evict_due, measures_at
from kvlab.decode.records import Signals, StepRecord


class EvictPhases:
    """Attention tracking and phase 5 (evict) of :class:`kvlab.decode.Decoding`."""

    @property
    def _needs_attention(self) -> bool:
        ev = self.config.evict
        return ev is not None and bool(evict_attr(ev, "needs_attention"))

    @property
    def _defer_attention(self) -> bool:
        """A policy asked only every N-th step (``every`` > 1) that measures attention: a batched decode step keeps
        its queries and the statistics are computed when the policy next reads them (:mod:`kvlab.cache.deferred`;
        the same numbers as measuring every step) on the devices :func:`kvlab.cache.deferred.defers` names
        (CPU and CUDA: the A/B is in its comment)."""
        return self._needs_attention and evict_attr(self.config.evict, "every") > 1 and defers(getattr(self, "_device", None) or self.decoder.device)

    def _measures_at(self, step: int) -> bool:
        """Whether this row's forward at ``step`` measures attention (:func:`~kvlab.decode.protocols.measures_at`)."""
        return measures_at(self.config.evict, step, self.first_step)

    def _settles_at(self, step: int) -> bool:
        """Whether this row's deferred statistics are read at ``step`` (its policy is asked then): a batched step
        settles such rows together first (:func:`kvlab.cache.deferred.settle_rows`)."""
        return self._defer_attention and len(self.cache) > 0 and evict_due(self.config.evict, step, self.first_step)

    def _track(self, cache: KVCache) -> None:
        if self._needs_attention:
            ev = self.config.evict
            cache.track_attention(evict_attr(ev, "ema_decay"), window=evict_attr(ev, "attention_window"),
                                  pool=evict_attr(ev, "attention_pool"), below=evict_attr(ev, "attention_below"),
                                  ema_prefill=evict_attr(ev, "ema_prefill"))

    def _evict(self, rec: StepRecord, logits: torch.Tensor) -> StepRecord:
        """Phase 5: the eviction policy's decision, applied by the cache (``KVCache.evict``), then
        INT8 storage of older entries if the policy asks (the loop records the cache after it)."""
        view = self._evict_view(rec, logits)
        if view is None:
            return rec
        decision = self.config.evict.keep(view)
        del view                                        # released before the edit: its live maps need no copy
        return self._apply_evict(rec, decision)

    def _evict_view(self, rec: StepRecord, logits: torch.Tensor) -> EvictView | None:
        """The view the eviction policy decides from at this step (None: no policy, an empty cache, or a step the
        policy is not asked at: its ``every``)."""
        cache, policy = self.cache, self.config.evict
        if policy is None or not len(cache) or not evict_due(policy, rec.step, self.first_step):
            return None
        sp = self.config.sampling
        return evict_view(cache, rec.step, rec, int(logits.shape[-1]), logits=logits,
                          temperature=float(sp.temperature), top_p=float(sp.top_p), first=rec.step == self.first_step,
                          **self._kv_access(policy))

    def _apply_evict(self, rec: StepRecord, decision, *applied) -> StepRecord:
        """The cache's side of the policy's ``decision`` (a Keep) and its signals in the record. ``applied``: the
        edit's report when a batched step already applied it (:func:`apply_keep_rows`)."""
        evicted = 0
        signals = rec.signals
        rep = applied[0] if applied else apply_keep(self.cache, decision, self.decoder.model)
        if rep is not None:
            evicted = rep.evicted
        if decision.signals():
            signals = Signals({**signals.to_dict(), **decision.signals()})
        return replace(rec, evicted=evicted, signals=signals)

    def _kv_access(self, policy) -> dict:
        """``EvictView.kv`` / ``modules`` for a policy that ``needs_kv`` (read-only copies, per layer)."""
        if not evict_attr(policy, "needs_kv"):
            return {}
        out = {"kv": self.cache.kv, "modules": tuple(attention_modules(self.decoder.model))}
        if self._inputs is not None:
            out["inputs"] = self._inputs.layer
        return out


def prepare_evict(policy, model) -> LayerInputs | None:
    """Before a run's first forward: the eviction policy's ``prepare(model)`` (optional; kvpress's
    ``post_init_from_model``), and, when it ``needs_inputs``, the :class:`~kvlab.cache.inputs.LayerInputs` the
    loop captures for it (its ``inputs_window``; decode steps too when it ``needs_decode_inputs``)."""
    if policy is None:
        return None
    prepare = evict_attr(policy, "prepare")
    if callable(prepare):
        prepare(model)
    if not evict_attr(policy, "needs_inputs"):
        return None
    return LayerInputs(window=evict_attr(policy, "inputs_window"), decode=bool(evict_attr(policy, "needs_decode_inputs")))


def evict_view(cache: KVCache, step: int, record, vocab_size: int, **extra) -> EvictView:
    """The :class:`EvictView` a policy decides from at ``step`` (the loop's phase 5 and the eviction
    benchmarks build it here): the cache's per-layer positions and attention statistics (a statistic the cache
    holds as one ``(L, T)`` matrix as that matrix: :func:`~kvlab.eviction.ranked.layer_rows`), ``record``
    (the step's signals), ``extra`` (logits, sampling, ``kv`` access)."""
    lp = cache.live_positions()
    return EvictView(step=step, length=len(cache), positions=lp[0], record=record, vocab_size=vocab_size,
                     num_layers=cache.num_layers, attn=cache.layer_attn(matrix=True), layer_positions=lp, **extra)


def apply_keep_rows(caches, decisions, model) -> list:
    """:func:`apply_keep` for the rows of a batch asked at the same step: the rows whose decisions evict without
    re-rotation edit together (:func:`kvlab.cache.evict_rows.evict_rows`: validated first, then one pass for all
    rows where they fit), then each row's INT8 demotion if asked. The same caches as :func:`apply_keep` row by row.
    Returns each row's :class:`~kvlab.cache.evict.EvictReport` (None when nothing was evicted)."""
    from kvlab.cache.evict_rows import evict_rows

    reps: list = [None] * len(caches)
    idx, drops, turned = [], [], []
    for r, (c, d) in enumerate(zip(caches, decisions)):
        per = d.dropped_layers(c.layer_lengths())
        if d.rerotate:
            turned.append((r, per))
            continue
        if per is None:
            drop = d.dropped(len(c))
            per = [drop] * c.num_layers if drop else None
        if per is not None and any(per):
            idx.append(r)
            drops.append(per)
    if idx:
        for r, rep in zip(idx, evict_rows([caches[r] for r in idx], drops)):
            reps[r] = rep
    for r, per in turned:                               # re-rotating rows: each its own (KVCache.evict)
        c, d = caches[r], decisions[r]
        if d.dropped(len(c)) or (per is not None and any(per)):
            reps[r] = c.evict(d.dropped(len(c)), model=model, rerotate=True, layers=per)
    for c, d in zip(caches, decisions):
        if d.int8_window is not None:
            c.quantize_older(d.int8_window, d.int8_group)
    return reps


def apply_keep(cache: KVCache, decision, model, timing: dict | None = None):
    """The cache's side of phase 5: remove every entry ``decision`` (a ``Keep``) does not keep
    (``KVCache.evict``, per layer when it decides per layer), then INT8 storage of older entries if it
    asks. Returns the :class:`~kvlab.cache.evict.EvictReport` (None when nothing was evicted).
    ``timing``: gets ``compact`` and ``int8`` seconds (the benchmarks' phases)."""
    t0 = time.perf_counter()
    drop = decision.dropped(len(cache))
    per_layer = decision.dropped_layers(cache.layer_lengths())
    rep = None
    if drop or (per_layer is not None and any(per_layer)):
        rep = cache.evict(drop, model=model, rerotate=decision.rerotate, layers=per_layer)
    t1 = time.perf_counter()
    if decision.int8_window is not None:
        cache.quantize_older(decision.int8_window, decision.int8_group)
    if timing is not None:
        timing["compact"], timing["int8"] = t1 - t0, time.perf_counter() - t1
    return rep
