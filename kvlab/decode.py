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
:mod:`kvlab.refresh.base` for the protocol, :mod:`kvlab.refresh.policies` for Periodic / EntropyGate / ProbeKL /
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
protocol in :mod:`kvlab.eviction.base`). Its phase runs last in each step, after the refresh: the
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

import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator

import torch

from .cache import KVCache
from .cache.attention import attention_modules
from .cache.inputs import capture, capture_rows, inputs_for
from .decode_refresh import PROBE_TEACHER_UPTO, RefreshPhases, Signals, _sync  # noqa: F401 (kvlab.decode.* too)
from kvlab.core.compat import IncompatiblePairError, kv_compat
from kvlab.eviction.base import EvictView, validate_evict
from kvlab.refresh.base import policy_dict, validate_policy

MODES = ("teacher", "student", "overfill")
REFRESH_NEXT = ("rerun", "student", "teacher")
LN2 = math.log(2.0)


@dataclass(frozen=True)
class Sampling:
    """``temperature == 0`` → greedy; otherwise seeded sampling with nucleus ``top_p``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r} must be an int")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class DecodeConfig:
    mode: str = "overfill"
    max_new_tokens: int = 128
    sampling: Sampling = field(default_factory=Sampling)
    ignore_eos: bool = True       # the blog compares fixed-N runs
    chat: bool = True             # apply the tokenizer's chat template to the prompt
    keep_dists: bool = False      # keep every step's full log-distribution (for KL scoring)
    rebuild_student_cache: bool = False  # overfill with an incompatible pair: student prefills from text
    refresh: Any = None           # a refresh policy (kvlab.refresh.policies) or None; overfill only
    refresh_next: str = "rerun"   # who picks the token after a refresh: "rerun" | "student" | "teacher"
    evict: Any = None             # an eviction policy (kvlab.eviction) or None; every mode
    forced: tuple = ()            # teacher forcing: y_1.. are these token ids (then chosen as usual); every phase runs

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} must be one of {MODES}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be a positive int (N > 0)")
        if not isinstance(self.sampling, Sampling):
            raise ValueError("sampling must be a kvlab.Sampling(temperature=..., top_p=..., seed=...)")
        if self.refresh_next not in REFRESH_NEXT:
            raise ValueError(f"refresh_next={self.refresh_next!r} must be one of {REFRESH_NEXT}")
        if self.refresh is not None:
            if self.mode != "overfill":
                raise ValueError(f"refresh needs mode='overfill' (got mode={self.mode!r}): only overfill "
                                 "has a student cache for the teacher to correct")
            if self.rebuild_student_cache:
                raise ValueError("refresh splices teacher K/V into the student cache, which needs the same KV "
                                 "geometry; rebuild_student_cache=True means it differs")
            validate_policy(self.refresh)
        if not isinstance(self.forced, tuple) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                     for t in self.forced):
            raise ValueError("forced must be a tuple of token ids (ints >= 0), e.g. tuple(trace.tokens)")
        if self.evict is not None:
            validate_evict(self.evict)
            if getattr(self.evict, "rerotate", False) and self.refresh is not None:
                raise ValueError("evict.rerotate=True moves the student's entries to new positions, but a refresh "
                                 "splices teacher entries by absolute position; use rerotate=False with refresh")

    def to_dict(self) -> dict:
        d = asdict(replace(self, refresh=None, evict=None))
        if not self.forced:             # absent when unused: stored-run keys of free-running runs stay valid
            del d["forced"]
        else:
            d["forced"] = list(self.forced)
        d["refresh"] = policy_dict(self.refresh)
        del d["evict"]
        if self.evict is not None:      # absent when None: stored-run keys of runs without eviction stay valid
            d["evict"] = policy_dict(self.evict)
        return d


@dataclass(frozen=True)
class StepRecord:
    step: int            # 1-based index of the generated token
    token_id: int
    token: str
    position: int        # absolute position of this token in the sequence
    logprob: float       # log p(token) under the distribution it was drawn from (untempered)
    entropy_bits: float  # entropy of that distribution, bits
    top1_prob: float
    margin: float        # p(top1) - p(top2)
    cache_len: int       # decoding cache entries after this step (after its evict phase)
    source: str          # which model produced the distribution ("teacher"/"student")
    refreshed: bool      # a refresh happened after this step
    evicted: int         # cache entries evicted at this step
    wall_s: float        # compute time of this step (excludes time the consumer held the generator)
    elapsed_s: float     # cumulative compute time since the start of prefill
    since_refresh: int = 0       # t - (step of the last refresh, 0 if none): steps the student ran alone
    signals: Signals = Signals()  # probe signals of this step (name, value) pairs; .get(name)
    probed: bool = False         # a probe ran at this step
    spliced: int = 0             # student-cache entries rewritten with the teacher's at this step
    teacher_tokens: int = 0      # teacher tokens processed at this step (probe + refresh delta)
    probe_tokens: int = 0        # of which for the probe
    teacher_s: float = 0.0       # teacher compute time at this step
    probe_cost: tuple = ()       # the probe's cost counters, (name, value) pairs
    cache_bytes: int = 0         # real bytes of the decoding cache's K/V after this step (INT8 counted as such)
    meta_bytes: int = 0          # bytes of the cache's attention statistics after this step (eviction policies)
    forward_bytes: int = 0       # K/V bytes held during this step's forward (INT8 prefix dequantized for it)
    cache_bytes16: int = 0       # cache_bytes at the 16-bit reference (FP entries at 2 bytes/element; INT8 as is)




def token_stats(logits: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """``(logp, entropy_bits, top1_prob, margin)`` of a ``(V,)`` logit vector."""
    logp = torch.log_softmax(logits.float(), dim=-1)          # (V,)
    p = logp.exp()
    ent = -float(torch.dot(p, logp))                           # one fused pass (hot path: every step)
    if math.isnan(ent):                                        # -inf logits (masked tokens): 0 * -inf
        ent = float(torch.special.entr(p).sum())
    top1, top2 = torch.topk(logp, 2).values.exp().tolist()
    return logp, ent / LN2, top1, top1 - top2


def token_stats_rows(logits: torch.Tensor) -> list[tuple[torch.Tensor, float, float, float, int]]:
    """:func:`token_stats` of every row of ``(B, V)`` logits, in one pass over the batch, plus each
    row's greedy choice ``argmax(logits[b])`` (what :func:`choose` picks at temperature 0: the first
    maximal index, one batched argmax instead of one per row)."""
    logp = torch.log_softmax(logits.float(), dim=-1)           # (B, V)
    p = logp.exp()
    ent = -(p * logp).sum(-1)                                   # (B,)
    top = torch.topk(logp, 2, dim=-1).values.exp()              # (B, 2)
    best = torch.argmax(logits, dim=-1).tolist()                # (B,) greedy choices
    out = []
    for b, (e, t1, t2) in enumerate(zip(ent.tolist(), top[:, 0].tolist(), top[:, 1].tolist())):
        if math.isnan(e):                                       # -inf logits (masked tokens): 0 * -inf
            e = float(torch.special.entr(p[b]).sum())
        out.append((logp[b], e / LN2, t1, t1 - t2, best[b]))
    return out


def choose(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> int:
    """Greedy argmax, or a seeded draw from ``softmax(logits / T)`` restricted to the top-p nucleus."""
    if sampling.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float().cpu() / sampling.temperature, dim=-1)  # (V,)
    if sampling.top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = (torch.cumsum(sp, 0) - sp) < sampling.top_p   # smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(0, idx[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


class Decoding(RefreshPhases):
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
        self._inputs = _prepare_evict(config.evict, self.decoder.model)   # kvpress-style scorers' layer inputs

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
        self._inputs = _prepare_evict(config.evict, lm.model)
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
        step = rec.step
        rec = self._probe(rec, logits)
        rec = self._refresh_phase(rec)
        rec = self._evict(rec, logits)
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

    @property
    def _needs_attention(self) -> bool:
        ev = self.config.evict
        return ev is not None and bool(getattr(ev, "needs_attention", False))

    def _track(self, cache: KVCache) -> None:
        if self._needs_attention:
            ev = self.config.evict
            cache.track_attention(getattr(ev, "ema_decay", 0.9), window=getattr(ev, "attention_window", None),
                                  pool=getattr(ev, "attention_pool", 1), below=getattr(ev, "attention_below", False),
                                  ema_prefill=getattr(ev, "ema_prefill", "query"))

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
                                        step=step - 1, attention=self._needs_attention)
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

    def _evict(self, rec: StepRecord, logits: torch.Tensor) -> StepRecord:
        """Phase 5: the eviction policy's decision, applied by the cache (``KVCache.evict``), then
        INT8 storage of older entries if the policy asks (the loop records the cache after it)."""
        cache, policy = self.cache, self.config.evict
        if policy is None or not len(cache):
            return rec
        evicted = 0
        signals = rec.signals
        sp = self.config.sampling
        lp = cache.layer_positions()
        view = EvictView(step=rec.step, length=len(cache), positions=lp[0], record=rec,
                         vocab_size=int(logits.shape[-1]), num_layers=cache.num_layers, attn=cache.layer_attn(),
                         logits=logits, temperature=float(sp.temperature), top_p=float(sp.top_p),
                         first=rec.step == self.first_step, layer_positions=lp, **self._kv_access(policy))
        decision = policy.keep(view)
        drop = decision.dropped(len(cache))
        per_layer = decision.dropped_layers(cache.layer_lengths())
        if drop or (per_layer is not None and any(per_layer)):
            rep = cache.evict(drop, model=self.decoder.model, rerotate=decision.rerotate, layers=per_layer)
            evicted = rep.evicted
        if decision.int8_window is not None:
            cache.quantize_older(decision.int8_window, decision.int8_group)
        if decision.signals():
            signals = Signals({**signals.to_dict(), **decision.signals()})
        return replace(rec, evicted=evicted, signals=signals)

    def _kv_access(self, policy) -> dict:
        """``EvictView.kv`` / ``modules`` for a policy that ``needs_kv`` (read-only copies, per layer)."""
        if not getattr(policy, "needs_kv", False):
            return {}
        out = {"kv": self.cache.kv, "modules": tuple(attention_modules(self.decoder.model))}
        if self._inputs is not None:
            out["inputs"] = self._inputs.layer
        return out



class BatchError(RuntimeError):
    """Some rows of a batch failed: ``errors`` ``{row: exception}``; ``traces`` holds the other rows'
    finished :class:`Trace` s (None for the failed ones)."""

    def __init__(self, errors: dict, traces: list):
        self.errors, self.traces = errors, traces
        msg = "; ".join(f"row {b}: {type(e).__name__}: {e}" for b, e in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {len(traces)} rows failed ({msg})")


class BatchDecoding:
    """B generations in lock-step: one batched decoder forward per step, everything else per row.

    Each row is a :class:`Decoding` (its own prompt, config, RNG stream seeded from its own
    sampling seed, refresh frontier and schedule, eviction policy state, records) whose decoding
    cache is row ``b`` of shared batch buffers (:class:`kvlab.cache.batch.Bank`: a row is an
    ordinary KVCache with its own ledger, live maps and per-layer lengths, edited in place). A step:

    * **advance** — every row that needs its decoder's forward on ``y_{t-1}`` gets it from ONE
      batched forward (:func:`kvlab.cache.batch.forward_rows`); a row holding a refresh's pending
      logits skips it (it rides along as a masked dummy, as do finished rows);
    * **score, probe, refresh, evict** — :meth:`Decoding._phases`, per row, unchanged (teacher
      forwards of probes and refreshes run per row on the row's own teacher cache).

    * **prefill** — the rows' prompts in ONE batched forward (different lengths: padded, the padding
      never committed; :meth:`_prefill_rows`), except a row that measures attention mass during its
      prefill or resumes a cache: it prefills on its own.

    Rows that stop early (EOS,
    ``ignore_eos=False``) drop out; the others go on. A row whose phases raise is dropped and its
    error kept in ``errors``; the other rows finish. Iterating yields ``(row, StepRecord)``.

    A row's tokens do not depend on its batch: its RNG, policies and probes see only its own state;
    the batched forward's logits equal the row's single forward to float tolerance (different
    matmul shapes; tests/test_batch_decode.py states it).
    """

    def __init__(self, teacher, student, prompts, config: DecodeConfig | list | tuple | None = None, **overrides):
        if isinstance(prompts, str) or not hasattr(prompts, "__len__") or not len(prompts):
            raise ValueError("prompts must be a non-empty list of prompt strings")
        configs = list(config) if isinstance(config, (list, tuple)) else [config] * len(prompts)
        if len(configs) != len(prompts):
            raise ValueError(f"config has {len(configs)} entries for {len(prompts)} prompts (give one, or one per row)")
        rows = []
        for b, (p, c) in enumerate(zip(prompts, configs)):
            if isinstance(p, str) and not p.strip():
                raise ValueError(f"row {b}: prompts[{b}] is empty; every row needs a non-empty prompt")
            try:
                rows.append(Decoding(teacher, student, p, c, **overrides))
            except IncompatiblePairError:
                raise
            except ValueError as e:
                raise ValueError(f"row {b}: {e}") from e
        modes = {d.config.mode for d in rows}
        if len(modes) > 1:
            b = next(i for i, d in enumerate(rows) if d.config.mode != rows[0].config.mode)
            raise ValueError(f"row {b}: mode={rows[b].config.mode!r} differs from row 0's {rows[0].config.mode!r}; "
                             "one batch runs one decoder (split the batch by mode)")
        first = rows[0]
        devices = {str(m.device) for m in (teacher, student) if m is not None
                   and (m is first.decoder or m is first.prefiller or first.config.mode == "overfill")}
        if len(devices) > 1:
            raise ValueError(f"teacher and student are on different devices ({sorted(devices)}); a batch runs on one "
                             "device: move both models there (load_pair(device=...))")
        ctx = getattr(first.decoder.model.config, "max_position_embeddings", None)
        for b, d in enumerate(rows):
            if ctx is not None and len(d.prompt_ids) >= ctx:
                raise ValueError(f"row {b}: prompt has {len(d.prompt_ids)} tokens, the model's context is {ctx} "
                                 f"(max_position_embeddings); shorten prompts[{b}]")
            for name in ("refresh", "evict"):
                pol = getattr(d.config, name)
                if pol is not None and getattr(pol, "batchable", True) is False:
                    raise ValueError(f"row {b}: {name}={type(pol).__name__} cannot run batched (batchable=False); "
                                     "run it with batch 1")
        self.rows = rows
        self.errors: dict[int, BaseException] = {}
        self.bank = self.teacher_bank = None
        self.catch_up_errors: list[BaseException] = []   # batched teacher catch-ups that fell back to per-row
        self.prefill_errors: list[BaseException] = []    # a batched prefill that fell back to per-row
        self._it = None

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[tuple[int, StepRecord]]:
        if self._it is None:
            self._it = self._steps()
        return self._it

    def __next__(self) -> tuple[int, StepRecord]:
        return next(iter(self))

    def _fail(self, b: int, e: BaseException, live: set) -> None:
        self.errors[b] = e
        live.discard(b)

    def _steps(self) -> Iterator[tuple[int, StepRecord]]:
        from .cache.batch import Bank

        rows = self.rows
        B = len(rows)
        first = rows[0]
        dec = first.decoder
        cap = max(len(d.prompt_ids) + d.config.max_new_tokens for d in rows) + 2
        self.bank = Bank.for_model(dec.model, B, capacity=cap)
        if first.config.mode == "overfill":             # the teachers' own caches: rows of a second bank
            self.teacher_bank = Bank.for_model(first.teacher.model, B, capacity=cap)
        for b, d in enumerate(rows):
            d._bank, d._tbank, d._row = self.bank, self.teacher_bank, b
        live = set(range(B))
        step_of = [d.first_step for d in rows]
        prefilled, shared = self._prefill_rows()
        for b, d in enumerate(rows):                    # step 1 (and any prefill not batched), per row
            t0 = time.perf_counter() - (shared if b in prefilled else 0.0)
            try:
                rec = d._phases(d.first_step, d._begin(prefilled.get(b)), d.prefill_name, t0)
            except Exception as e:                      # noqa: BLE001 - kept per row, re-raised by run_batch
                self._fail(b, e, live)
                continue
            yield b, rec
            if d._stops(rec):
                live.discard(b)
            step_of[b] += 1
        self.slot = list(range(B))                      # row -> its bank slot (rows move when others finish)
        self._compact(live)
        while live:
            yield from self._step(sorted(live), step_of, live)
            self._compact(live)

    def _compact(self, live: set) -> None:
        """Finished (and failed) rows leave the batched forwards: each is swapped with the last live row
        of the banks' width (:meth:`~kvlab.cache.bank.Bank.swap`: both caches keep their content), and the
        width shrinks to the live rows. The teacher bank (overfill) moves in lock-step."""
        banks = [bk for bk in (self.bank, self.teacher_bank) if bk is not None]
        row_at = {s: b for b, s in enumerate(self.slot)}
        width = self.bank.width
        s = 0
        while s < width:
            if row_at[s] in live:
                s += 1
                continue
            last = width - 1
            while last > s and row_at[last] not in live:
                last -= 1
            if last > s:                                 # a live row moves into the finished row's slot
                for bk in banks:
                    bk.swap(s, last)
                a, b = row_at[s], row_at[last]
                row_at[s], row_at[last] = b, a
                self.slot[a], self.slot[b] = last, s
            width = last if last > s else s
        for bk in banks:
            bk.set_width(max(width, 1))

    def _prefill_rows(self) -> tuple[dict, float]:
        """Prefill the rows that allow it (:meth:`Decoding._batch_prefill`) in ONE batched forward of
        their prompts (different lengths: padded, the padding never committed). Returns ``{row:
        (cache, logits)}`` and the forward's time. With fewer than two such rows, or if the forward
        fails (nothing committed: :func:`~kvlab.cache.batch.forward_rows` is all-or-nothing; the error
        goes to ``prefill_errors``), every row prefills on its own in :meth:`Decoding._start`."""
        from .cache.batch import forward_rows

        rows, B = self.rows, len(self.rows)
        first = rows[0]
        caches = [d._batch_prefill() for d in rows]
        todo = [b for b in range(B) if caches[b] is not None]
        if len(todo) < 2:
            return {}, 0.0
        bank = self.teacher_bank if first.config.mode == "overfill" else self.bank
        t0 = time.perf_counter()
        try:
            logits = forward_rows(bank, first.prefiller.model, caches,
                                  [rows[b].prompt_ids if caches[b] is not None else None for b in range(B)],
                                  writer=first.prefill_name, steps=[-1] * B)                  # (B, V)
        except Exception as e:                          # noqa: BLE001 - rows fall back to their own prefill
            self.prefill_errors.append(e)
            return {}, 0.0
        _sync(first.prefiller.device)
        return {b: (caches[b], logits[b]) for b in todo}, time.perf_counter() - t0

    def _step(self, order: list[int], step_of: list[int], live: set):
        """One lock-step: advance (one batched decoder forward), score per row, one batched teacher
        catch-up for the rows whose probe or refresh is due, then probe/refresh/evict per row."""
        from .cache.batch import forward_rows

        rows, B, slot = self.rows, len(self.rows), self.slot
        t0 = time.perf_counter()
        need = [b for b in order if rows[b]._pending is None]
        logits = None
        if need:
            dec = rows[0].decoder
            caches, tokens, steps, attention = [None] * B, [None] * B, [0] * B, [False] * B   # per bank slot
            for b in need:
                s = slot[b]
                caches[s], tokens[s], steps[s] = rows[b].cache, rows[b].tokens[-1], step_of[b] - 1
                attention[s] = rows[b]._needs_attention
            with capture_rows({slot[b]: rows[b]._inputs for b in need}, dec.model):
                logits = forward_rows(self.bank, dec.model, caches, tokens, writer=rows[0].decoder_name,
                                      steps=steps, attention=attention)               # (width, V) per slot
            _sync(dec.device)
        stats = token_stats_rows(logits) if need else None      # every slot's in one pass (rows in `need`)
        shared = time.perf_counter() - t0
        scored = {}
        for b in order:
            d = rows[b]
            t1 = time.perf_counter()
            if b in need:
                lg, src, st = logits[slot[b]], d.decoder_name, stats[slot[b]]
            else:
                (lg, src), d._pending, st = d._pending, None, None
            d._fwd_bytes = d.cache.forward_nbytes()
            try:
                rec = d._score(step_of[b], lg, src, st)
                d._acc = {"teacher_tokens": 0, "teacher_s": 0.0}
                due = d._teacher_due(rec)
            except Exception as e:                      # noqa: BLE001
                self._fail(b, e, live)
                continue
            scored[b] = (rec, lg, shared + time.perf_counter() - t1, due)
        teacher_s = self._catch_up({b: v[3] for b, v in scored.items() if v[3] is not None})
        for b, (rec, lg, spent, due) in scored.items():
            d = rows[b]
            try:
                rec = d._after_score(rec, lg, time.perf_counter() - spent - (teacher_s if due is not None else 0.0))
            except Exception as e:                      # noqa: BLE001
                self._fail(b, e, live)
                continue
            yield b, rec
            step_of[b] += 1
            if d._stops(rec):
                live.discard(b)

    def _catch_up(self, due: dict[int, int]) -> float:
        """Extend the teacher caches of rows ``due`` (``{row: n}``) to ``x, y_≤n`` in one batched
        forward (each row's own missing tokens; rows already there are skipped); the rows' probes and
        refreshes then find their teacher logits ready (``_teacher_upto``), and their tallies get the
        tokens and the forward's time. Returns that time (0 if none ran). If the batched forward
        fails, nothing changed and every row catches up on its own in its phases."""
        from .cache.batch import forward_rows

        rows, B, slot = self.rows, len(self.rows), self.slot
        todo = {}
        for b, n in due.items():
            d = rows[b]
            have = d.teacher_cache.next_position - len(d.prompt_ids)
            if n > have and n <= len(d.tokens) and self.teacher_bank.owns(slot[b], d.teacher_cache):
                todo[b] = (have, n)
        if not todo:
            return 0.0
        t0 = time.perf_counter()
        teacher = rows[0].teacher
        caches, tokens, steps = [None] * B, [None] * B, [0] * B                          # per bank slot
        for b, (have, n) in todo.items():
            caches[slot[b]], tokens[slot[b]], steps[slot[b]] = rows[b].teacher_cache, rows[b].tokens[have:n], \
                len(rows[b].tokens)
        try:
            logits = forward_rows(self.teacher_bank, teacher.model, caches, tokens, writer="teacher", steps=steps)
        except Exception as e:                          # noqa: BLE001 - rows fall back to their own forwards
            self.catch_up_errors.append(e)
            return 0.0
        _sync(teacher.device)
        spent = time.perf_counter() - t0
        for b, (have, n) in todo.items():
            d = rows[b]
            d._teacher_logits = logits[slot[b]]
            d._acc["teacher_tokens"] += n - have
            d._acc["teacher_s"] += spent
        return spent


def run_batch(teacher, student, prompts, config: DecodeConfig | list | tuple | None = None, *, on_step=None,
              on_row=None, **overrides) -> list[Trace]:
    """Drain a :class:`BatchDecoding` into one :class:`Trace` per row (in prompt order).

    ``on_step(row, record, decoding)`` is called after every row's step; ``on_row(row, trace)`` as
    soon as a row finishes (e.g. to store it). If rows failed, the others still finish (and
    ``on_row`` sees them), then :class:`BatchError` is raised carrying the finished traces."""
    bd = BatchDecoding(teacher, student, prompts, config, **overrides)
    records: list[list[StepRecord]] = [[] for _ in bd.rows]
    traces: list[Trace | None] = [None] * len(bd.rows)
    for b, rec in bd:
        records[b].append(rec)
        if on_step is not None:
            on_step(b, rec, bd.rows[b])
        if bd.rows[b]._stops(rec):
            traces[b] = _trace(bd.rows[b], records[b])
            if on_row is not None:
                on_row(b, traces[b])
    if bd.errors:
        raise BatchError(bd.errors, traces)
    return traces


def continue_from(cache: KVCache, lm, last_token: int | None = None, *, logits: torch.Tensor | None = None,
                  max_new_tokens: int = 32, sampling: Sampling | None = None, writer: str = "teacher",
                  ignore_eos: bool = True, first_step: int = 1) -> Iterator[StepRecord]:
    """Records of :meth:`Decoding.resume` — the same loop, started from an existing cache."""
    return iter(Decoding.resume(lm, cache, last_token=last_token, logits=logits, role=writer,
                                first_step=first_step, max_new_tokens=max_new_tokens,
                                sampling=sampling if sampling is not None else Sampling(), ignore_eos=ignore_eos))


def _prepare_evict(policy, model):
    """An eviction policy's ``prepare(model)`` (optional; once, before the run's first forward: kvpress's
    ``post_init_from_model``) and, when it ``needs_inputs``, the layer inputs the loop captures for it."""
    if policy is not None and callable(getattr(policy, "prepare", None)):
        policy.prepare(model)
    return inputs_for(policy)


def _eos_ids(lm) -> set[int]:
    ids = set()
    for src in (getattr(lm.model, "generation_config", None), lm.config):
        e = getattr(src, "eos_token_id", None) if src is not None else None
        if e is not None:
            ids.update(e if isinstance(e, (list, tuple)) else [e])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


@dataclass
class Trace:
    """A finished generation: its records plus what scoring needs."""

    records: list[StepRecord]
    prompt: str
    prompt_ids: list[int]
    config: DecodeConfig
    ttft_s: float
    total_s: float
    text: str
    model_logprobs: torch.Tensor | None = None
    """``(N, V)``: row ``t`` is ``log_softmax`` of the logits step ``t`` chose from — the model's own
    next-token distribution ``q_t``, *untempered and not top-p truncated* (sampling applies
    temperature and the nucleus on top of it). ``None`` unless run with ``keep_dists=True``."""
    live: dict | None = None   # the decoding cache at the end: {"positions": [...], "writers": [...]} per slot

    @property
    def dists(self) -> torch.Tensor | None:
        """Deprecated alias of :attr:`model_logprobs` (they are not the sampling distributions)."""
        import warnings

        warnings.warn("Trace.dists is deprecated: use Trace.model_logprobs (untempered model log-probs)",
                      DeprecationWarning, stacklevel=2)
        return self.model_logprobs

    @property
    def tokens(self) -> list[int]:
        return [r.token_id for r in self.records]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.records])


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
