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
from .settings import (PRUNE_RATIOS, RANGES, Settings, check, decode_config, eviction_policies, normalize,
                       percentile_of)

# (name, label, format) of every readout, in display order
READOUTS = (("teacher_ppl", "teacher-PPL", ".4f"), ("kl", "KL(p_T‖q), nats", ".4f"), ("repeat3", "repeat@3", ".3f"),
            ("refreshes", "refreshes", "d"), ("teacher_tokens_pct", "teacher tokens %", ".1f"),
            ("overhead_pct", "overhead % (time vs baseline)", "+.1f"), ("tps", "decode tok/s", ".1f"),
            ("cache_kib", "cache KiB (mean per step)", ".0f"))


def readouts(result: dict, base: dict, mode: str) -> dict:
    """The readout values of a stored run ``result`` against its stored baseline ``base``.

    ``teacher_tokens_pct``: tokens the teacher processed while decoding (refresh prefills + probes; every
    token in teacher mode) per generated token. ``overhead_pct``: decode time vs the baseline's.
    """
    n = result["tokens"]
    tt = 100.0 if mode == "teacher" else 100.0 * result.get("teacher_tokens", 0) / max(n, 1)
    bt = base.get("total_s") or float("nan")
    return {"teacher_ppl": result["teacher_ppl"], "kl": result["kl"], "repeat3": result["repeat3"],
            "refreshes": int(result.get("refreshes", 0)), "teacher_tokens_pct": tt,
            "overhead_pct": 100.0 * (result["total_s"] - bt) / bt if bt and math.isfinite(bt) else float("nan"),
            "tps": result["tps"], "cache_kib": _mean_kib(result)}


def _mean_kib(result: dict) -> float:
    b = result.get("steps", {}).get("cache_bytes")
    return sum(b) / len(b) / 1024 if b else float("nan")


def fmt(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return format(value, spec)


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
                 calib_sampling=None, ranges: dict | None = None, prune_ratios=None, background: bool = True,
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
        self._students: dict[float, object] = {}
        self._fixed = isinstance(students, dict)     # only these students (tests inject tiny ones)
        if self._fixed:
            self._students.update({float(k): v for k, v in students.items()})
            self._factory = None
        else:
            self._factory = students
        if student is not None:
            self._students[float(self.settings.prune_ratio)] = student
        self.prune_ratios = tuple(prune_ratios) if prune_ratios is not None else (
            tuple(sorted(self._students)) if isinstance(students, dict) else PRUNE_RATIOS)
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

    def student_for(self, ratio: float):
        """The student of ``ratio`` (loaded/pruned on first use)."""
        ratio = float(ratio)
        if ratio not in self._students:
            if self._fixed:
                raise ValueError(f"prune_ratio={ratio} has no student; available: {sorted(self._students)}")
            if callable(self._factory):
                self._students[ratio] = self._factory(ratio)
            else:
                from ..models import load_student
                self._students[ratio] = load_student(ratio, device=self.teacher.device, dtype=self.teacher.dtype)
        return self._students[ratio]

    def _student_if_loaded(self, s: Settings):
        return None if s.mode == "teacher" else self._students.get(float(s.prune_ratio))

    # ------------------------------------------------------------------ checking and keys

    def check(self, s: Settings | None = None) -> dict[str, str]:
        """``{control: message}`` for every bad control of ``s`` (default: the current settings)."""
        return check(s or self.settings, vocab_size=self.vocab_size, eviction_names=self.eviction_names,
                     ranges=self.ranges, prune_ratios=self.prune_ratios)

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

        student = student or self.student_for(self.settings.prune_ratio)
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
        """Calibrated percentile of τ (student entropy) and κ (KL): ``{"tau_bits": p, "kappa": p}``
        (None where the calibration is not there yet)."""
        s = s or self.settings
        student = self._student_if_loaded(replace(s, mode="overfill"))
        cal = self.calibration(student, compute=False) if student is not None else None
        if cal is None:
            return {"tau_bits": None, "kappa": None}
        return {"tau_bits": percentile_of(cal.entropy, s.tau_bits), "kappa": percentile_of(cal.kl, s.kappa)}

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
        background (cancelling any run in flight). Unknown control names raise ValueError."""
        t0 = time.perf_counter()
        new = self.settings.replace(**changes)
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
            shown = self._from_disk(new, t0)
            if shown is not None:
                self._show(shown)
                self.last_response_s = time.perf_counter() - t0
                self._set_status(f"from the run store in {1000 * self.last_response_s:.0f} ms · run {shown.key}")
                return True
        self._set_status("decoding…")
        self.runner.submit(lambda job: self._live(job, new, t0), name="run")
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
                     prompt_len=self.prompt_len(s), source=source, seconds=time.perf_counter() - t0)

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
        if float(s.prune_ratio) not in self._students:
            self._emit("progress", Progress("student", 0, 1, f"loading the student (prune ratio {s.prune_ratio})…"))
        student = self.student_for(s.prune_ratio)
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

    def _live(self, job, s: Settings, t0: float) -> None:
        with self.gate.hold():
            student = self._ensure_student(s, job)
            if s.mode == "overfill":
                self._ensure_calibration(student, job)
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
            self._set_status(f"decoded in {shown.seconds:.1f} s{extra} · run {shown.key}")

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


__all__ = ["Cancelled", "LivePoint", "Playground", "Progress", "READOUTS", "Shown", "fmt", "readouts"]
