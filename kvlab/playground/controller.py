"""The playground's logic, in plain Python (no widgets): settings in, stored runs and readouts out.

:class:`Playground` holds the current :class:`~kvlab.playground.settings.Settings`. :meth:`Playground.set`
changes controls: bad values are reported per control (``errors``) and the last good result stays;
good ones are looked up in the :class:`~kvlab.store.RunStore` by their full config (the same key
:func:`kvlab.harness.experiment.scored_run` stores under) and answered from disk, or started as a live run
on a background thread that streams :class:`LivePoint` events while it decodes. A newer change
cancels the run in flight; a cancelled run stores nothing, and only the newest request is ever
shown. Views subscribe with :meth:`Playground.subscribe`.

Every readout is set beside the *baseline*: the same prompt, mode, student, N, sampling and seed
with no refresh and the full cache (:meth:`Settings.baseline`).

:class:`Playground` composes its parts: :class:`~kvlab.playground.students.StudentPool` (the students),
:class:`~kvlab.playground.checks.SettingsChecker` (settings validation),
:class:`~kvlab.playground.reader.RunReader` (the run store), :class:`~kvlab.playground.calibration.Calibrator`
(τ/κ and MC calibrations), :class:`~kvlab.playground.compare.Pins` (pinned runs) and
:class:`~kvlab.playground.jobs.Jobs` (the background work); what it shows is in
:mod:`kvlab.playground.shown`, and the shown run's cache inspector in :mod:`kvlab.playground.inspection`.
Its read-only queries (a setting's student, checks, slider grid, store key, stored result, calibrations)
are the :class:`~kvlab.playground.lookups.Lookups` it inherits.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from kvlab.store import RunStore
from kvlab.playground.calibration import MC_NEVER, MC_PERCENTILE, Calibrator, nice_range
from kvlab.playground.checks import SettingsChecker
from kvlab.playground.compare import MAX_PINS, Pins, check_repeats
from kvlab.playground.inspection import Inspection
from kvlab.playground.jobs import Jobs
from kvlab.playground.lookups import Lookups
from kvlab.playground.reader import RunReader
from kvlab.playground.runner import Cancelled, ModelGate, Runner
from kvlab.playground.settings import RANGES, Settings, check, eviction_policies, normalize
from kvlab.playground.shown import READOUTS, LivePoint, Progress, Shown, describe, fmt, readouts
from kvlab.playground.spread import Spread, pairs
from kvlab.playground.students import StudentPool, load_variant


class Playground(Lookups):
    """Controller of the playground (see the module docstring). Its read-only queries (``student_for``,
    ``check``, ``grid``, ``key``, ``stored``, ``calibration``, ``percentiles``, ``mc_threshold_at`` …) are
    inherited from :class:`~kvlab.playground.lookups.Lookups`.

    ``teacher``: an :class:`~kvlab.core.models.LM`. Students per prune ratio come from ``students`` (a
    dict ``ratio -> LM`` or a callable ``ratio -> LM``; default: :func:`kvlab.train.pair.load_student`,
    pruning on first use), plus ``student`` for the initial ratio. ``store``: the run store (default
    ``$KVLAB_RUNS`` or ``runs/``). ``prompts``: the prompt list offered (default ``data/prompts.jsonl``).
    ``calib_prompts`` / ``calib_tokens``: the no-refresh OverFill runs whose student entropy and KL
    give the calibrated percentile of τ and κ (default: 2 prompts of ``data/calibration.jsonl``).
    ``background=False`` runs everything inline (scripts, tests). ``batch``: runs of the prompts × seeds
    spread decoded together (default :data:`kvlab.harness.experiment.DEFAULT_BATCH`; 1 = one at a time).
    """

    def __init__(self, teacher, student=None, *, students=None, store: RunStore | None = None, prompts=None,
                 settings: Settings | None = None, calib_prompts=None, calib_tokens: int | None = None,
                 calib_sampling=None, ranges: dict | None = None, prune_ratios=None, student_variants=None,
                 background: bool = True,
                 gate: ModelGate | None = None, batch: int | None = None):
        from kvlab.core.data import load_prompts
        from kvlab.decode import Sampling
        from kvlab.harness.experiment import check_batch

        self.batch = check_batch(batch)
        self.teacher = teacher
        self.store = store if store is not None else RunStore()
        self.prompts = list(prompts) if prompts is not None else [r["prompt"] for r in load_prompts()]
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt")
        self.settings = normalize(settings or Settings(prompt=self.prompts[0]))
        self.ranges = {**RANGES, **(ranges or {})}
        self.students = StudentPool(teacher, students, student, self.settings, prune_ratios, student_variants)
        self.prune_ratios = self.students.prune_ratios
        self.student_variants = self.students.variants
        if calib_prompts is None:
            from kvlab.core.data import calibration_file
            calib_prompts = [r["prompt"] for r in load_prompts(calibration_file(), n=2)]
        self.calib = Calibrator(teacher, self.students, self.store, self.ranges, calib_prompts,
                                calib_tokens or self.settings.N,
                                calib_sampling or Sampling(temperature=0.7, top_p=0.9, seed=0))
        self.reader = RunReader(teacher, self.students, self.store)
        self.eviction_names = tuple(sorted(eviction_policies()))
        self.vocab_size = int(teacher.model.get_input_embeddings().weight.shape[0])
        self.checker = SettingsChecker(vocab_size=self.vocab_size, eviction_names=self.eviction_names,
                                       ranges=self.ranges, students=self.students, prompts=self.prompts)
        self.gate = gate or ModelGate()
        self.runner = Runner(background=background, on_error=self._job_failed)
        self.jobs = Jobs(self)
        self.pins = Pins()
        self.errors: dict[str, str] = {}
        self.shown: Shown | None = None
        self.inspection: Inspection | None = None        # the shown run's cache inspector (kvlab.playground.inspection)
        self.status = ""
        self.last_response_s: float | None = None       # set() -> readouts redrawn, for the last disk answer
        self.last_live: dict | None = None               # the last finished live run: tokens, seconds, tok/s
        self._listeners: list[Callable] = []
        self._show_lock = threading.RLock()
        self.spread: Spread | None = None                # readouts over N prompts × seeds (None: one run)
        self.timing: dict | None = None                  # the last back-to-back timing vs the baseline

    # ------------------------------------------------------------------ events

    def subscribe(self, fn: Callable[[str, object], None]) -> None:
        """``fn(event, payload)`` for events "errors" (dict), "shown" (Shown), "live_start" (Settings),
        "point" (LivePoint), "progress" (Progress), "status" (str), "percentiles" (dict), "settings"
        (Settings), "spread" (Spread or None), "pins" (tuple of Shown), "timing" (dict), "inspect"
        (:class:`~kvlab.playground.inspection.Inspection`, after each "shown")."""
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
            shown = None if auto_mc else self.reader.from_disk(new, t0)
            if shown is not None:
                self._show(shown)
                self.last_response_s = time.perf_counter() - t0
                self._set_status(f"from the run store in {1000 * self.last_response_s:.0f} ms")
                if len(pairs(new, self.prompts)) > 1:
                    self.runner.submit(lambda job: self.jobs.spread(job, new), name="spread")
                return True
        self._set_status("decoding…")
        self.runner.submit(lambda job: self.jobs.live(job, new, t0, auto_mc), name="run")
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for background work (True when none is left)."""
        return self.runner.wait(timeout)

    def cancel(self) -> None:
        with self._show_lock:
            self.runner.cancel()
        self._set_status("cancelled")

    def _show(self, shown: Shown, inspection: Inspection | None = None) -> None:
        """Show ``shown`` and its cache inspection (default: none recorded — a store hit)."""
        self.shown = shown
        self._emit("shown", shown)
        self._inspected(inspection or Inspection(shown.settings, shown.key))

    def _inspected(self, inspection: Inspection) -> None:
        self.inspection = inspection
        self._emit("inspect", inspection)

    def _job_failed(self, job, e: BaseException) -> None:
        msg = f"{type(e).__name__}: {e}"
        if self.runner.is_current(job) or self.runner.current is None:
            self.errors = {**self.errors, "run": msg}
            self._emit("errors", dict(self.errors))
        self._set_status(f"run failed ({msg}); showing the last good result")

    # ------------------------------------------------------------------ pins, timing, precompute, step-through

    @property
    def pinned(self) -> list[Shown]:
        """Runs pinned for overlay (oldest first)."""
        return self.pins.runs

    def pin(self) -> Shown:
        """Pin the shown run: it stays overlaid on the plots and beside the readouts while the controls
        move (at most :data:`MAX_PINS`, oldest dropped first). Pinning a pinned run does nothing."""
        sh = self.pins.pin(self.shown)
        self._emit("pins", tuple(self.pinned))
        return sh

    def unpin(self, key: str | None = None) -> None:
        """Unpin run ``key`` (every run when None)."""
        self.pins.unpin(key)
        self._emit("pins", tuple(self.pinned))

    def time_vs_baseline(self, repeats: int = 3):
        """Time the current configuration against its baseline back to back
        (:func:`kvlab.studies.refresh.tables.paired_timing`: same prompt and seed, order alternating, one
        warm-up; the baseline is also timed against itself, the noise floor) in the background; a
        "timing" event carries ``{"settings", "overhead_pct", "q25", "q75", "pairs", "noise_pct", "tps"}``.
        Not read from the store: times belong to this machine, now. Returns the job."""
        check_repeats(repeats)
        if self.errors:
            raise ValueError(f"fix {sorted(self.errors)} first; the timing uses the current controls")
        s = self.settings
        return self.runner.submit(lambda job: self.jobs.timing(job, s, repeats), name="timing")

    def precompute(self, param: str, values=None):
        """Run (and store) every slider position of ``param`` for the current prompt and other
        controls, in the background, with "progress" events. Returns the job. A later :meth:`set`
        cancels it; positions finished by then stay stored."""
        if self.errors:
            raise ValueError(f"fix {sorted(self.errors)} first; precompute uses the other current controls")
        base_s = self.settings
        values = list(values) if values is not None else self.grid(param)
        self.checker.check_values(param, values, base_s)
        self._set_status(f"precomputing {param} over {len(values)} positions…")
        with self._show_lock:
            return self.runner.submit(lambda job: self.jobs.precompute(job, base_s, param, values), name="precompute")

    def inspect(self):
        """The shown run's cache inspector: an "inspect" event at once when it is known (a watched decode;
        the full cache: nothing to inspect), else the run is decoded again with an inspector in the
        background (cancelling work in flight). Returns that job, or None."""
        sh = self.shown
        if sh is None:
            raise ValueError("no run is shown yet; set() a configuration first")
        if self.inspection is not None and self.inspection.key == sh.key and self.inspection.state != "stored":
            return self._inspected(self.inspection)
        self._set_status(f"inspect: decoding the {sh.settings.N} tokens again with the cache inspector…")
        with self._show_lock:
            return self.runner.submit(lambda job: self.jobs.inspect(job, sh), name="inspect")

    def stepper(self):
        """A :class:`~kvlab.playground.stepper.Stepper` over the current settings (shares the models)."""
        from kvlab.playground.stepper import Stepper

        return Stepper(self)


__all__ = ["Cancelled", "LivePoint", "MAX_PINS", "MC_NEVER", "MC_PERCENTILE", "Playground", "Progress", "READOUTS",
           "Shown", "describe", "fmt", "load_variant", "nice_range", "readouts"]
