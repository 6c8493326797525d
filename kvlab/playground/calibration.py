"""The playground's calibrations: where a threshold falls among the signals of calibration runs.
Reads and writes only the run store (calibration runs are stored runs).

τ (student entropy, bits) and κ (KL, nats) are read against no-refresh OverFill runs on the calibration
prompts (:func:`kvlab.studies.refresh.tables.calibrate`); the MC gate's threshold against every MC signal of
no-refresh runs probed at every step. All of them are stored runs, so a calibration is computed once per
student (and MC pass count / dropout p) and read from the run store afterwards.
"""
from __future__ import annotations

import math
from dataclasses import replace

from kvlab.harness.experiment import run_config, scored_run
from kvlab.playground.settings import Range, Settings, check, percentile_of
from kvlab.playground.students import StudentPool

MC_NEVER = 1e30          # an MC gate threshold no signal reaches (calibration runs probe but never refresh)
MC_PERCENTILE = 90.0     # the MC threshold a newly chosen signal starts at (calibrated percentile)


class Calibrator:
    """Calibrations of one teacher and its students (:class:`~kvlab.playground.students.StudentPool`),
    kept in memory and stored in ``store``.

    ``prompts`` / ``tokens`` / ``sampling``: the calibration runs (prompt ``i`` decodes with
    ``sampling``'s seed + ``i``). ``ranges``: the sliders' ranges (thresholds land on their grid).
    """

    def __init__(self, teacher, students: StudentPool, store, ranges: dict, prompts, tokens: int, sampling):
        self.teacher = teacher
        self.students = students
        self.store = store
        self.ranges = ranges
        self.prompts = tuple(prompts)
        self.tokens = tokens
        self.sampling = sampling
        self._cal: dict[str, object] = {}
        self._mc_cal: dict[tuple, dict] = {}

    def has(self, student) -> bool:
        """Whether ``student``'s τ/κ calibration is in memory."""
        return student.fingerprint in self._cal

    def calibration(self, student, compute: bool = True):
        """τ/κ calibration (kvlab.studies.refresh.tables.calibrate) for ``student``: student entropy and KL over
        no-refresh OverFill runs on the calibration prompts. Without ``compute``, only if it is in memory
        or every run is already stored (else None)."""
        from kvlab.harness.experiment import RunSpec
        from kvlab.studies.refresh.tables import calibrate

        fp = student.fingerprint
        if fp not in self._cal:
            spec = RunSpec(prompts=self.prompts, tokens=self.tokens, sampling=self.sampling)
            if not compute:
                from kvlab.decode import DecodeConfig
                for i, p in enumerate(spec.prompts):
                    cfg = DecodeConfig(mode="overfill", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i),
                                       keep_dists=True)
                    if self.store.get(run_config(self.teacher, student, p, cfg)) is None:
                        return None
            self._cal[fp] = calibrate(self.teacher, student, spec, self.store)
        return self._cal[fp]

    def percentiles(self, s: Settings) -> dict:
        """Calibrated percentile of τ (student entropy), κ (KL) and the MC threshold (its signal):
        ``{"tau_bits": p, "kappa": p, "mc_threshold": p}`` (None where the calibration is not there yet)."""
        student = self.students.if_loaded(replace(s, mode="overfill"))
        cal = self.calibration(student, compute=False) if student is not None else None
        out = {"tau_bits": None, "kappa": None, "mc_threshold": None}
        if cal is not None:
            out.update(tau_bits=percentile_of(cal.entropy, s.tau_bits), kappa=percentile_of(cal.kl, s.kappa))
        if s.policy == "mc" and student is not None and not check(s, ranges=self.ranges).keys() & {"mc_passes", "mc_p", "mc_signal"}:
            mc = self.mc_calibration(s, compute=False)
            if mc is not None:
                out["mc_threshold"] = percentile_of(mc[s.mc_signal], s.mc_threshold)
        return out

    def tau_at(self, percentile: float, student) -> float:
        """τ (bits) at a calibrated percentile of ``student``'s entropy, on the slider's grid."""
        cal = self.calibration(student)
        r = self.ranges["tau_bits"]
        v = cal.tau(percentile)
        return min(r.hi, max(r.lo, round(round((v - r.lo) / r.step) * r.step + r.lo, 6)))

    def mc_calibration(self, s: Settings, compute: bool = True) -> dict | None:
        """``{"u": values, "mi": values, "flip": values}``: every MC signal at every student step of
        no-refresh OverFill runs on the calibration prompts, probed at every step with ``s``'s pass
        count and dropout p (stored runs: an MC gate whose threshold never fires). Without ``compute``,
        only if in memory or every run is stored (else None)."""
        from kvlab.decode import DecodeConfig
        from kvlab.uncertainty.mc import MCGate, SIGNALS

        student = self.students.get(s) if compute else self.students.if_loaded(replace(s, mode="overfill"))
        if student is None:
            return None
        k = (student.fingerprint, int(s.mc_passes), float(s.mc_p))
        if k in self._mc_cal:
            return self._mc_cal[k]
        gate = MCGate(threshold=MC_NEVER, signal="mi", probe_every=1, refractory=0, n_passes=int(s.mc_passes),
                      dropout_p=float(s.mc_p))
        cfgs = [(p, DecodeConfig(mode="overfill", max_new_tokens=self.tokens, refresh=gate,
                                 sampling=replace(self.sampling, seed=self.sampling.seed + i)))
                for i, p in enumerate(self.prompts)]
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
            raise ValueError(f"calib_tokens={self.tokens} gave no probed student step; raise calib_tokens")
        self._mc_cal[k] = {name: tuple(v) for name, v in values.items()}
        return self._mc_cal[k]

    def mc_range(self, s: Settings) -> Range:
        """The MC-threshold slider's range for ``s``'s signal: 0 to the calibrated maximum rounded up
        (about 200 steps); the static range until the calibration is there."""
        cal = self.mc_calibration(s, compute=False)
        if cal is None or not cal.get(s.mc_signal):
            return self.ranges["mc_threshold"]
        return nice_range(max(cal[s.mc_signal]))

    def mc_threshold_at(self, percentile: float, s: Settings, compute: bool = True) -> float | None:
        """The MC threshold at a calibrated percentile of ``s``'s signal, on the slider's grid."""
        import numpy as np

        cal = self.mc_calibration(s, compute=compute)
        if cal is None:
            return None
        r = self.mc_range(s)
        v = float(np.percentile(cal[s.mc_signal], percentile))
        return min(r.hi, max(r.lo, round(round((v - r.lo) / r.step) * r.step + r.lo, 6)))


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
