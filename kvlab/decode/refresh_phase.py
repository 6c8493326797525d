"""The teacher side of the decode loop (:mod:`kvlab.decode`): the probe and refresh phases and the
teacher-cache catch-up they share, as :class:`RefreshPhases`, a mixin that :class:`kvlab.decode.Decoding`
inherits (the loop stays one class, ``Decoding``; these methods read and set its state). Also the record's
:class:`Signals` and the probe table :data:`PROBE_TEACHER_UPTO`, re-exported by :mod:`kvlab.decode`.

What a refresh does, index by index, is stated in :mod:`kvlab.decode.loop`'s module docstring. Caches are edited
only through :mod:`kvlab.cache`; policies and probes (:mod:`kvlab.decode.protocols`, :mod:`kvlab.decode.probes`) decide, the loop acts.
``StepRecord`` in the annotations is :class:`kvlab.decode.StepRecord` (not imported: ``kvlab.decode``
imports this module).
"""
from __future__ import annotations

import time
from dataclasses import replace
import torch

from kvlab.decode.probes import PROBES, ProbeContext
from kvlab.decode.protocols import refresh_attr
from kvlab.decode.records import Signals, StepRecord

# Probes whose teacher request at a due step is known before they run: probe name -> step -> n of
# ``ctx.teacher_logits(n)`` (kvlab.decode.probes.teacher_kl_probe asks for y_<step). A batch catches
# these rows' teacher caches up in one forward; other probes call the teacher on their own.
PROBE_TEACHER_UPTO = {"teacher_kl": lambda step: step - 1}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RefreshPhases:
    """Phases 3 (probe) and 4 (refresh) of :class:`kvlab.decode.Decoding`, with the teacher's catch-up
    (``_teacher_upto``) and what a batch asks before they run (``_teacher_due``)."""

    def _teacher_due(self, rec: StepRecord) -> int | None:
        """``n`` if this step's probe or refresh will certainly call ``_teacher_upto(n)`` (known right
        after scoring, before they run: a refresh policy without a probe decides on the record alone;
        a due probe listed in :data:`PROBE_TEACHER_UPTO` asks for a known ``n``), else None. A batch
        catches those rows' teachers up in one forward first (:class:`~kvlab.decode.BatchDecoding`)."""
        pol = self.config.refresh
        if pol is None or self.teacher_cache is None:
            return None
        probe = refresh_attr(pol, "probe")
        if probe is None:
            last = rec.step >= self.first_step + self.config.max_new_tokens - 1
            return rec.step if not last and pol.should_refresh(rec) else None
        upto = PROBE_TEACHER_UPTO.get(probe)
        if upto is not None and rec.step % refresh_attr(pol, "probe_every") == 0:
            return upto(rec.step)
        return None

    def _probe(self, rec: StepRecord, logits: torch.Tensor) -> StepRecord:
        """Phase 3: the refresh policy's probe, when one is due (signals go on the record)."""
        cfg = self.config
        policy = cfg.refresh
        probe = refresh_attr(policy, "probe") if policy is not None else None
        if probe is None or rec.step % refresh_attr(policy, "probe_every") != 0:
            return rec
        res = PROBES[probe](ProbeContext(
            teacher=self.teacher, student=self.student, cache=self.cache, teacher_cache=self.teacher_cache,
            prompt_ids=tuple(self.prompt_ids), tokens=tuple(self.tokens), logits=logits, step=rec.step,
            config=cfg, teacher_logits=self._teacher_upto))
        return replace(rec, probed=True, signals=Signals(res.signals), probe_tokens=self._acc["teacher_tokens"],
                       probe_cost=tuple(sorted((str(k), float(v)) for k, v in res.cost.items())))

    def _refresh_phase(self, rec: StepRecord) -> StepRecord:
        """Phase 4: ask the refresh policy; refresh (never after the last step)."""
        cfg = self.config
        if cfg.refresh is None or rec.step >= self.first_step + cfg.max_new_tokens - 1 \
                or not cfg.refresh.should_refresh(rec):
            return rec
        spliced, self._pending = self._refresh(rec.step)
        self._last_refresh = rec.step
        return replace(rec, refreshed=True, spliced=spliced)

    def _teacher_upto(self, n: int) -> torch.Tensor:
        """Extend the teacher's own cache to hold ``x, y_≤n`` (prefilling only what it lacks) and
        return ``p_T(· | x, y_≤n)``'s logits ``(V,)``. Teacher tokens and time go to this step's tally."""
        tc = self.teacher_cache
        have = tc.next_position - len(self.prompt_ids)      # the teacher's sync point s: it holds y_≤s
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"n={n} must be in [0, {len(self.tokens)}] (tokens generated so far)")
        if n < have:
            raise ValueError(f"the teacher cache already holds y_≤{have}; its logits for n={n} are gone")
        if n > have:
            t0 = time.perf_counter()
            self._teacher_logits = tc.forward(self.teacher.model, self.tokens[have:n], writer="teacher",
                                              step=len(self.tokens))
            _sync(self.teacher.device)
            self._acc["teacher_s"] += time.perf_counter() - t0
            self._acc["teacher_tokens"] += n - have
        return self._teacher_logits

    def _refresh(self, t: int) -> tuple[int, tuple | None]:
        """Refresh after ``y_t`` (see :mod:`kvlab.decode`'s docstring). Returns (entries rewritten, pending)."""
        cfg, cache, tc = self.config, self.cache, self.teacher_cache
        L = len(self.prompt_ids)
        window = refresh_attr(cfg.refresh, "window")
        t_logits = self._teacher_upto(t)                          # Δ = y_{s+1..t}; teacher holds x, y_≤t
        end = t - 1 if cfg.refresh_next == "rerun" else t         # newest entry rewritten now
        first = self._frontier + 1 if window is None else max(self._frontier + 1, end - window + 1)
        span = list(range(L + first - 1, L + end))                # positions of y_first .. y_end
        self._frontier = max(self._frontier, end)
        # eviction: only positions still live in the student cache are spliced (each layer rewrites the
        # ones it holds); evicted ones stay evicted
        if cfg.refresh_next == "teacher":
            live = cache.held(span[:-1])
            cache.splice_positions(tc, live)
            cache.append_from(tc, 1)                              # y_t: the entry the student lacked
            return len(live) + 1, (t_logits, "teacher")
        if cfg.refresh_next == "student":
            logits = cache.forward(self.student.model, [self.tokens[-1]], writer="student", step=t,
                                   attention=self._needs_attention)
            live = cache.held(span)
            cache.splice_positions(tc, live)                      # both caches end on y_t now
            return len(live), (logits, "student")
        live = cache.held(span)
        cache.splice_positions(tc, live)                          # "rerun": y_t's entry comes next step
        return len(live), None
