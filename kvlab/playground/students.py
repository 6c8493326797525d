"""The playground's student switch: which students the "student" dropdown offers, how one loads, and
what is wrong with a choice before anything loads.

The dropdown offers :data:`kvlab.models.STUDENT_VARIANTS`: ``pruned`` (the untrained student, at the
prune ratio of the "student prune" control) and the trained variants at the trained default shape
(:data:`kvlab.models.DEFAULT_SHAPE`), loaded from the model cache as :func:`kvlab.models.load_pair`
loads them (:func:`kvlab.models.load_student`; the playground already holds its teacher). The
playground never trains: :func:`student_problem` names the ``python -m kvlab train-student`` command
of a trained variant the cache lacks, so the choice is refused as a control error and no job starts.
"""
from __future__ import annotations

from functools import lru_cache

from .settings import PRUNED, Settings


def student_variants_offered() -> tuple:
    """``kvlab.models.STUDENT_VARIANTS``: what the "student" dropdown offers."""
    from ..models import STUDENT_VARIANTS

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
    from ..models import DEFAULT_SHAPE
    from ..train.weights import trained_name

    return trained_name(variant, DEFAULT_SHAPE)       # it hashes the training data: once per session


def _trained_dir(variant: str):
    from ..models import cache_dir

    return cache_dir() / "models" / _trained_name(variant)


def student_problem(variant: str) -> str | None:
    """Why ``variant`` cannot be loaded now (unknown, or trained but not in the model cache: the message
    names the training command), else None. Loads nothing."""
    from ..models import DEFAULT_SHAPE
    from ..train.config import TRAINED_VARIANTS
    from ..train.weights import train_command

    if variant not in student_variants_offered():
        return f"student={variant!r} must be one of {student_variants_offered()}"
    if variant in TRAINED_VARIANTS and not (_trained_dir(variant) / "config.json").is_file():
        return (f"the {variant!r} student is not trained yet (not in the model cache); train it in a shell with "
                f"`{train_command(variant, DEFAULT_SHAPE)}` (~10 min on a 2-core CPU), or pick 'pruned'")
    return None


def load_variant(variant: str, ratio: float | None, device=None, dtype=None):
    """The student ``variant``: the pruned one at MLP ``ratio``, or a trained one at the default shape
    from the model cache (never trained here: a missing one raises, naming the training command)."""
    from ..models import load_student
    from ..prune import PruneShape

    if variant not in student_variants_offered():
        raise ValueError(f"student={variant!r} must be one of {student_variants_offered()}")
    if variant == PRUNED:
        return load_student(PRUNED, PruneShape(0.0, ratio), device=device, dtype=dtype)
    return load_student(variant, device=device, dtype=dtype, train_if_missing=False)
