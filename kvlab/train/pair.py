"""The embedded teacher/student pair: a student variant (pruned, or trained by :mod:`kvlab.train`) at a
prune shape, loaded from the model cache, beside the teacher; or any two hub ids / local folders.
Loads from the model cache; trains, and writes weights, only with ``train_if_missing=True``.
"""
from __future__ import annotations

from kvlab.core import models
from kvlab.core.models import LM
from kvlab.train.config import DEFAULT_SHAPE, DEFAULT_VARIANT, STUDENT_VARIANTS


def check_student(variant, shape):
    """``(variant, PruneShape)`` validated (ValueError naming ``--student`` / ``--prune``), no model loaded."""
    from kvlab.core.prune import PruneShape

    if variant not in STUDENT_VARIANTS:
        raise ValueError(f"--student={variant!r} must be one of {', '.join(STUDENT_VARIANTS)} "
                         "(pruned = untrained; the others are trained by `python -m kvlab train-student`)")
    return variant, PruneShape.parse(shape)


def load_student(variant: str = DEFAULT_VARIANT, shape=DEFAULT_SHAPE, device=None, dtype=None, *,
                 train_if_missing: bool = False, progress: bool = True, train=None) -> LM:
    """The embedded student: ``variant`` (pruned / standalone / overfill / refresh-aware) at prune ``shape``.

    ``pruned`` is the untrained width-pruned teacher. A trained variant loads from the model cache;
    if it is not there this raises (naming the ``python -m kvlab train-student`` command) unless
    ``train_if_missing=True``, which trains it (minutes on a CPU) and caches it. ``name`` is the cached
    folder's name: variant, shape and training key. ``train``: the ``kvlab.train.config.TrainConfig``
    the student was trained with (default: ``DEFAULT_TRAIN``; e.g. ``DEFAULT_TRAIN.replace(steps=240)``).
    """
    variant, shape = check_student(variant, shape)
    if variant == "pruned":
        path = models.pruned_student_path(shape)
    else:
        from kvlab.train.weights import trained_student_path

        from kvlab.train.config import DEFAULT_TRAIN

        path = trained_student_path(variant, shape, train or DEFAULT_TRAIN, train_if_missing=train_if_missing,
                                    progress=progress)
    lm = models.load_model(path, device=device, dtype=dtype, local_files_only=True)
    return LM(lm.model, lm.tokenizer, path.name)


def load_pair(teacher=None, student=None, device=None, dtype=None, ratio: float | None = None, *,
              variant: str = DEFAULT_VARIANT, shape=DEFAULT_SHAPE, train_if_missing: bool = False, train=None):
    """(teacher, student): the embedded pair by default (student ``variant`` at ``shape``), or any two
    ids/folders. ``ratio`` (old API) selects the untrained student pruned at that MLP ratio."""
    if ratio is not None:
        from kvlab.core.prune import PruneShape

        variant, shape = "pruned", PruneShape(0.0, ratio)
    check_student(variant, shape)   # before any model loads
    t = models.load_teacher(device, dtype) if teacher is None else models.load_model(teacher, device, dtype)
    if student is None:
        s = load_student(variant, shape, device, dtype, train_if_missing=train_if_missing, train=train)
    else:   # a decoder folder saved without a tokenizer reads the teacher's (a KV-sharing pair shares one)
        s = models.load_model(student, device, dtype, tokenizer=None if _has_tokenizer(student) else t.tokenizer)
    return t, s


def _has_tokenizer(ref) -> bool:
    from pathlib import Path

    p = Path(str(ref)).expanduser()
    return not p.is_dir() or any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json",
                                                             "tokenizer.model"))
