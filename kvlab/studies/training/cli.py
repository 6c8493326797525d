"""``python -m kvlab train-study`` (the student variants compared), ``train-student`` (kvlab.train.command) and
``train-pareto`` (kvlab.studies.training.pareto), and the main job's first step: the trained students that are
missing. Torch-free at import."""
from __future__ import annotations

from pathlib import Path

from kvlab.harness import cli_common
from kvlab.harness.args import check_model_args as _check_model_args


def register(sub) -> None:
    """Add the ``train-study``, ``train-student`` and ``train-pareto`` subcommands to ``sub`` (the router's
    subparsers)."""
    p = sub.add_parser("train-study", help="student variants compared: OverFill vs student alone, refresh, speed, curves")
    cli_common.add_common_arguments(p)
    p.set_defaults(fn=cmd_train_study)
    p = sub.add_parser("train-student", help="train the embedded student variants on the teacher (cached)")
    from kvlab.train.command import add_train_arguments, cmd_train_student

    add_train_arguments(p)
    p.set_defaults(fn=cmd_train_student)
    p = sub.add_parser("train-pareto", help="held-out KL vs decode speed-up per prune shape and training recipe "
                                            "(trains the missing points only with --train)")
    from kvlab.studies.training.pareto import add_pareto_arguments, cmd_train_pareto

    add_pareto_arguments(p)
    p.set_defaults(fn=cmd_train_pareto)


def cmd_train_missing(args) -> list[Path]:
    """Train (or find cached) every trained variant of the embedded student's shape."""
    from kvlab.train.command import student_choice, train_choice
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.train.weights import trained_student_path

    variant, shape = student_choice(args)
    if variant is None:
        print("train: skipped (--student is a model folder/hub id)", flush=True)
        return []
    cli_common.announce(args, list(TRAINED_VARIANTS))
    # cached, else built from the shipped adapters, else trained (make figures trains nothing when they match)
    return [trained_student_path(v, shape, train_choice(args), train_if_missing=True, device=args.device,
                                 progress=not args.no_progress) for v in TRAINED_VARIANTS]


def cmd_train_study(args) -> list[Path]:
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.studies.training.report import train_study

    _check_model_args(args)
    cli_common.announce(args, list(TRAINED_VARIANTS))
    return train_study(args)
