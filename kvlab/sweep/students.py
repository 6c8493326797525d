"""The sweep's student axis: which embedded student (a variant at a prune shape) a grid point decodes with.
Reads the model cache to check a trained student exists; never trains.

In a grid spec's ``[run]`` table (both optional, both may be lists, which sweeps them)::

    student = ["pruned", "overfill"]   # kvlab.core.models.STUDENT_VARIANTS (default: the trained default, overfill)
    prune = "h0.20,i0.50"              # prune shape(s) of the embedded student (default: kvlab.core.models.DEFAULT_SHAPE)
    student_ratio = 0.30               # old key, still read: = student "pruned", prune "i0.30"

CLI: ``--student V [V ...]`` and ``--prune S [S ...]`` (``--student-ratio`` is the old flag).
With ``[models] student = "org/model-or-folder"`` the student is that model and these keys are refused.
``[models] kind = "tiny"`` (random tiny models) has only the ``pruned`` variant, pruned in the MLP only
(default ``i0.30``).

A trained variant is never trained by a sweep: :func:`check_trained` (called by the driver before any
engine starts) names the ``python -m kvlab train-student`` command of every one the model cache lacks.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvlab.train.config import DEFAULT_SHAPE, DEFAULT_VARIANT, STUDENT_VARIANTS, TRAINED_VARIANTS

PRUNED = "pruned"
TINY_SHAPE = "i0.30"          # the tiny student's MLP ratio the sweep machinery always used


@dataclass(frozen=True)
class StudentChoice:
    """One point of the student axis: ``variant`` at prune ``shape`` (its ``--prune`` flag, e.g. ``h0.20,i0.50``)."""

    variant: str
    shape: str

    @property
    def prune(self):
        from kvlab.core.prune import PruneShape

        return PruneShape.parse(self.shape)

    @property
    def ratio(self) -> float:
        """The MLP (intermediate) ratio: what the old ``student_ratio`` axis was."""
        return self.prune.inter

    @property
    def label(self) -> str:
        return f"{self.variant} {self.shape}"

    def columns(self) -> dict:
        """Row columns naming the student (``student_ratio`` kept for tables of older sweeps)."""
        return {"student": self.variant, "prune": self.shape, "student_ratio": self.ratio}


def _err(key: str, msg: str):
    from kvlab.sweep.values import SpecError

    return SpecError(f"grid spec key {key!r}: {msg}")


def _shape_flag(value, key: str) -> str:
    from kvlab.core.prune import PruneShape

    if isinstance(value, bool) or not isinstance(value, str):
        raise _err(key, f"must be a prune shape string like 'h0.45,i0.45' or 'i0.3', got {value!r}")
    try:
        return PruneShape.parse(value).flag
    except ValueError as e:
        raise _err(key, str(e)) from None


def parse_students(run: dict, kind: str, custom_student: str | None) -> tuple:
    """The student axis of a ``[run]`` table: a tuple of :class:`StudentChoice` (``(None,)`` when
    ``[models] student`` names the student model). Raises ``SpecError`` naming the key."""
    from kvlab.sweep.values import expand_values

    given = [k for k in ("student", "prune", "student_ratio") if k in run]
    if custom_student is not None:
        if given:
            raise _err(f"run.{given[0]}", f"shapes the embedded student, but models.student = {custom_student!r} "
                                          "replaces it: drop one of the two")
        return (None,)
    if "student_ratio" in run:
        if "prune" in run:
            raise _err("run.student_ratio", "is the old key of run.prune (CLI --prune); give only run.prune, "
                                            "e.g. prune = 'i0.30'")
        ratios = expand_values(run["student_ratio"], "run.student_ratio")
        for r in ratios:
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
                raise _err("run.student_ratio", f"{r!r} must be a number in [0, 1) (the untrained student's MLP "
                                                "ratio); the new keys are run.student + run.prune (CLI --student "
                                                "pruned --prune i0.30)")
        variants = expand_values(run.get("student", PRUNED), "run.student")
        if any(v != PRUNED for v in variants):
            raise _err("run.student_ratio", f"prunes the untrained student only; with run.student = {variants!r} "
                                            "use run.prune instead (CLI --prune iR), e.g. prune = 'i0.30'")
        from kvlab.core.prune import PruneShape

        shapes = [PruneShape(0.0, float(r)).flag for r in ratios]
    else:
        tiny = kind == "tiny"
        variants = expand_values(run.get("student", PRUNED if tiny else DEFAULT_VARIANT), "run.student")
        shapes = [_shape_flag(v, "run.prune") for v in
                  expand_values(run.get("prune", TINY_SHAPE if tiny else DEFAULT_SHAPE), "run.prune")]
    for v in variants:
        if v not in STUDENT_VARIANTS:
            raise _err("run.student", f"{v!r} is not a student variant; one of {', '.join(STUDENT_VARIANTS)} "
                                      "(CLI --student)")
        if kind == "tiny" and v != PRUNED:
            raise _err("run.student", f"{v!r}: tiny models have no trained students, only 'pruned' "
                                      "(or use models.kind = 'embedded')")
    if kind == "tiny":
        for s in shapes:
            if not s.startswith("i"):
                raise _err("run.prune", f"{s!r}: a tiny student is pruned in its MLP only; use e.g. 'i0.30'")
    out = [StudentChoice(v, s) for v in variants for s in shapes]
    return tuple(dict.fromkeys(out))


def missing_trained(students, kind: str = "embedded") -> list[StudentChoice]:
    """The trained students of ``students`` the model cache lacks (no model loads; nothing is trained)."""
    if kind != "embedded":
        return []
    from kvlab.train.weights import trained_dir

    return [c for c in students if c is not None and c.variant in TRAINED_VARIANTS
            and not (trained_dir(c.variant, c.shape) / "config.json").is_file()]


def check_trained(spec) -> None:
    """Raise ``FileNotFoundError`` naming the ``python -m kvlab train-student`` command of every trained
    student ``spec`` needs that the model cache lacks — before any engine starts (a sweep never trains)."""
    from kvlab.core.models import cache_dir
    from kvlab.train.weights import train_command

    missing = missing_trained(spec.students, spec.models.kind)
    if missing:
        cmds = "; ".join(f"`{train_command(c.variant, c.shape)}`" for c in missing)
        raise FileNotFoundError(
            f"sweep {spec.name!r} needs trained student(s) missing from the model cache {cache_dir() / 'models'}: "
            f"{', '.join(c.label for c in missing)}. A sweep never trains: train them first with {cmds} "
            "(~10 min each on a 2-core CPU), or sweep the untrained one (run.student = 'pruned', CLI --student pruned)")
