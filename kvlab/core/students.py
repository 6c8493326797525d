"""The embedded students' catalogue: the variants, the default variant and prune shape, and how a student's
model-cache folder name says which one it is. Values and checks; torch-free, imports nothing from kvlab.
Training them is :mod:`kvlab.train`'s; loading them :mod:`kvlab.core.models`' and :mod:`kvlab.train.pair`'s."""
from __future__ import annotations

import re

STUDENT_VARIANTS = ("pruned", "standalone", "overfill", "refresh-aware")
TRAINED_VARIANTS = STUDENT_VARIANTS[1:]
DEFAULT_VARIANT = "overfill"
# measured (docs/pair_and_training.md, the training Pareto): held-out KL 1.025 at about 1.5x the teacher's decode speed
DEFAULT_SHAPE = "h0.20,i0.50"


_NAME = re.compile(r"-(" + "|".join(map(re.escape, STUDENT_VARIANTS)) + r")-((?:h\d\.\d+-)?i\d\.\d+)-[ct][0-9a-f]+(?:@|$)")


def student_of_name(name) -> tuple[str, str] | None:
    """``(variant, prune flag)`` of an embedded student from its model-cache folder name (or a fingerprint
    ``name@hash``), as :func:`kvlab.core.models.pruned_student_path` / :func:`kvlab.train.weights.trained_name`
    write it (``…-overfill-h0.20-i0.50-t<key>``, ``…-pruned-i0.30-c<digest>``); None for any other model."""
    m = _NAME.search(str(name or ""))
    return None if m is None else (m.group(1), m.group(2).replace("-", ","))


def check_variant(variant) -> str:
    if variant not in STUDENT_VARIANTS:
        raise ValueError(f"--student={variant!r} must be one of {', '.join(STUDENT_VARIANTS)} "
                         "(pruned = untrained; the others are trained by `python -m kvlab train-student`)")
    return variant
