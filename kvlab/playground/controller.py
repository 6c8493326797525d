"""The playground's logic, in plain Python (no widgets): settings in, stored runs and readouts out.

:class:`Playground` holds the current :class:`~kvlab.playground.settings.Settings`. :meth:`Playground.set`
changes controls: bad values are reported per control (``errors``) and the last good result stays;
good ones are looked up in the :class:`~kvlab.store.RunStore` by their full config (the same key
:func:`kvlab.experiment.scored_run` stores under) and answered from disk, or started as a live run
on a background thread that streams :class:`LivePoint` events while it decodes. A newer change
cancels the run in flight; a cancelled run stores nothing, and only the newest request is ever
shown. Views subscribe with :meth:`Playground.subscribe`.

Every readout is set beside the *baseline*: the same prompt, mode, student, N, sampling and seed
with no refresh and the full cache (:meth:`Settings.baseline`).
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from ..experiment import run_config, scored_run
from ..store import RunStore, run_key
from .runner import Cancelled, ModelGate, Runner
from .settings import (PRUNE_RATIOS, PRUNED, RANGES, Range, Settings, check, decode_config, eviction_policies, normalize,
                       percentile_of, refresh_policy)
from .spread import Spread, pairs, spread_stats
from .students import load_variant, student_problem, student_variants_offered
from .students import student_key as _student_key
from .why import refresh_reasons, same_tokens_note

# (name, label, format) of every readout, in display order. "g3": three significant digits (one run is
# one sample: more digits would claim a precision it does not have). No readout compares times of two
# separately timed runs: the teacher's time share is measured inside the run itself, and "time vs baseline"
# is timed back to back on demand (Playground.time_vs_baseline).
READOUTS = (("teacher_ppl", "teacher-PPL", "g3"), ("kl", "KL(p_T‖q), nats", "g3"), ("repeat3", "repeat@3", "g3"),
            ("refreshes", "refreshes", "g3"), ("teacher_tokens_pct", "teacher tokens, % of generated", "g3"),
            ("teacher_time_pct", "teacher time, % of student time (in-run)", "g3"),
            ("cache_kib", "cache KiB (mean per step)", "g3"))


def readouts(result: dict, base: dict, mode: str) -> dict:
    """The readout values of a stored run ``result`` (``base``, its baseline, is accepted for the
    callers' symmetry; no readout mixes the two runs' timings).

    ``teacher_tokens_pct``: tokens the teacher processed while decoding (refresh prefills + probes; every
    token in teacher mode) per generated token. ``teacher_time_pct``: the teacher's compute time in this
    run as a % of the rest of this run's time (:func:`kvlab.refresh.run_costs` ``teacher_pct``; measured
    inside one run, so no cross-run timing noise; undefined in teacher mode). ``tps``: this run's decode
    speed (shown, never compared with the baseline's separately timed run).
    """
    n = result["tokens"]
    tt = 100.0 if mode == "teacher" else 100.0 * result.get("teacher_tokens", 0) / max(n, 1)
    share = float("nan") if mode == "teacher" else float(result.get("teacher_pct", float("nan")))
    return {"teacher_ppl": result["teacher_ppl"], "kl": result["kl"], "repeat3": result["repeat3"],
            "refreshes": int(result.get("refreshes", 0)), "teacher_tokens_pct": tt, "teacher_time_pct": share,
            "tps": result["tps"], "cache_kib": _mean_kib(result)}


def _mean_kib(result: dict) -> float:
    b = result.get("steps", {}).get("cache_bytes")
    return sum(b) / len(b) / 1024 if b else float("nan")


def fmt(value, spec: str) -> str:
    """``format(value, spec)``; ``"g<n>"``: n significant digits, plain notation in 1e-4 .. 1e7."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    sign = spec.startswith("+")
    spec = spec.lstrip("+")
    if spec.startswith("g") and spec[1:].isdigit():
        if isinstance(value, int) and not isinstance(value, bool):
            return format(value, "+d" if sign else "d")     # counts are exact
        n, v = int(spec[1:]), float(value)
        if v == 0:
            return "0"
        if not 1e-4 <= abs(v) < 1e7:
            return format(v, f"{'+' if sign else ''}.{n - 1}e")
        digits = max(0, n - 1 - math.floor(math.log10(abs(v))))
        r = round(v, digits)
        if r == 0:
            return "0"
        digits = max(0, n - 1 - math.floor(math.log10(abs(r))))
        return format(r, f"{'+' if sign else ''}.{digits}f")
    return format(value, ("+" if sign else "") + spec)


@dataclass(frozen=True)
class Shown:
    """What the view displays for one good configuration (a stored run and its stored baseline)."""

    settings: Settings
    key: str                  # run-store key of the run (runs/<key>.json)
    base_key: str
    result: dict              # the stored result (kvlab.experiment.scored_run)
    base: dict
    readouts: dict
    base_readouts: dict
    tokens: list              # text of each generated token
    base_tokens: list
    prompt_len: int           # cache entries of the prompt (generated token t sits at position prompt_len + t - 1)
    source: str               # "disk" (answered from the store) | "live" (decoded now)
    seconds: float            # from the request to this result (for "disk": lookup + readouts)
    reasons: tuple = ()       # (step, why) of every refresh: the policy's own words (kvlab.playground.why)
    note: str | None = None   # "same tokens as the baseline, so the same PPL" when that is the case

    @property
    def label(self) -> str:
        """A short name of this configuration (legends, pins, exports)."""
        return describe(self.settings)


def describe(s: Settings) -> str:
    """Short label: mode, refresh policy with its parameters, eviction with its budget, student, seed."""
    from .settings import EVICT_PARAMS, POLICY_PARAMS

    parts = [s.mode]
    if s.policy != "none":
        parts.append(s.policy + "(" + ",".join(f"{k}={getattr(s, k)}" for k in POLICY_PARAMS[s.policy]
                                               if not (k == "W" and not s.W)) + ")")
    if s.evict != "full":
        parts.append(f"{s.evict}@{s.budget}" + "".join(f",{k}={getattr(s, k)}" for k in EVICT_PARAMS.get(s.evict, ())))
    if s.mode != "teacher":
        parts.append(f"pruned {s.prune_ratio}" if s.student == "pruned" else f"student {s.student}")
    parts.append(f"seed {s.seed}")
    return " · ".join(parts)


@dataclass(frozen=True)
class LivePoint:
    """One decoded step of a live run, streamed while it decodes."""

    stage: str                # "baseline" | "run" | "precompute"
    step: int
    total: int
    token: str
    entropy_bits: float
    refreshed: bool
    source: str
    cache_len: int
    tps: float                # streamed tokens/s so far (decode steps after the first)
    positions: tuple = ()     # the decoding cache now: position and writer of every slot
    writers: tuple = ()


@dataclass(frozen=True)
class Progress:
    stage: str                # "calibration" | "student" | "baseline" | "run" | "precompute"
    done: int
    total: int
    message: str = ""


class Playground:
    """Controller of the playground (see the module docstring).

    ``teacher``: an :class:`~kvlab.models.LM`. Students per prune ratio come from ``students`` (a
    dict ``ratio -> LM`` or a callable ``ratio -> LM``; default: :func:`kvlab.models.load_student`,
    pruning on first use), plus ``student`` for the initial ratio. ``store``: the run store (default
    ``$KVLAB_RUNS`` or ``runs/``). ``prompts``: the prompt list offered (default ``data/prompts.jsonl``).
    ``calib_prompts`` / ``calib_tokens``: the no-refresh OverFill runs whose student entropy and KL
    give the calibrated percentile of τ and κ (default: 2 prompts of ``data/calibration.jsonl``).
    ``background=False`` runs everything inline (scripts, tests).
    """

    def __init__(self, teacher, student=None, *, students=None, store: RunStore | None = None, prompts=None,
                 settings: Settings | None = None, calib_prompts=None, calib_tokens: int | None = None,
                 calib_sampling=None, ranges: dict | None = None, prune_ratios=None, student_variants=None,
                 background: bool = True,
                 gate: ModelGate | None = None):
        from ..data import load_prompts
        from ..decode import Sampling

        self.teacher = teacher
        self.store = store if store is not None else RunStore()
        self.prompts = list(prompts) if prompts is not None else [r["prompt"] for r in load_prompts()]
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt")
        self.settings = normalize(settings or Settings(prompt=self.prompts[0]))
        self.ranges = {**RANGES, **(ranges or {})}
        self._students: dict[tuple, object] = {}     # (variant, prune ratio or None) -> LM
        self._fixed = isinstance(students, dict)     # only these students (tests inject tiny ones)
        if self._fixed:
            self._students.update({_student_key(k): v for k, v in students.items()})
            self._factory = None
        else:
            self._factory = students
        if student is not None:
            self._students[_student_key(self.settings)] = student
        self.prune_ratios = tuple(prune_ratios) if prune_ratios is not None else (
            tuple(sorted(r for v, r in self._students if v == PRUNED)) if self._fixed else PRUNE_RATIOS)
        if student_variants is not None:
            self.student_variants = tuple(student_variants)
        elif self._fixed:
            self.student_variants = tuple(dict.fromkeys(v for v, _ in self._students))
        else:
            self.student_variants = student_variants_offered()
        if calib_prompts is None:
            from ..data import calibration_file
            calib_prompts = [r["prompt"] for r in load_prompts(calibration_file(), n=2)]
        self.calib_prompts = tuple(calib_prompts)
        self.calib_tokens = calib_tokens or self.settings.N
        self.calib_sampling = calib_sampling or Sampling(temperature=0.7, top_p=0.9, seed=0)
        self.eviction_names = tuple(sorted(eviction_policies()))
        self.vocab_size = int(teacher.model.get_input_embeddings().weight.shape[0])
        self.gate = gate or ModelGate()
        self.runner = Runner(background=background, on_error=self._job_failed)
        self.errors: dict[str, str] = {}
        self.shown: Shown | None = None
        self.status = ""
        self.last_response_s: float | None = None       # set() -> readouts redrawn, for the last disk answer
        self.last_live: dict | None = None               # the last finished live run: tokens, seconds, tok/s
        self._listeners: list[Callable] = []
        self._show_lock = threading.RLock()
        self._cal: dict[str, object] = {}
        self._mc_cal: dict[tuple, dict] = {}
        self.spread: Spread | None = None                # readouts over N prompts × seeds (None: one run)
        self.pinned: list[Shown] = []                    # runs pinned for overlay (oldest first)
        self.timing: dict | None = None                  # the last back-to-back timing vs the baseline
        self._prompt_len: dict[tuple, int] = {}
        self._tok_text: dict[tuple, str] = {}

    # ------------------------------------------------------------------ events

    def subscribe(self, fn: Callable[[str, object], None]) -> None:
        """``fn(event, payload)`` for events "errors" (dict), "shown" (Shown), "live_start" (Settings),
        "point" (LivePoint), "progress" (Progress), "status" (str), "percentiles" (dict)."""
        self._listeners.append(fn)

    def _emit(self, event: str, payload) -> None:
        for fn in list(self._listeners):
            try:
                fn(event, payload)
            except Exception as e:  # a broken view must not break the controller
                import traceback
                traceback.print_exc()
                self.status = f"view error: {type(e).__name__}: {e}"

    def _set_status(self, text: str) -> None:
        self.status = text
        self._emit("status", text)

    # ------------------------------------------------------------------ models

    def student_for(self, s: Settings | float):
        """The student of settings ``s`` (its variant, and prune ratio for the pruned one; a bare number
        is a prune ratio of the pruned student), loaded on first use: ``students(variant, ratio)`` when
        a factory was given, else :func:`kvlab.models.load_student` (a trained variant must be in the
        model cache: ``python -m kvlab train-student`` builds it)."""
        key = _student_key(s)
        if key not in self._students:
            if self._fixed:
                raise ValueError(f"student {key[0]!r} at prune_ratio={key[1]} has no model; available: "
                                 f"{sorted(self._students, key=str)}")
            if callable(self._factory):
                self._students[key] = self._factory(*key) if key[0] != PRUNED else self._factory(key[1])
            else:
                self._students[key] = load_variant(key[0], key[1], device=self.teacher.device, dtype=self.teacher.dtype)
        return self._students[key]

    def _student_if_loaded(self, s: Settings):
        return None if s.mode == "teacher" else self._students.get(_student_key(s))

    # ------------------------------------------------------------------ checking and keys

    def check(self, s: Settings | None = None) -> dict[str, str]:
        """``{control: message}`` for every bad control of ``s`` (default: the current settings)."""
        s = s or self.settings
        err = check(s, vocab_size=self.vocab_size, eviction_names=self.eviction_names,
                    ranges=self.ranges, prune_ratios=self.prune_ratios, students=self.student_variants)
        if "n_prompts" not in err and "prompt" not in err and isinstance(s.n_prompts, int):
            try:
                pairs(s, self.prompts)
            except ValueError as e:
                err["n_prompts"] = str(e)
        if "student" not in err and s.mode != "teacher" and self._factory is None and not self._fixed \
                and _student_key(s) not in self._students:
            problem = student_problem(s.student)      # a trained student the model cache lacks: name train-student
            if problem:
                err["student"] = problem
        return err

    def config(self, s: Settings, student) -> dict:
        """The run-store config of ``s`` (what :func:`scored_run` keys the run under)."""
        cfg = replace(decode_config(s), keep_dists=True)
        return run_config(self.teacher, None if s.mode == "teacher" else student, s.prompt, cfg)

    def key(self, s: Settings | None = None) -> str | None:
        """The run-store key of ``s`` (None while its student is not loaded)."""
        s = s or self.settings
        student = self._student_if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        return run_key(self.config(s, student))

    def stored(self, s: Settings | None = None) -> dict | None:
        """The stored result of ``s`` or None."""
        s = s or self.settings
        student = self._student_if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        return self.store.get(self.config(s, student))

    # ------------------------------------------------------------------ calibration

    def calibration(self, student=None, compute: bool = True):
        """τ/κ calibration (kvlab.refresh_tables.calibrate) for ``student`` (default: the current one):
        student entropy and KL over no-refresh OverFill runs on the calibration prompts. Without
        ``compute``, only if it is in memory or every run is already stored (else None)."""
        from ..experiment import RunSpec
        from ..refresh_tables import calibrate

        student = student or self.student_for(self.settings)
        fp = student.fingerprint
        if fp not in self._cal:
            spec = RunSpec(prompts=self.calib_prompts, tokens=self.calib_tokens, sampling=self.calib_sampling)
            if not compute:
                from ..decode import DecodeConfig
                for i, p in enumerate(spec.prompts):
                    cfg = DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i),
                                       keep_dists=True)
                    if self.store.get(run_config(self.teacher, student, p, cfg)) is None:
                        return None
            self._cal[fp] = calibrate(self.teacher, student, spec, self.store)
        return self._cal[fp]

    def percentiles(self, s: Settings | None = None) -> dict:
        """Calibrated percentile of τ (student entropy), κ (KL) and the MC threshold (its signal):
        ``{"tau_bits": p, "kappa": p, "mc_threshold": p}`` (None where the calibration is not there yet)."""
        s = s or self.settings
        student = self._student_if_loaded(replace(s, mode="overfill"))
        cal = self.calibration(student, compute=False) if student is not None else None
        out = {"tau_bits": None, "kappa": None, "mc_threshold": None}
        if cal is not None:
            out.update(tau_bits=percentile_of(cal.entropy, s.tau_bits), kappa=percentile_of(cal.kl, s.kappa))
        if s.policy == "mc" and student is not None and not check(s, ranges=self.ranges).keys() & {"mc_passes", "mc_p", "mc_signal"}:
            mc = self.mc_calibration(s, compute=False)
            if mc is not None:
                out["mc_threshold"] = percentile_of(mc[s.mc_signal], s.mc_threshold)
        return out

    def tau_at(self, percentile: float) -> float:
        """τ (bits) at a calibrated percentile of the current student's entropy, on the slider's grid."""
        cal = self.calibration()
        r = self.ranges["tau_bits"]
        v = cal.tau(percentile)
        return min(r.hi, max(r.lo, round(round((v - r.lo) / r.step) * r.step + r.lo, 6)))

    # ------------------------------------------------------------------ requests

    def start(self) -> bool:
        """Show the current settings (stored or computed now) and wait for it."""
        ok = self.set()
        self.wait()
        return ok

    def set(self, **changes) -> bool:
        """Change controls. Bad values: ``errors`` names them, the last good result stays shown,
        returns False. Good ones: the stored run is shown at once, or a live run starts in the
        background (cancelling any run in flight). Unknown control names raise ValueError.

        With ``n_prompts``/``n_seeds`` above 1 the other (prompt, seed) pairs follow in the background
        (from the store or decoded), with a "spread" event after each. Choosing the MC gate, or another
        MC signal / pass count / dropout p, without naming ``mc_threshold`` puts the threshold at the
        signal's calibrated 90th percentile (calibrating first when needed)."""
        t0 = time.perf_counter()
        new = self.settings.replace(**changes)
        auto_mc = new.policy == "mc" and "mc_threshold" not in changes and bool(
            {"policy", "mc_signal", "mc_passes", "mc_p", "prune_ratio", "student"} & set(changes))
        if auto_mc and not check(new, ranges=self.ranges).keys() & {"mc_passes", "mc_p", "mc_signal"}:
            thr = self.mc_threshold_at(MC_PERCENTILE, new, compute=False)
            if thr is not None:
                new, auto_mc = new.replace(mc_threshold=thr), False
                self._emit("settings", new)
        self.settings = new
        errors = self.check(new)
        self.errors = errors
        self._emit("errors", dict(errors))
        if errors:
            with self._show_lock:
                self.runner.cancel()
            self._set_status("fix the marked control; showing the last good result")
            return False
        self._emit("percentiles", self.percentiles(new))
        with self._show_lock:
            self.runner.cancel()
            self.spread = None                           # the spread shown belongs to the old settings
            self._emit("spread", None)
            shown = None if auto_mc else self._from_disk(new, t0)
            if shown is not None:
                self._show(shown)
                self.last_response_s = time.perf_counter() - t0
                self._set_status(f"from the run store in {1000 * self.last_response_s:.0f} ms")
                if len(pairs(new, self.prompts)) > 1:
                    self.runner.submit(lambda job: self._spread(job, new), name="spread")
                return True
        self._set_status("decoding…")
        self.runner.submit(lambda job: self._live(job, new, t0, auto_mc), name="run")
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background work (True when none is left)."""
        return self.runner.wait(timeout)

    def cancel(self) -> None:
        with self._show_lock:
            self.runner.cancel()
        self._set_status("cancelled")

    def _show(self, shown: Shown) -> None:
        self.shown = shown
        self._emit("shown", shown)

    def _job_failed(self, job, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        if self.runner.is_current(job) or self.runner.current is None:
            self.errors = {**self.errors, "run": msg}
            self._emit("errors", dict(self.errors))
        self._set_status(f"run failed ({msg}); showing the last good result")

    # ------------------------------------------------------------------ building what is shown

    def _tokens(self, s: Settings, ids) -> list[str]:
        lm = self._student_if_loaded(s) if s.mode == "student" else self.teacher
        tok = lm.tokenizer
        out = []
        for i in ids:
            k = (id(tok), int(i))
            if k not in self._tok_text:
                self._tok_text[k] = tok.decode([int(i)])
            out.append(self._tok_text[k])
        return out

    def prompt_len(self, s: Settings) -> int:
        lm = self._student_if_loaded(s) if s.mode == "student" else self.teacher
        k = (id(lm), s.prompt)
        if k not in self._prompt_len:
            self._prompt_len[k] = len(lm.encode_prompt(s.prompt))
        return self._prompt_len[k]

    def _build(self, s: Settings, student, result: dict, base: dict, source: str, t0: float) -> Shown:
        b = s.baseline()
        return Shown(settings=s, key=run_key(self.config(s, student)), base_key=run_key(self.config(b, student)),
                     result=result, base=base, readouts=readouts(result, base, s.mode),
                     base_readouts=readouts(base, base, s.mode),
                     tokens=self._tokens(s, result["steps"]["token_id"]),
                     base_tokens=self._tokens(s, base["steps"]["token_id"]),
                     prompt_len=self.prompt_len(s), source=source, seconds=time.perf_counter() - t0,
                     reasons=tuple(refresh_reasons(refresh_policy(s), result["steps"])),
                     note=same_tokens_note(result, base) if s.policy != "none" else None)

    def _from_disk(self, s: Settings, t0: float) -> Shown | None:
        student = self._student_if_loaded(s)
        if s.mode != "teacher" and student is None:
            return None
        result = self.store.get(self.config(s, student))
        if result is None:
            return None
        base = self.store.get(self.config(s.baseline(), student))
        if base is None:
            return None
        return self._build(s, student, result, base, "disk", t0)

    # ------------------------------------------------------------------ background work

    def _scored(self, s: Settings, student, on_step=None) -> dict:
        return scored_run(self.teacher, None if s.mode == "teacher" else student, s.prompt, decode_config(s),
                          self.store, on_step=on_step)

    def _streamer(self, job, stage: str, total: int, points: bool):
        state = {"t1": None, "t0": time.perf_counter()}

        def on_step(rec, d):
            job.check()
            now = time.perf_counter()
            if state["t1"] is None:
                state["t1"] = now
            tps = (rec.step - 1) / (now - state["t1"]) if rec.step > 1 and now > state["t1"] else float("nan")
            state["last"], state["n"] = now, rec.step
            if self.runner.is_current(job):
                if points:
                    c = d.cache
                    self._emit("point", LivePoint(stage=stage, step=rec.step, total=total, token=rec.token,
                                                  entropy_bits=rec.entropy_bits, refreshed=rec.refreshed,
                                                  source=rec.source, cache_len=rec.cache_len, tps=tps,
                                                  positions=tuple(c.positions), writers=tuple(c.writers)))
                else:
                    self._emit("progress", Progress(stage, rec.step, total, f"{stage}: {rec.step}/{total}"))
            self.gate.pause_point()

        on_step.state = state
        return on_step

    def _ensure_student(self, s: Settings, job):
        if s.mode == "teacher":
            return None
        if _student_key(s) not in self._students:
            what = f"prune ratio {s.prune_ratio}" if s.student == PRUNED else f"variant {s.student}"
            self._emit("progress", Progress("student", 0, 1, f"loading the student ({what})…"))
        student = self.student_for(s)
        job.check()
        return student

    def _ensure_calibration(self, student, job) -> None:
        if student is None or student.fingerprint in self._cal:
            return
        if self.calibration(student, compute=False) is None:
            self._emit("progress", Progress("calibration", 0, len(self.calib_prompts),
                                            f"calibrating τ/κ on {len(self.calib_prompts)} prompt(s)…"))
            self.calibration(student)
        job.check()

    def _live(self, job, s: Settings, t0: float, auto_mc: bool = False) -> None:
        with self.gate.hold():
            student = self._ensure_student(s, job)
            if s.mode == "overfill":
                self._ensure_calibration(student, job)
                if s.policy == "mc":
                    if self.mc_calibration(s, compute=False) is None:
                        self._emit("progress", Progress("calibration", 0, len(self.calib_prompts),
                                                        f"calibrating the MC signals ({s.mc_passes} passes, p={s.mc_p})…"))
                        self.mc_calibration(s)
                        job.check()
                    if auto_mc:
                        s = s.replace(mc_threshold=self.mc_threshold_at(MC_PERCENTILE, s))
                        with self._show_lock:
                            if self.runner.is_current(job):
                                self.settings = s
                                self._emit("settings", s)
                if self.runner.is_current(job):
                    self._emit("percentiles", self.percentiles(s))
            b = s.baseline()
            if self.config(b, student) != self.config(s, student):
                base = self._scored(b, student, self._streamer(job, "baseline", b.N, points=False))
            if self.runner.is_current(job):
                self._emit("live_start", s)
            streamer = self._streamer(job, "run", s.N, points=True)
            result = self._scored(s, student, streamer)
            job.check()
            if self.config(b, student) == self.config(s, student):
                base = result
        st = streamer.state
        live = None
        if st.get("n", 0) > 1 and st["last"] > st["t1"]:      # decoded now (not a store hit)
            live = {"tokens": st["n"], "seconds": st["last"] - st["t0"],
                    "tps": (st["n"] - 1) / (st["last"] - st["t1"])}
        with self._show_lock:
            if not self.runner.is_current(job):
                return
            self.last_live = live or self.last_live
            shown = self._build(s, student, result, base, "live" if live else "disk", t0)
            self._show(shown)
            extra = f" · streamed at {live['tps']:.1f} tok/s" if live else ""
            self._set_status(f"decoded in {shown.seconds:.1f} s{extra}" if live else
                             f"from the run store in {1000 * shown.seconds:.0f} ms")
        if len(pairs(s, self.prompts)) > 1:
            self._spread(job, s)

    # ------------------------------------------------------------------ spread over prompts × seeds

    def _spread(self, job, s: Settings) -> None:
        """Readouts over ``pairs(s)``: each (prompt, seed) run and its baseline from the store, or
        decoded now; a "spread" event after each pair (only while this job is current)."""
        ps = pairs(s, self.prompts)
        rows = []
        with self.gate.hold():
            student = self._ensure_student(s, job)
            for i, p in enumerate(ps):
                # one store lookup per run; a pair that must be decoded reports its progress from its steps
                r = self._scored(p, student, self._pair_progress(job, i, len(ps), p.N))
                b = self._scored(p.baseline(), student, self._pair_progress(job, i, len(ps), p.N))
                rows.append((readouts(r, b, s.mode), readouts(b, b, s.mode)))
                with self._show_lock:
                    if not self.runner.is_current(job):
                        return
                    self.spread = Spread(s, i + 1, len(ps), spread_stats(rows))
                    self._emit("spread", self.spread)
        if self.runner.is_current(job):
            self._emit("progress", Progress("spread", len(ps), len(ps), ""))

    def _pair_progress(self, job, i: int, n: int, total: int):
        def on_step(rec, d):
            job.check()
            if rec.step == 1 and self.runner.is_current(job):
                self._emit("progress", Progress("spread", i, n, f"spread: pair {i + 1}/{n} decoding…"))
            self.gate.pause_point()
        return on_step

    # ------------------------------------------------------------------ MC-gate calibration

    def mc_calibration(self, s: Settings | None = None, compute: bool = True) -> dict | None:
        """``{"u": values, "mi": values, "flip": values}``: every MC signal at every student step of
        no-refresh OverFill runs on the calibration prompts, probed at every step with ``s``'s pass
        count and dropout p (stored runs: an MC gate whose threshold never fires). Without ``compute``,
        only if in memory or every run is stored (else None)."""
        from ..decode import DecodeConfig
        from ..mc import MCGate, SIGNALS

        s = s or self.settings
        student = self.student_for(s) if compute else self._student_if_loaded(replace(s, mode="overfill"))
        if student is None:
            return None
        k = (student.fingerprint, int(s.mc_passes), float(s.mc_p))
        if k in self._mc_cal:
            return self._mc_cal[k]
        gate = MCGate(threshold=MC_NEVER, signal="mi", probe_every=1, refractory=0, n_passes=int(s.mc_passes),
                      dropout_p=float(s.mc_p))
        cfgs = [(p, DecodeConfig(mode="overfill", max_new_tokens=self.calib_tokens, refresh=gate,
                                 sampling=replace(self.calib_sampling, seed=self.calib_sampling.seed + i)))
                for i, p in enumerate(self.calib_prompts)]
        if not compute and any(self.store.get(run_config(self.teacher, student, p, replace(c, keep_dists=True))) is None
                               for p, c in cfgs):
            return None
        values = {sig: [] for sig in SIGNALS}
        for p, c in cfgs:
            res = scored_run(self.teacher, student, p, c, self.store)
            for sig, src in zip(res["steps"]["signals"], res["steps"]["source"]):
                if src == "student" and f"mc_{SIGNALS[0]}" in (sig or {}):
                    for name in SIGNALS:
                        values[name].append(float(sig[f"mc_{name}"]))
        if not values[SIGNALS[0]]:
            raise ValueError(f"calib_tokens={self.calib_tokens} gave no probed student step; raise calib_tokens")
        self._mc_cal[k] = {name: tuple(v) for name, v in values.items()}
        return self._mc_cal[k]

    def mc_range(self, s: Settings | None = None) -> Range:
        """The MC-threshold slider's range for ``s``'s signal: 0 to the calibrated maximum rounded up
        (about 200 steps); the static range until the calibration is there."""
        s = s or self.settings
        cal = self.mc_calibration(s, compute=False)
        if cal is None or not cal.get(s.mc_signal):
            return self.ranges["mc_threshold"]
        return nice_range(max(cal[s.mc_signal]))

    def mc_threshold_at(self, percentile: float, s: Settings | None = None, compute: bool = True) -> float | None:
        """The MC threshold at a calibrated percentile of ``s``'s signal, on the slider's grid."""
        import numpy as np

        s = s or self.settings
        cal = self.mc_calibration(s, compute=compute)
        if cal is None:
            return None
        r = self.mc_range(s)
        v = float(np.percentile(cal[s.mc_signal], percentile))
        return min(r.hi, max(r.lo, round(round((v - r.lo) / r.step) * r.step + r.lo, 6)))

    # ------------------------------------------------------------------ pins (overlay)

    def pin(self) -> Shown:
        """Pin the shown run: it stays overlaid on the plots and beside the readouts while the controls
        move (at most :data:`MAX_PINS`, oldest dropped first). Pinning a pinned run does nothing."""
        sh = self.shown
        if sh is None:
            raise ValueError("nothing is shown yet: wait for a run before pinning")
        if all(p.key != sh.key for p in self.pinned):
            self.pinned = (self.pinned + [sh])[-MAX_PINS:]
        self._emit("pins", tuple(self.pinned))
        return sh

    def unpin(self, key: str | None = None) -> None:
        """Unpin run ``key`` (every run when None)."""
        if key is not None and all(p.key != key for p in self.pinned):
            raise ValueError(f"key={key!r} is not pinned; pinned: {[p.key for p in self.pinned]}")
        self.pinned = [] if key is None else [p for p in self.pinned if p.key != key]
        self._emit("pins", tuple(self.pinned))

    # ------------------------------------------------------------------ timing, back to back

    def time_vs_baseline(self, repeats: int = 3):
        """Time the current configuration against its baseline back to back
        (:func:`kvlab.refresh_tables.paired_timing`: same prompt and seed, order alternating, one
        warm-up; the baseline is also timed against itself, the noise floor) in the background; a
        "timing" event carries ``{"settings", "overhead_pct", "q25", "q75", "pairs", "noise_pct", "tps"}``.
        Not read from the store: times belong to this machine, now."""
        from ..experiment import RunSpec
        from ..refresh_tables import overhead_table, paired_timing
        from .settings import sampling_of

        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats={repeats!r} must be a positive int (pairs timed)")
        if self.errors:
            raise ValueError(f"fix {sorted(self.errors)} first; the timing uses the current controls")
        s = self.settings

        def work(job):
            with self.gate.hold():
                student = self._ensure_student(s, job)
                if self.runner.is_current(job):
                    self._emit("progress", Progress("timing", 0, 1, f"timing vs the baseline: {repeats} pair(s) back to back…"))
                spec = RunSpec(prompts=(s.prompt,), tokens=s.N, sampling=sampling_of(s))
                t = paired_timing(self.teacher, student, spec, {"baseline": decode_config(s.baseline()),
                                                                "run": decode_config(s)},
                                  base="baseline", prompts=1, repeats=repeats)
            tab = overhead_table(t).set_index("policy")
            run, aa = tab.loc["run"], tab.loc["baseline"]
            out = {"settings": s, "overhead_pct": float(run.overhead_pct), "q25": float(run.overhead_pct_q25),
                   "q75": float(run.overhead_pct_q75), "pairs": int(run.pairs), "noise_pct": float(aa.overhead_pct),
                   "tps": float(run.tps)}
            with self._show_lock:
                if self.runner.is_current(job):
                    self.timing = out
                    self._emit("timing", out)
                    self._emit("progress", Progress("timing", 1, 1, ""))

        return self.runner.submit(work, name="timing")

    # ------------------------------------------------------------------ precompute

    def grid(self, param: str) -> list:
        """The slider positions of ``param`` that are valid with the other current controls."""
        if param not in self.ranges:
            raise ValueError(f"param={param!r} has no slider; sliders: {sorted(self.ranges)}")
        out = []
        for v in self.ranges[param].positions():
            if not self.check(self.settings.replace(**{param: v})):
                out.append(v)
        return out

    def precompute(self, param: str, values=None):
        """Run (and store) every slider position of ``param`` for the current prompt and other
        controls, in the background, with "progress" events. Returns the job. A later :meth:`set`
        cancels it; positions finished by then stay stored."""
        if self.errors:
            raise ValueError(f"fix {sorted(self.errors)} first; precompute uses the other current controls")
        base_s = self.settings
        values = list(values) if values is not None else self.grid(param)
        bad = [v for v in values if self.check(base_s.replace(**{param: v}))]
        if bad:
            raise ValueError(f"values {bad} of {param} are not valid with the current controls")

        def work(job):
            t0 = time.perf_counter()
            fresh = 0
            with self.gate.hold():
                student = self._ensure_student(base_s, job)
                b = base_s.baseline()
                self._scored(b, student, self._cancel_only(job))
                for i, v in enumerate(values):
                    s = base_s.replace(**{param: v})
                    if self.runner.is_current(job):
                        self._emit("progress", Progress("precompute", i, len(values), f"{param} = {v}"))
                    if self.store.get(self.config(s, student)) is None:
                        self._scored(s, student, self._cancel_only(job))
                        fresh += 1
            with self._show_lock:
                if not self.runner.is_current(job):
                    return
                self._emit("progress", Progress("precompute", len(values), len(values),
                                                f"{param}: {len(values)} positions stored ({fresh} new) "
                                                f"in {time.perf_counter() - t0:.1f} s"))
                cur = self.settings
                if not self.check(cur):
                    shown = self._from_disk(cur, time.perf_counter())
                    if shown is not None:
                        self._show(shown)

        self._set_status(f"precomputing {param} over {len(values)} positions…")
        with self._show_lock:
            return self.runner.submit(work, name="precompute")

    def _cancel_only(self, job):
        def on_step(rec, d):
            job.check()
            self.gate.pause_point()
        return on_step

    # ------------------------------------------------------------------ step-through

    def stepper(self):
        """A :class:`~kvlab.playground.stepper.Stepper` over the current settings (shares the models)."""
        from .stepper import Stepper

        return Stepper(self)


MC_NEVER = 1e30          # an MC gate threshold no signal reaches (calibration runs probe but never refresh)
MC_PERCENTILE = 90.0     # the MC threshold a newly chosen signal starts at (calibrated percentile)
MAX_PINS = 4


def nice_range(top: float, steps: int = 200) -> Range:
    """``0 .. top`` rounded up to a 1/2/5 × 10^k step, about ``steps`` steps."""
    if not math.isfinite(top) or top <= 0:
        return Range(0.0, 1.0, 0.01)
    raw = top / steps
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    step = round(step, 10)
    hi = round(math.ceil(top / step) * step, 10)
    return Range(0.0, hi, step)


__all__ = ["Cancelled", "LivePoint", "Playground", "Progress", "READOUTS", "Shown", "describe", "fmt", "nice_range",
           "readouts"]
