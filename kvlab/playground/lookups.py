"""The playground's questions about its settings, answered by the parts it composes (no events, no jobs).

:class:`Lookups` is the half of :class:`~kvlab.playground.controller.Playground` that only reads: which
student a setting uses (:class:`~kvlab.playground.students.StudentPool`), which controls are bad and which
slider positions are valid (:class:`~kvlab.playground.checks.SettingsChecker`), a setting's run-store key and
stored result (:class:`~kvlab.playground.reader.RunReader`), and the τ/κ and MC calibrations
(:class:`~kvlab.playground.calibration.Calibrator`). ``s`` defaults to the current settings everywhere.
It touches nothing itself: a calibration that is not stored yet is decoded (and stored) by the Calibrator.
"""
from __future__ import annotations

from kvlab.playground.settings import Range, Settings


class Lookups:
    """Read-only queries of a :class:`~kvlab.playground.controller.Playground`, which sets the attributes they
    read in its ``__init__``: ``settings``, ``students``, ``checker``, ``reader`` and ``calib``."""

    # ------------------------------------------------------------------ models, checks, stored runs

    def student_for(self, s: Settings | float):
        """The student of settings ``s`` (its variant, and prune ratio for the pruned one; a bare number
        is a prune ratio of the pruned student), loaded on first use: ``students(variant, ratio)`` when
        a factory was given, else :func:`kvlab.train.pair.load_student` (a trained variant must be in the
        model cache: ``python -m kvlab train-student`` builds it)."""
        return self.students.get(s)

    def check(self, s: Settings | None = None) -> dict[str, str]:
        """``{control: message}`` for every bad control of ``s`` (default: the current settings)."""
        return self.checker.check(s or self.settings)

    def grid(self, param: str) -> list:
        """The slider positions of ``param`` that are valid with the other current controls."""
        return self.checker.grid(param, self.settings)

    def config(self, s: Settings, student) -> dict:
        """The run-store config of ``s`` (what :func:`scored_run` keys the run under)."""
        return self.reader.config(s, student)

    def key(self, s: Settings | None = None) -> str | None:
        """The run-store key of ``s`` (None while its student is not loaded)."""
        return self.reader.key(s or self.settings)

    def stored(self, s: Settings | None = None) -> dict | None:
        """The stored result of ``s`` or None."""
        return self.reader.stored(s or self.settings)

    def prompt_len(self, s: Settings) -> int:
        """Cache entries of ``s``'s prompt."""
        return self.reader.prompt_len(s)

    # ------------------------------------------------------------------ calibration (kvlab.playground.calibration)

    def calibration(self, student=None, compute: bool = True):
        """τ/κ calibration of ``student`` (default: the current one); see :meth:`Calibrator.calibration`."""
        return self.calib.calibration(student or self.student_for(self.settings), compute)

    def percentiles(self, s: Settings | None = None) -> dict:
        """Calibrated percentiles of ``s``'s τ, κ and MC threshold; see :meth:`Calibrator.percentiles`."""
        return self.calib.percentiles(s or self.settings)

    def tau_at(self, percentile: float) -> float:
        """τ (bits) at a calibrated percentile of the current student's entropy, on the slider's grid."""
        return self.calib.tau_at(percentile, self.student_for(self.settings))

    def mc_calibration(self, s: Settings | None = None, compute: bool = True) -> dict | None:
        """Every MC signal of the calibration runs; see :meth:`Calibrator.mc_calibration`."""
        return self.calib.mc_calibration(s or self.settings, compute)

    def mc_range(self, s: Settings | None = None) -> Range:
        """The MC-threshold slider's range for ``s``'s signal; see :meth:`Calibrator.mc_range`."""
        return self.calib.mc_range(s or self.settings)

    def mc_threshold_at(self, percentile: float, s: Settings | None = None, compute: bool = True) -> float | None:
        """The MC threshold at a calibrated percentile of ``s``'s signal, on the slider's grid."""
        return self.calib.mc_threshold_at(percentile, s or self.settings, compute)
