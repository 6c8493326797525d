"""The playground's student switch: which students the "student" dropdown offers, how one loads, and
what is wrong with a choice before anything loads.
Loads students from the model cache; never trains or writes one.

The dropdown offers :data:`kvlab.core.models.STUDENT_VARIANTS`: ``pruned`` (the untrained student, at the
prune ratio of the "student prune" control) and the trained variants at the trained default shape
(:data:`kvlab.core.models.DEFAULT_SHAPE`), loaded from the model cache as :func:`kvlab.train.pair.load_pair`
loads them (:func:`kvlab.train.pair.load_student`; the playground already holds its teacher). The
playground never trains: :func:`student_problem` names the ``python -m kvlab train-student`` command
of a trained variant the cache lacks, so the choice is refused as a control error and no job starts.
:class:`StudentPool` holds the students a playground has loaded.
"""
from __future__ import annotations

from functools import lru_cache

from kvlab.playground.settings import PRUNED, Settings


def student_variants_offered() -> tuple:
    """``kvlab.core.models.STUDENT_VARIANTS``: what the "student" dropdown offers."""
    from kvlab.core.models import STUDENT_VARIANTS

    return tuple(STUDENT_VARIANTS)


def student_key(s) -> tuple:
    """``(variant, prune ratio)`` of settings, of a bare prune ratio (the pruned student), of a
    variant name (its trained shape: ratio None) or of such a tuple."""
    if isinstance(s, Settings):
        return (s.student, float(s.prune_ratio)) if s.student == PRUNED else (s.student, None)
    if isinstance(s, tuple):
        return (s[0], None if s[1] is None or s[0] != PRUNED else float(s[1]))
    if isinstance(s, str):
        return (s, None)
    return (PRUNED, float(s))


@lru_cache(maxsize=None)
def _trained_name(variant: str) -> str:
    from kvlab.core.models import DEFAULT_SHAPE
    from kvlab.train.weights import trained_name

    return trained_name(variant, DEFAULT_SHAPE)       # it hashes the training data: once per session


def _trained_dir(variant: str):
    from kvlab.core.models import cache_dir

    return cache_dir() / "models" / _trained_name(variant)


def student_problem(variant: str) -> str | None:
    """Why ``variant`` cannot be loaded now (unknown, or trained but not in the model cache: the message
    names the training command), else None. Loads nothing."""
    from kvlab.core.models import DEFAULT_SHAPE
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.train.weights import train_command

    if variant not in student_variants_offered():
        return f"student={variant!r} must be one of {student_variants_offered()}"
    if variant in TRAINED_VARIANTS and not (_trained_dir(variant) / "config.json").is_file():
        return (f"the {variant!r} student is not trained yet (not in the model cache); train it in a shell with "
                f"`{train_command(variant, DEFAULT_SHAPE)}` (~10 min on a 2-core CPU), or pick 'pruned'")
    return None


def load_variant(variant: str, ratio: float | None, device=None, dtype=None):
    """The student ``variant``: the pruned one at MLP ``ratio``, or a trained one at the default shape
    from the model cache (never trained here: a missing one raises, naming the training command)."""
    from kvlab.train.pair import load_student
    from kvlab.core.prune import PruneShape

    if variant not in student_variants_offered():
        raise ValueError(f"student={variant!r} must be one of {student_variants_offered()}")
    if variant == PRUNED:
        return load_student(PRUNED, PruneShape(0.0, ratio), device=device, dtype=dtype)
    return load_student(variant, device=device, dtype=dtype, train_if_missing=False)


class StudentPool:
    """The students of one playground, one model per ``(variant, prune ratio)`` (:func:`student_key`),
    loaded on first use.

    ``students``: a dict ``ratio or variant -> LM`` (only these are offered; tests inject tiny ones), a
    callable (``students(ratio)`` for the pruned student, ``students(variant, None)`` for a trained one),
    or None (:func:`load_variant` on the teacher's device and dtype). ``student``: the model of settings
    ``initial``. ``prune_ratios`` / ``variants``: what the dropdowns offer (default: the dict's keys, or
    :data:`~kvlab.playground.settings.PRUNE_RATIOS` and :func:`student_variants_offered`).
    """

    def __init__(self, teacher, students=None, student=None, initial: Settings | None = None, prune_ratios=None,
                 variants=None):
        from kvlab.playground.settings import PRUNE_RATIOS

        self.teacher = teacher
        self._models: dict[tuple, object] = {}
        self.fixed = isinstance(students, dict)
        if self.fixed:
            self._models.update({student_key(k): v for k, v in students.items()})
            self._factory = None
        else:
            self._factory = students
        if student is not None:
            self._models[student_key(initial)] = student
        self.prune_ratios = tuple(prune_ratios) if prune_ratios is not None else (
            tuple(sorted(r for v, r in self._models if v == PRUNED)) if self.fixed else PRUNE_RATIOS)
        if variants is not None:
            self.variants = tuple(variants)
        elif self.fixed:
            self.variants = tuple(dict.fromkeys(v for v, _ in self._models))
        else:
            self.variants = student_variants_offered()

    def loaded(self) -> tuple:
        """The ``(variant, prune ratio)`` of every student in memory, in load order."""
        return tuple(self._models)

    def has(self, s) -> bool:
        """Whether the student of ``s`` (settings or a key :func:`student_key` takes) is in memory."""
        return student_key(s) in self._models

    def get(self, s):
        """The student of ``s``, loaded on first use (see :meth:`Playground.student_for`)."""
        key = student_key(s)
        if key not in self._models:
            if self.fixed:
                raise ValueError(f"student {key[0]!r} at prune_ratio={key[1]} has no model; available: "
                                 f"{sorted(self._models, key=str)}")
            if callable(self._factory):
                self._models[key] = self._factory(*key) if key[0] != PRUNED else self._factory(key[1])
            else:
                self._models[key] = load_variant(key[0], key[1], device=self.teacher.device, dtype=self.teacher.dtype)
        return self._models[key]

    def if_loaded(self, s: Settings):
        """The student of ``s`` if it is in memory, else None (always None in teacher mode)."""
        return None if s.mode == "teacher" else self._models.get(student_key(s))

    def problem(self, s: Settings) -> str | None:
        """Why the student of ``s`` cannot load (a trained one the model cache lacks), checked only where
        :func:`load_variant` would load it; None when it is fine or not needed."""
        if s.mode == "teacher" or self._factory is not None or self.fixed or self.has(s):
            return None
        return student_problem(s.student)
