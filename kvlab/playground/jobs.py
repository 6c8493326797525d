"""The playground's background work: each method is a job body ``fn(job, ...)`` that
:class:`~kvlab.playground.runner.Runner` runs on its worker thread (or inline).

A job uses the models only inside the playground's :class:`~kvlab.playground.runner.ModelGate`, calls
``job.check()`` between decode steps (a newer request cancels it) and reports through the playground's
events only while it is the current job, so a superseded job never shows anything.
"""
from __future__ import annotations

import time
from dataclasses import replace

from kvlab.playground.calibration import MC_PERCENTILE
from kvlab.playground.compare import time_vs_baseline
from kvlab.playground.inspection import Inspection, recorder, same_tokens_note
from kvlab.playground.settings import PRUNED, Settings, decode_config
from kvlab.playground.shown import LivePoint, Progress, readouts
from kvlab.playground.spread import Spread, pairs, spread_stats


class Jobs:
    """The job bodies of one :class:`~kvlab.playground.Playground` (its worker half: it reads the
    playground's models, store and calibrations, and emits its events under its show lock)."""

    def __init__(self, playground):
        self.pg = playground

    def _current(self, job) -> bool:
        return self.pg.runner.is_current(job)

    # ------------------------------------------------------------------ a live run

    def live(self, job, s: Settings, t0: float, auto_mc: bool = False) -> None:
        """Show ``s`` (and its baseline), from the store or decoded now while "point" events stream its
        steps; with ``auto_mc`` the MC threshold goes to the calibrated percentile first. Then the spread."""
        pg = self.pg
        with pg.gate.hold():
            student = self.ensure_student(s, job)
            if s.mode == "overfill":
                self.ensure_calibration(student, job)
                if s.policy == "mc":
                    if pg.calib.mc_calibration(s, compute=False) is None:
                        pg._emit("progress", Progress("calibration", 0, len(pg.calib.prompts),
                                                      f"calibrating the MC signals ({s.mc_passes} passes, p={s.mc_p})…"))
                        pg.calib.mc_calibration(s)
                        job.check()
                    if auto_mc:
                        s = s.replace(mc_threshold=pg.calib.mc_threshold_at(MC_PERCENTILE, s))
                        with pg._show_lock:
                            if self._current(job):
                                pg.settings = s
                                pg._emit("settings", s)
                if self._current(job):
                    pg._emit("percentiles", pg.calib.percentiles(s))
            b = s.baseline()
            same = pg.reader.config(b, student) == pg.reader.config(s, student)
            if not same:
                base = pg.reader.scored(b, student, self.streamer(job, "baseline", b.N, points=False))
            if self._current(job):
                pg._emit("live_start", s)
            inspector = recorder(s)                        # watches the live decode (a store hit feeds it nothing)
            streamer = self.streamer(job, "run", s.N, points=True, inspector=inspector)
            result = pg.reader.scored(s, student, streamer)
            job.check()
            if same:
                base = result
        st = streamer.state
        live = None
        if st.get("n", 0) > 1 and st["last"] > st["t1"]:      # decoded now (not a store hit)
            live = {"tokens": st["n"], "seconds": st["last"] - st["t0"],
                    "tps": (st["n"] - 1) / (st["last"] - st["t1"])}
        with pg._show_lock:
            if not self._current(job):
                return
            pg.last_live = live or pg.last_live
            shown = pg.reader.build(s, student, result, base, "live" if live else "disk", t0)
            whole = inspector is not None and len(inspector.steps) == len(result["steps"]["token_id"])
            pg._show(shown, Inspection(s, shown.key, inspector if whole else None, st.get("tokenizer")))
            extra = f" · streamed at {live['tps']:.1f} tok/s" if live else ""
            pg._set_status(f"decoded in {shown.seconds:.1f} s{extra}" if live else
                           f"from the run store in {1000 * shown.seconds:.0f} ms")
        if len(pairs(s, pg.prompts)) > 1:
            self.spread(job, s)

    def streamer(self, job, stage: str, total: int, points: bool, inspector=None):
        """An ``on_step`` that checks for cancellation and emits a "point" (``points``) or "progress"
        event per step, feeding ``inspector`` (a :class:`~kvlab.viz.inspector.CacheInspector`) the
        cache after each step; its ``state`` holds the step count, times (first step, last step) and the
        decoder's tokenizer."""
        pg = self.pg
        state = {"t1": None, "t0": time.perf_counter()}

        def on_step(rec, d):
            job.check()
            now = time.perf_counter()
            if state["t1"] is None:
                state["t1"] = now
            tps = (rec.step - 1) / (now - state["t1"]) if rec.step > 1 and now > state["t1"] else float("nan")
            state["last"], state["n"], state["tokenizer"] = now, rec.step, d.decoder.tokenizer
            if inspector is not None:
                inspector.observe(rec, d.cache)
            if self._current(job):
                if points:
                    c = d.cache
                    pg._emit("point", LivePoint(stage=stage, step=rec.step, total=total, token=rec.token,
                                                entropy_bits=rec.entropy_bits, refreshed=rec.refreshed,
                                                source=rec.source, cache_len=rec.cache_len, tps=tps,
                                                positions=tuple(c.positions), writers=tuple(c.writers)))
                else:
                    pg._emit("progress", Progress(stage, rec.step, total, f"{stage}: {rec.step}/{total}"))
            pg.gate.pause_point()

        on_step.state = state
        return on_step

    def cancel_only(self, job):
        """An ``on_step`` that only checks for cancellation (and lets the step-through in between)."""
        def on_step(rec, d):
            job.check()
            self.pg.gate.pause_point()
        return on_step

    def ensure_student(self, s: Settings, job):
        """The student of ``s`` (None in teacher mode), with a "progress" event when it must load."""
        if s.mode == "teacher":
            return None
        if not self.pg.students.has(s):
            what = f"prune ratio {s.prune_ratio}" if s.student == PRUNED else f"variant {s.student}"
            self.pg._emit("progress", Progress("student", 0, 1, f"loading the student ({what})…"))
        student = self.pg.students.get(s)
        job.check()
        return student

    def ensure_calibration(self, student, job) -> None:
        """Compute ``student``'s τ/κ calibration unless in memory or stored (with a "progress" event)."""
        cal = self.pg.calib
        if student is None or cal.has(student):
            return
        if cal.calibration(student, compute=False) is None:
            self.pg._emit("progress", Progress("calibration", 0, len(cal.prompts),
                                               f"calibrating τ/κ on {len(cal.prompts)} prompt(s)…"))
            cal.calibration(student)
        job.check()

    # ------------------------------------------------------------------ the cache inspector of a stored run

    def inspect(self, job, sh) -> None:
        """Decode the shown run ``sh`` again (not stored: the run store has it) with a cache inspector
        attached, with "progress" events; then, if ``sh`` is still shown, an "inspect" event. A re-decode
        whose tokens differ from the stored run's says so in the inspector's message."""
        from kvlab.decode import run

        pg, s, t0 = self.pg, sh.settings, time.perf_counter()
        inspector, seen = recorder(s), {}
        with pg.gate.hold():
            student = self.ensure_student(s, job)

            def on_step(rec, d):
                job.check()
                inspector.observe(rec, d.cache)
                seen["tokenizer"] = d.decoder.tokenizer
                if self._current(job):
                    pg._emit("progress", Progress("inspect", rec.step, s.N, f"inspect: {rec.step}/{s.N} tokens"))
                pg.gate.pause_point()

            trace = run(pg.teacher, None if s.mode == "teacher" else student, s.prompt,
                        replace(decode_config(s), keep_dists=True), on_step=on_step)
        with pg._show_lock:
            if not self._current(job) or pg.shown is None or pg.shown.key != sh.key:
                return
            note = same_tokens_note(trace.tokens, sh.result["steps"]["token_id"])
            pg._inspected(Inspection(s, sh.key, inspector, seen.get("tokenizer"), note))
            pg._emit("progress", Progress("inspect", s.N, s.N, ""))
            pg._set_status(f"cache inspector: decoded again in {time.perf_counter() - t0:.1f} s")

    # ------------------------------------------------------------------ spread over prompts × seeds

    def spread(self, job, s: Settings) -> None:
        """Readouts over ``pairs(s)``: each (prompt, seed) run and its baseline from the store, or
        decoded now — ``pg.batch`` pairs at a time, their missing runs as batched decodes
        (:meth:`~kvlab.playground.reader.RunReader.scored_many`); a "spread" event after each pair
        (only while this job is current). A newer request cancels between decode steps."""
        pg = self.pg
        ps = pairs(s, pg.prompts)
        rows = []
        with pg.gate.hold():
            student = self.ensure_student(s, job)
            for k in range(0, len(ps), pg.batch):
                chunk = ps[k:k + pg.batch]
                res = pg.reader.scored_many([x for p in chunk for x in (p, p.baseline())], student, pg.batch,
                                            self._pair_progress(job, k, len(chunk), len(ps)))
                job.check()
                for i in range(len(chunk)):
                    r, b = res[2 * i], res[2 * i + 1]
                    rows.append((readouts(r, b, s.mode), readouts(b, b, s.mode)))
                    with pg._show_lock:
                        if not self._current(job):
                            return
                        pg.spread = Spread(s, k + i + 1, len(ps), spread_stats(rows))
                        pg._emit("spread", pg.spread)
        if self._current(job):
            pg._emit("progress", Progress("spread", len(ps), len(ps), ""))

    def _pair_progress(self, job, k: int, m: int, n: int):
        """An ``on_step`` for pairs ``k+1 .. k+m`` of ``n``: cancels, says once that they are decoding."""
        said = []

        def on_step(rec, d):
            job.check()
            if not said and self._current(job):
                said.append(1)
                what = f"pair {k + 1}" if m == 1 else f"pairs {k + 1}–{k + m}"
                self.pg._emit("progress", Progress("spread", k, n, f"spread: {what}/{n} decoding…"))
            self.pg.gate.pause_point()
        return on_step

    # ------------------------------------------------------------------ timing and precompute

    def timing(self, job, s: Settings, repeats: int) -> None:
        """Time ``s`` against its baseline back to back; a "timing" event carries the result."""
        pg = self.pg
        with pg.gate.hold():
            student = self.ensure_student(s, job)
            if self._current(job):
                pg._emit("progress", Progress("timing", 0, 1, f"timing vs the baseline: {repeats} pair(s) back to back…"))
            out = time_vs_baseline(pg.teacher, student, s, repeats)
        with pg._show_lock:
            if self._current(job):
                pg.timing = out
                pg._emit("timing", out)
                pg._emit("progress", Progress("timing", 1, 1, ""))

    def precompute(self, job, base_s: Settings, param: str, values: list) -> None:
        """Run (and store) ``base_s`` at every value of ``param``, with "progress" events; then show the
        current settings from the store if they are among them."""
        pg = self.pg
        t0 = time.perf_counter()
        fresh = 0
        with pg.gate.hold():
            student = self.ensure_student(base_s, job)
            pg.reader.scored(base_s.baseline(), student, self.cancel_only(job))
            for i, v in enumerate(values):
                s = base_s.replace(**{param: v})
                if self._current(job):
                    pg._emit("progress", Progress("precompute", i, len(values), f"{param} = {v}"))
                if pg.store.get(pg.reader.config(s, student)) is None:
                    pg.reader.scored(s, student, self.cancel_only(job))
                    fresh += 1
        with pg._show_lock:
            if not self._current(job):
                return
            pg._emit("progress", Progress("precompute", len(values), len(values),
                                          f"{param}: {len(values)} positions stored ({fresh} new) "
                                          f"in {time.perf_counter() - t0:.1f} s"))
            cur = pg.settings
            if not pg.check(cur):
                shown = pg.reader.from_disk(cur, time.perf_counter())
                if shown is not None:
                    pg._show(shown)
