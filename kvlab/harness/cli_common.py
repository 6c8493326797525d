"""What several studies' ``python -m kvlab`` commands share: the common run flags (prompts, sampling, models,
store), the prompt-set suffix of table names, and loading the (teacher, student) pair a command runs on (saying
first which trained students it will train). Torch-free at import; touches nothing itself."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.core.args import positive_int


# Prompts per table by default: 32, the smallest n at which a paired interval can resolve about 0.1-0.2 nats
# (each table prints the smallest difference it could detect at its n); batched decoding makes it affordable.
DEFAULT_PROMPTS = 32


def add_common_arguments(p: argparse.ArgumentParser, prompts: int = DEFAULT_PROMPTS, tokens: int = 128) -> None:
    p.add_argument("--prompts", type=positive_int("--prompts"), default=prompts, help="number of prompts")
    p.add_argument("--tokens", type=positive_int("--tokens"), default=None,
                   help=f"new tokens per run (N) (default: {tokens}) — 48 with --prompt-set long")
    p.add_argument("--prompt-set", default="default", choices=["default", "long"],
                   help="default: data/prompts.jsonl (short ELI5 prompts, long answers); long: data/long_prompts.jsonl "
                        "(300-800 token documents / few-shot / multi-turn prompts with 32-64 token answers, the regime "
                        "OverFill is for); tables get the suffix _long")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="JSON Lines file, one {\"prompt\": ...} per line (overrides --prompt-set)")
    p.set_defaults(default_tokens=tokens)
    p.add_argument("--out", type=Path, default=Path("figures"), help="where tables and figures go")
    p.add_argument("--runs", type=Path, default=None,
                   help="run store (default $KVLAB_RUNS, else the project's runs/ — not the working directory)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="base seed; prompt i uses seed + i for every policy")
    p.add_argument("--teacher", default=None, help="hub id or folder (default: embedded SmolLM2-135M)")
    from kvlab.train.command import add_student_arguments

    add_student_arguments(p)
    p.add_argument("--student-ratio", type=float, default=None,
                   help="old flag: the untrained student pruned at this MLP ratio (= --student pruned --prune iR)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--batch", type=positive_int("--batch"), default=None,
                   help="runs decoded together in one batched forward per step (default 8, chosen by `bench decode "
                        "--batch`; 1 = one run at a time). Stored runs are keyed without it")
    p.add_argument("--rebuild-student-cache", action="store_true",
                   help="OverFill with a student whose KV geometry differs from the teacher's: the student "
                        "prefills its own cache from the text (no refresh possible)")


def announce(args, variants) -> None:
    """Say up front which trained students this command will train (or rebuild from the shipped adapters),
    roughly how long, and how to skip it (kvlab.train.plan); silent when they are cached."""
    from kvlab.core.models import resolve_device
    from kvlab.train.command import student_choice, train_choice
    from kvlab.train.plan import announce as announce_plan

    variant, shape = student_choice(args)
    if variant is not None:
        announce_plan(variants or [variant], shape, train_choice(args), resolve_device(args.device))


def pair(args, standalone: bool = False):
    """(teacher, student): ``--student`` variant at ``--prune`` (trained and cached first if missing).
    ``standalone``: the command also needs the standalone student (baselines' equal-budget row), so the
    announcement names it too when :func:`needs_standalone`."""
    from kvlab.train.pair import load_pair
    from kvlab.train.command import student_choice, train_choice

    variant, shape = student_choice(args)
    if variant is not None:   # baselines also needs the standalone student (its equal-budget row)
        alone = standalone and needs_standalone(variant)
        announce(args, [variant] + (["standalone"] if alone else []))
    if variant is None:
        return load_pair(args.teacher, args.student, device=args.device, dtype=args.dtype)
    return load_pair(args.teacher, None, device=args.device, dtype=args.dtype, variant=variant, shape=shape,
                     train_if_missing=True, train=train_choice(args))


def needs_standalone(variant) -> bool:
    """Whether the Student row of ``variant`` (a ``--student`` variant, None for a model path) is a separately
    trained ``standalone`` student: only for trained variants other than standalone itself."""
    return variant not in (None, "pruned", "standalone")


def alone_student(args, student):
    """The Student row's model: ``standalone`` at the same shape when the OverFill student is a trained
    embedded variant (OverFill's own baseline), else the same student."""
    from kvlab.train.pair import load_student
    from kvlab.train.command import student_choice, train_choice

    variant, shape = student_choice(args)
    if not needs_standalone(variant):
        return student
    return load_student("standalone", shape, device=args.device, dtype=args.dtype, train_if_missing=True,
                        train=train_choice(args))


def set_suffix(args) -> str:
    """Table-name suffix of the prompt set: "" for the default set, "_long" for the long one (a custom
    --prompts-file keeps the default names)."""
    return "_long" if getattr(args, "prompt_set", "default") == "long" and getattr(args, "prompts_file", None) is None else ""


# `kvlab all` runs the long studies below the size of their committed tables (which come from one longer run of the
# same command, named in each table's notes); it writes those smaller runs here, below --out, so that `make figures`
# leaves the committed tables, and the README numbers read from them, as they are.
REDUCED = "reduced"


def reduced_out(out) -> Path:
    """``<out>/reduced``: where `kvlab all` writes a study it runs below its committed table's size."""
    return Path(out) / REDUCED
