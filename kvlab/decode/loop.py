"""The decode loop: one generator, one frozen :class:`StepRecord` per token. It edits caches only through
:mod:`kvlab.cache`, asks policies (which decide, never mutate) and probes what to do, and writes no files.

Modes (seed 000, "The OverFill Algorithm"):

* ``teacher``  — the teacher prefills the prompt and decodes every token.
* ``student``  — the student prefills and decodes.
* ``overfill`` — the teacher prefills the prompt (``C_0 = Prefill_T(x)``); its prefill logits give
  the first token; the student decodes every later token on a copy of that cache.

Step ``t`` (1-based) picks ``y_t`` from logits computed over ``x, y_<t``: at step 1 those are the
prefill's last logits, at step ``t > 1`` the decoder's forward on ``y_{t-1}``, which appends
``y_{t-1}``'s K/V. So right after ``y_t`` is emitted, the decoding cache holds ``L + t - 1``
entries — it lags the last emitted token by one entry. The loop owns positions: ``y_{t-1}`` is
written at position ``L + t - 2`` taken from the cache's ``next_position``, never from its length.

Refresh (overfill only; seed 000 "KV Cache Refresh"). ``DecodeConfig.refresh`` is a policy (see
:mod:`kvlab.decode.protocols` for the protocol, :mod:`kvlab.refresh.policies` for Periodic / EntropyGate / ProbeKL /
Speculative). After ``y_t`` is chosen the loop runs the policy's probe if one is due, then asks
``policy.should_refresh(record)``. A refresh at step ``t`` (never after the last step):

1. **Teacher, on its own cache.** The teacher cache holds ``x, y_≤s`` (``s`` = its sync point: the
   last refresh, or a probe that caught it up). It prefills only ``Δ = y_{s+1..t}`` — which
   includes ``y_t`` — and now holds ``x, y_≤t``; its last logits are ``p_T(· | x, y_≤t)``.
   Teacher tokens of the refresh = ``|Δ|``.
2. **Rewritten positions.** The loop keeps a *frontier* ``f``: every generated entry ``y_≤f``
   of the student cache has been offered to a refresh already, the entries ``y_{f+1..}`` are the
   student's since then (``f = 0`` at the start, so OverFill's ``y_1`` — written by the student at
   step 2 — is included). A refresh rewrites the stale entries ``y_{f+1..e}``, capped to their last
   ``W`` (``window``), where ``e`` is the newest entry the student cache holds or receives in the
   refresh: ``e = t`` for ``"teacher"``/``"student"``, ``e = t - 1`` for ``"rerun"`` (``y_t``'s
   entry is written by the student's next step). Then ``f = e``. So with an unbounded window every
   generated entry up to ``e`` is teacher-written after a refresh (seed 000: ``C_t ←
   Prefill_T([x; y≤t])``), and the entry ``"rerun"`` leaves to the student at one refresh is
   rewritten at the next (a refresh at every step, ``k = 1``, rewrites ``y_{t-1}``).
3. **Splice + next token**, by ``DecodeConfig.refresh_next``. Because the student cache lags by
   one entry (it holds ``x, y_<t`` when ``y_t`` is emitted), the three variants differ on ``y_t``:

   * ``"teacher"`` — the student cache gets the teacher's entries (``splice_positions`` for the
     stale ``y_{..t-1}``, ``append_from`` for ``y_t``) and ``y_{t+1}`` is drawn from the teacher's
     delta-prefill logits (free). The student skips its forward on ``y_t``.
   * ``"student"`` — the student runs its ordinary step on ``y_t`` first (over the unrefreshed
     cache), then the stale entries ``y_{f+1..t}`` are spliced; ``y_{t+1}`` is drawn from those
     (pre-refresh) student logits.
   * ``"rerun"`` (default; the blog's loop with its off-by-one fixed) — the stale entries
     ``y_{f+1..t-1}`` are spliced; the student's next step runs on ``y_t`` over the refreshed
     prefix, so ``y_{t+1}`` comes from fresh student logits. ``y_t``'s student entry is stale and
     becomes part of the next refresh's span.

   After a refresh the student cache equals the teacher cache over the rewritten entries, entry by
   entry, and the ledger says ``writer="teacher"`` there; ``record.spliced`` counts them.

Eviction (every mode). ``DecodeConfig.evict`` is an eviction policy (:mod:`kvlab.eviction`;
protocol in :mod:`kvlab.decode.protocols`). Its phase runs last in each step, after the refresh: the
policy sees the decoding cache (``x, y_<t``, or ``x, y_≤t`` after a ``"teacher"``/``"student"``
refresh) and the step's record, returns the slots to keep, and the cache removes the rest
(:meth:`KVCache.evict`, survivors keep their absolute positions unless the policy re-rotates), then
stores entries older than the policy's INT8 window as INT8. Policies that ``needs_attention`` get
the attention mass of every decoder forward (prefill included) from the cache's removable query
hooks; others cost nothing extra. Policies that ``needs_kv`` (kvpress-style scorers) also get read-only
copies of each layer's keys and values and the attention modules in the view. Only the decoding cache is evicted (the teacher's own cache in
overfill mode is the refresh's helper). With refresh, a refresh splices only the positions of its
span that are still live in the student cache — evicted positions stay evicted (``spliced``
counts what was rewritten); re-rotating eviction (which moves positions) is refused with refresh.
Records: ``cache_len`` / ``cache_bytes`` after the step, ``evicted``, and the policy's
``confidence`` / ``budget`` in ``signals``.

Each record carries the cost: ``teacher_tokens`` (probe + refresh prefill at this step),
``probe_tokens``, ``spliced`` (entries rewritten), ``teacher_s``; ``wall_s`` includes them.

``Decoding`` is iterable (step it with ``next()`` in a notebook); :func:`run` drains it into a
:class:`Trace`.
"""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Iterator

import torch

from kvlab.cache import KVCache
from kvlab.core.compat import IncompatiblePairError, kv_compat
from kvlab.decode.config import DecodeConfig, Sampling
from kvlab.cache.inputs import capture
from kvlab.decode.evict_phase import EvictPhases, prepare_evict
from kvlab.decode.records import StepRecord, Trace
from kvlab.decode.refresh_phase import RefreshPhases, _sync
from kvlab.decode.sampling import choose, token_stats


class Decoding(RefreshPhases, EvictPhases):
    """One generation, stepped token by token. Iterate it (or ``next(iter(d))``) for records.

    All arguments are validated here, before any model work. After (or during) iteration:
    ``cache`` is the decoding cache, ``teacher_cache`` the teacher's own prefix cache (overfill),
    ``tokens`` the generated ids, ``ttft_s`` the time to first token, ``dists`` the kept
    per-step model log-probs (untempered, not top-p truncated; see ``Trace.model_logprobs``).
    """

    def __init__(self, teacher, student, prompt: str, config: DecodeConfig | None = None, **overrides):
        config = config or DecodeConfig()
        if overrides:
            config = replace(config, **overrides)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        if config.mode in ("teacher", "overfill") and teacher is None:
            raise ValueError(f"mode={config.mode!r} needs a teacher model")
        if config.mode in ("student", "overfill") and student is None:
            raise ValueError(f"mode={config.mode!r} needs a student model")
        if config.mode == "overfill" and not config.rebuild_student_cache:
            compat = kv_compat(teacher, student)
            if not compat.ok:
                raise IncompatiblePairError(compat)
        self.config = config
        self.teacher, self.student = teacher, student
        self.prefiller = student if config.mode == "student" else teacher
        self.decoder = teacher if config.mode == "teacher" else student
        self.prefill_name = "student" if config.mode == "student" else "teacher"
        self.decoder_name = "teacher" if config.mode == "teacher" else "student"
        self.prompt = prompt
        self.prompt_ids = self.prefiller.encode_prompt(prompt, chat=config.chat)
        self.eos_ids = _eos_ids(self.decoder)
        self.cache: KVCache | None = None
        self.teacher_cache: KVCache | None = None
        self.tokens: list[int] = []
        self.dists: list[torch.Tensor] = []
        self.ttft_s: float | None = None
        self.elapsed_s = 0.0
        self.first_step = 1
        self._resume = None   # (cache, last_token, logits) when continuing from an existing cache
        self._it = None
        self._bank, self._tbank, self._row = None, None, None   # a BatchDecoding row: its batch buffers, row
        self._inputs = prepare_evict(config.evict, self.decoder.model)   # kvpress-style scorers' layer inputs

    @classmethod
    def resume(cls, lm, cache: KVCache, *, last_token: int | None = None, logits: torch.Tensor | None = None,
               role: str = "teacher", first_step: int = 1, config: DecodeConfig | None = None,
               **overrides) -> "Decoding":
        """Continue decoding ``lm`` on an existing (e.g. surgically edited) ``cache``, in place.

        Give exactly one of ``last_token`` (emitted but not yet in the cache — what a
        ``Decoding`` leaves: ``d.cache`` + ``d.tokens[-1]``; it is written first, at the cache's
        ``next_position``) or ``logits`` (the cache already holds everything and these are its
        next-token logits, e.g. ``TickReport.logits``). Positions come from the cache's mirror
        (``next_position``), never from its length. ``role`` names ``lm`` in the ledger
        ("teacher" or "student"); ``first_step`` numbers the records so they can follow an earlier
        run. Refresh is not available here (there is no teacher cache to sync).
        """
        if role not in ("teacher", "student"):
            raise ValueError(f"role={role!r} must be 'teacher' or 'student'")
        config = replace(config or DecodeConfig(), mode=role, **overrides)
        if config.refresh is not None:
            raise ValueError("refresh is not available when resuming from a cache (no teacher cache to sync); "
                             "pass refresh=None")
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a kvlab KVCache, got {type(cache).__name__}")
        if (last_token is None) == (logits is None):
            raise ValueError("pass exactly one of last_token (emitted, not yet in the cache) or logits "
                             "(the cache's next-token logits, e.g. TickReport.logits)")
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 1:
            raise ValueError(f"first_step={first_step!r} must be an int >= 1")
        vocab = int(lm.model.get_input_embeddings().weight.shape[0])
        if last_token is not None and (isinstance(last_token, bool) or not isinstance(last_token, int)
                                       or not 0 <= last_token < vocab):
            raise ValueError(f"last_token={last_token!r} must be a token id in [0, {vocab})")
        if logits is not None and tuple(logits.shape) != (vocab,):
            raise ValueError(f"logits has shape {tuple(logits.shape)}; expected ({vocab},)")
        if last_token is None and not len(cache):
            raise ValueError("the cache is empty; pass last_token to start from a token")
        cache.check()
        self = cls.__new__(cls)
        self.config = config
        self.teacher, self.student = (lm, None) if role == "teacher" else (None, lm)
        self.prefiller = self.decoder = lm
        self.prefill_name = self.decoder_name = role
        self.prompt = None
        self.prompt_ids = cache.token_ids          # the context the continuation conditions on
        self.eos_ids = _eos_ids(lm)
        self.cache, self.teacher_cache = cache, None
        self.tokens, self.dists = [], []
        self.ttft_s, self.elapsed_s = None, 0.0
        self.first_step = first_step
        self._resume = (cache, last_token, logits)
        self._it = None
        self._bank, self._tbank, self._row = None, None, None
        self._inputs = prepare_evict(config.evict, lm.model)
        return self

    def __iter__(self) -> Iterator[StepRecord]:
        if self._it is None:
            self._it = self._steps()
        return self._it

    def __next__(self) -> StepRecord:
        return next(iter(self))

    def _steps(self) -> Iterator[StepRecord]:
        """The loop, as named phases per step: advance (the decoder's forward on ``y_{t-1}``, or
        the logits a refresh left), score (choose ``y_t``, build the record), probe, refresh,
        evict. Each phase is a method; policies enter only through their protocols. (A batch of
        rows runs the same phases per row around one batched advance: :class:`BatchDecoding`.)"""
        t0 = time.perf_counter()
        logits = self._begin()
        source = self.prefill_name
        first = self.first_step
        for step in range(first, first + self.config.max_new_tokens):
            if step > first:
                t0 = time.perf_counter()
                logits, source = self._advance(step)
            rec = self._phases(step, logits, source, t0)
            yield rec
            if self._stops(rec):
                return

    def _begin(self, prefilled: tuple | None = None) -> torch.Tensor:
        """Per-run state (RNG stream seeded from this run's own sampling seed, refresh frontier),
        then the prefill: returns the first step's logits. ``prefilled`` = ``(cache, logits)`` of a
        prefill a batch already ran for this row (:meth:`BatchDecoding._prefill_rows`)."""
        cfg = self.config
        self._gen = None if cfg.sampling.greedy else torch.Generator().manual_seed(cfg.sampling.seed)
        self._device = self.decoder.device   # looked up once per run, not once per row and step (_after_score)
        logits = self._start(prefilled)
        self._pending = None       # (logits, source) for the next step, left by a refresh
        self._last_refresh = self.first_step - 1
        self._frontier = 0         # generated entries y_≤frontier were offered to a refresh (see _refresh)
        return logits

    def _phases(self, step: int, logits: torch.Tensor, source: str, t0: float) -> StepRecord:
        """Score, probe, refresh, evict for step ``step``; the record, timed from ``t0``."""
        rec = self._score(step, logits, source)
        self._acc = {"teacher_tokens": 0, "teacher_s": 0.0}
        return self._after_score(rec, logits, t0)

    def _after_score(self, rec: StepRecord, logits: torch.Tensor, t0: float) -> StepRecord:
        """Probe, refresh, evict; the finished record (see :meth:`_phases`)."""
        rec = self._before_evict(rec, logits)
        return self._finish(self._evict(rec, logits), t0)

    def _before_evict(self, rec: StepRecord, logits: torch.Tensor) -> StepRecord:
        """Probe, refresh (a batch decides its rows' evictions together after them: :class:`BatchDecoding`)."""
        return self._refresh_phase(self._probe(rec, logits))

    def _finish(self, rec: StepRecord, t0: float) -> StepRecord:
        """The step's record once its phases ran: the cache after the step, the wall time from ``t0``."""
        step = rec.step
        cache_len, cache_bytes = len(self.cache), self.cache.nbytes()    # the cache after the step
        _sync(self._device)
        wall = time.perf_counter() - t0
        self.elapsed_s += wall
        if step == self.first_step:
            self.ttft_s = wall
        return replace(rec, wall_s=wall, elapsed_s=self.elapsed_s, teacher_tokens=self._acc["teacher_tokens"],
                       teacher_s=self._acc["teacher_s"], cache_len=cache_len, cache_bytes=cache_bytes,
                       meta_bytes=self.cache.meta_nbytes(), forward_bytes=self._fwd_bytes,
                       cache_bytes16=self.cache.nbytes16())

    def _stops(self, rec: StepRecord) -> bool:
        """The run ends after ``rec``: EOS (unless ``ignore_eos``) or the last step."""
        return (rec.token_id in self.eos_ids and not self.config.ignore_eos) \
            or rec.step >= self.first_step + self.config.max_new_tokens - 1

    def _start(self, prefilled: tuple | None = None) -> torch.Tensor:
        """Prefill (or resume): set ``self.cache`` (and the teacher's cache); return the first logits.
        ``prefilled``: the prefill's ``(cache, logits)`` when a batch ran it (see :meth:`_batch_prefill`)."""
        cfg, first = self.config, self.first_step
        attn = self._needs_attention
        if self._resume is not None:        # continue on an existing cache (see Decoding.resume)
            cache, last_token, logits = self._resume
            self._track(cache)
            if last_token is not None:
                logits = cache.forward(self.decoder.model, [last_token], writer=self.decoder_name, step=first - 1,
                                       attention=attn)
        elif prefilled is not None:
            cache, logits = prefilled
        else:
            cache = self._new_cache(decoding=cfg.mode != "overfill")
            self._track(cache)
            with capture(self._inputs, self.prefiller.model, prefill=True):
                logits = cache.forward(self.prefiller.model, self.prompt_ids, writer=self.prefill_name, step=-1,
                                       attention=attn)
        if cfg.mode == "overfill":
            self.teacher_cache = cache
            self._teacher_logits = logits    # p_T(y_1 | x): the teacher cache's last logits
            if cfg.rebuild_student_cache:   # geometry differs: the student builds its own C_0 from text
                cache = self._new_cache(decoding=True)
                self._track(cache)
                with capture(self._inputs, self.student.model, prefill=True):
                    cache.forward(self.student.model, self.prompt_ids, writer="student", step=-1, attention=attn)
            else:
                cache = self._copy_cache(cache)   # the student extends a copy; the teacher keeps C_0
        self.cache = cache
        self._fwd_bytes = cache.forward_nbytes()
        return logits

    def _batch_prefill(self) -> KVCache | None:
        """The empty cache a batch may prefill this row's prompt into, together with other rows (the
        prefiller's forward over ``prompt_ids``, ledger step -1, as :meth:`_start` runs it), or None
        when the prefill stays this row's own: a resumed run, or attention mass measured during it."""
        if self._resume is not None or self._needs_attention or self._inputs is not None:
            return None
        cache = self._new_cache(decoding=self.config.mode != "overfill")
        self._track(cache)
        return cache

    def _new_cache(self, decoding: bool) -> KVCache:
        """An empty cache: the decoding cache (``decoding``) or the overfill teacher's own. A batch
        row puts each in its row of the batch's buffers (:class:`BatchDecoding`)."""
        bank = self._bank if decoding else self._tbank
        if bank is not None:
            return bank.row_cache(self._row)
        return KVCache()

    def _copy_cache(self, cache: KVCache) -> KVCache:
        """The overfill student's copy of the teacher's ``C_0`` (in its batch row, if it has one)."""
        if self._bank is not None:
            return self._bank.adopt(self._row, cache)
        return cache.copy()

    def _advance(self, step: int) -> tuple[torch.Tensor, str]:
        """Phase 1: the logits of step ``step`` — a refresh's pending ones, or the decoder's
        forward on ``y_{step-1}`` (with attention mass when the eviction policy needs it)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._fwd_bytes = self.cache.forward_nbytes()
            return pending
        with capture(self._inputs, self.decoder.model, prefill=False):
            logits = self.cache.forward(self.decoder.model, [self.tokens[-1]], writer=self.decoder_name,
                                        step=step - 1, attention=self._measures_at(step))
        self._fwd_bytes = self.cache.forward_nbytes()
        return logits, self.decoder_name

    def _score(self, step: int, logits: torch.Tensor, source: str, stats: tuple | None = None) -> StepRecord:
        """Phase 2: choose ``y_step`` and build its record (``stats``: :func:`token_stats_rows`'s row
        of ``logits`` — with its greedy choice — when a batch computed them for all rows at once)."""
        cfg, cache = self.config, self.cache
        logp, ent, top1, margin = stats[:4] if stats is not None else token_stats(logits)
        i = step - self.first_step
        if i < len(cfg.forced):
            token_id = cfg.forced[i]
        elif stats is not None and cfg.sampling.greedy:
            token_id = int(stats[4])                            # the batch's argmax of this row: choose()'s pick
        else:
            token_id = choose(logits, cfg.sampling, self._gen)
        if cfg.keep_dists:
            self.dists.append(logp.cpu())
        self.tokens.append(token_id)
        return StepRecord(
            step=step, token_id=token_id, token=self.decoder.tokenizer.decode([token_id]),
            position=cache.next_position, logprob=float(logp[token_id]), entropy_bits=ent, top1_prob=top1,
            margin=margin, cache_len=len(cache), source=source, refreshed=False, evicted=0,
            wall_s=0.0, elapsed_s=0.0, since_refresh=step - self._last_refresh)


def continue_from(cache: KVCache, lm, last_token: int | None = None, *, logits: torch.Tensor | None = None,
                  max_new_tokens: int = 32, sampling: Sampling | None = None, writer: str = "teacher",
                  ignore_eos: bool = True, first_step: int = 1) -> Iterator[StepRecord]:
    """Records of :meth:`Decoding.resume` — the same loop, started from an existing cache."""
    return iter(Decoding.resume(lm, cache, last_token=last_token, logits=logits, role=writer,
                                first_step=first_step, max_new_tokens=max_new_tokens,
                                sampling=sampling if sampling is not None else Sampling(), ignore_eos=ignore_eos))


def _eos_ids(lm) -> set[int]:
    ids = set()
    for src in (getattr(lm.model, "generation_config", None), lm.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


def run(teacher, student, prompt: str, config: DecodeConfig | None = None, *, on_step=None, **overrides) -> Trace:
    """Drain a :class:`Decoding` into a :class:`Trace`.

    ``on_step(record, decoding)``, if given, is called after every step (e.g. to stream points into a
    plot); an exception it raises (a cancellation) propagates and no Trace is returned.
    """
    d = Decoding(teacher, student, prompt, config, **overrides)
    records = []
    for rec in d:
        records.append(rec)
        if on_step is not None:
            on_step(rec, d)
    return _trace(d, records)


def _trace(d: Decoding, records: list[StepRecord]) -> Trace:
    dists = torch.stack(d.dists) if d.dists else None
    live = {"positions": list(d.cache.positions), "writers": list(d.cache.writers)} if d.cache is not None else None
    return Trace(records=records, prompt=d.prompt, prompt_ids=list(d.prompt_ids), config=d.config,
                 ttft_s=float(d.ttft_s), total_s=d.elapsed_s,
                 text=d.decoder.tokenizer.decode(d.tokens, skip_special_tokens=True), model_logprobs=dists,
                 live=live)
