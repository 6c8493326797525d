"""``python -m kvlab train-study`` (the student variants compared), ``train-student`` (kvlab.train.command),
``train-pareto`` (kvlab.studies.training.pareto) and ``train-seeds`` (kvlab.studies.training.seeds: OverFill vs the
student baselines over several training seeds), and the main job's first step: the trained students that are
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
    p = sub.add_parser("train-seeds", help="OverFill − standalone and OverFill − student alone on kl_forced over "
                                           "several training seeds (hierarchical bootstrap over seeds and prompts; "
                                           "trains the missing seeds' students)")
    add_seeds_arguments(p)
    p.set_defaults(fn=cmd_train_seeds)


def data_seed_arg(s: str):
    """``--data-seed``: an integer (every training seed distils from that seed's data) or ``own`` (None: each
    seed its own data)."""
    import argparse

    if s.strip().lower() == "own":
        return None
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--data-seed must be an integer or 'own', got {s!r}") from None


def add_seeds_arguments(p) -> None:
    """``train-seeds``'s flags: the common run flags (64 new tokens, like the baselines table) and the seeds."""
    from kvlab.core.args import positive_int

    cli_common.add_common_arguments(p, tokens=64)
    p.add_argument("--seeds", type=positive_int("--seeds"), default=3,
                   help="training seeds 0..N-1 per student (≥ 2; seed 0 is the shipped student, the others are "
                        "trained and cached on first use: ~39 min each per variant at the default recipe on a 2-core CPU)")
    p.add_argument("--data-seed", type=data_seed_arg, default=0,
                   help="the distillation data every seed trains on: an integer (that seed's teacher responses: the "
                        "seeds then differ in LoRA init, batch order and refresh points only) or 'own' (each seed "
                        "its own data: ~65 min of teacher generation per new data seed on a 2-core CPU)")


def cmd_train_seeds(args) -> list[Path]:
    from kvlab.studies.training.seeds import cmd_train_seeds as run

    return run(args)


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
