"""``python -m kvlab train-student`` and the student flags every command shares (``--student``, ``--prune``).
Trains the requested students that are not cached into the model cache (``$KVLAB_CACHE``); it writes nothing else.

All checks run before any model loads and raise ``ValueError`` naming the flag.
"""
from __future__ import annotations

import argparse


def add_student_arguments(p: argparse.ArgumentParser) -> None:
    """``--student`` (variant or hub id/folder) and ``--prune`` (the embedded student's shape)."""
    from kvlab.train.config import DEFAULT_SHAPE, DEFAULT_VARIANT, RECIPES, STUDENT_VARIANTS   # torch-free: --help stays fast

    p.add_argument("--student", default=None,
                   help=f"embedded student: {' | '.join(STUDENT_VARIANTS)} (default {DEFAULT_VARIANT}; trained ones are "
                        "trained and cached on first use), or a hub id / model folder")
    p.add_argument("--prune", default=None,
                   help=f"prune shape of the embedded student, e.g. h0.45,i0.45 (default {DEFAULT_SHAPE})")
    p.add_argument("--train-steps", type=int, default=None,
                   help="trained students: the one trained for this many optimiser steps (default: the steps of "
                        "--train-recipe's recipe; trained and cached on first use)")
    p.add_argument("--train-recipe", default="default", choices=tuple(RECIPES),
                   help="trained students: the shipped recipe they come from (kvlab.train.config.RECIPES): default "
                        "(DEFAULT_TRAIN: 160 steps, half the examples multi-turn histories, the training Pareto's "
                        "best point at the default shape; pareto names the same recipe) or base (80 steps, short "
                        "prompts only: the default before the Pareto, every Pareto point's base)")


def student_choice(args):
    """``(variant, shape)`` of the embedded student from ``args`` (``variant`` None: --student is a model
    ref, checked by the caller). ``--student-ratio R`` (old flag) = ``--student pruned --prune iR``."""
    from kvlab.core.models import DEFAULT_SHAPE, DEFAULT_VARIANT, STUDENT_VARIANTS
    from kvlab.train.pair import check_student

    ref = getattr(args, "student", None)
    ratio = getattr(args, "student_ratio", None)
    prune = getattr(args, "prune", None)
    if ref is not None and ref not in STUDENT_VARIANTS:
        from pathlib import Path

        if "/" not in str(ref) and not Path(str(ref)).expanduser().exists():
            raise ValueError(f"--student={ref!r} is neither a student variant ({', '.join(STUDENT_VARIANTS)}) nor a "
                             "model folder or 'org/name' hub id")
        for flag, val in (("--prune", prune), ("--student-ratio", ratio)):
            if val is not None:
                raise ValueError(f"{flag} shapes the embedded student; it has no effect with --student {ref!r}: "
                                 "pass one of the two")
        return None, None
    if ratio is not None:
        if prune is not None:
            raise ValueError("--student-ratio and --prune both shape the embedded student: pass only --prune")
        if ref not in (None, "pruned"):
            raise ValueError(f"--student-ratio prunes the untrained student; it has no effect with --student {ref}: "
                             "use --prune iR instead")
        return check_student("pruned", ratio)
    return check_student(ref or DEFAULT_VARIANT, prune if prune is not None else DEFAULT_SHAPE)


def train_choice(args):
    """The ``TrainConfig`` the embedded trained students come from: ``--train-recipe``'s (default
    ``DEFAULT_TRAIN``), with ``--train-steps N`` that recipe run for N steps (ValueError naming the flag)."""
    from kvlab.train.config import RECIPES

    name = getattr(args, "train_recipe", None) or "default"
    if name not in RECIPES:
        raise ValueError(f"--train-recipe={name!r} must be one of {', '.join(RECIPES)} (kvlab.train.config.RECIPES)")
    cfg = RECIPES[name]
    n = getattr(args, "train_steps", None)
    if n is None:
        return cfg
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"--train-steps={n!r} must be a positive integer (optimiser steps of the trained students)")
    return cfg.replace(steps=n)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from kvlab.core.args import positive_int
    from kvlab.train.config import DEFAULT_TRAIN as D

    p.add_argument("--student", nargs="+", default=["standalone", "overfill", "refresh-aware"],
                   help="variant(s) to train: standalone | overfill | refresh-aware")
    p.add_argument("--prune", default=None, help="prune shape, e.g. h0.45,i0.45 (default kvlab.core.models.DEFAULT_SHAPE)")
    p.add_argument("--steps", type=int, default=D.steps, help="optimiser steps (> 0)")
    p.add_argument("--batch", type=int, default=D.batch, help="examples per step")
    p.add_argument("--lr", type=float, default=D.lr, help="AdamW peak learning rate")
    p.add_argument("--ce-weight", type=float, default=D.ce_weight, help="loss = w·CE + (1 − w)·KL, w in [0, 1]")
    p.add_argument("--seed", type=int, default=D.seed, help="data sampling, batch order, LoRA init and refresh points")
    p.add_argument("--data-seed", type=int, default=None,
                   help="the distillation data's seed instead of --seed (same data, other training randomness: "
                        "LoRA init, batch order, refresh points); default: --seed")
    p.add_argument("--train-prompts", type=int, default=D.train_prompts, help="training prompts used (incl. held-out)")
    p.add_argument("--heldout", type=int, default=D.heldout, help="prompts held out for the KL curve")
    p.add_argument("--eval-every", type=int, default=D.eval_every, help="held-out KL every this many steps")
    p.add_argument("--lora-rank", type=int, default=D.lora_rank,
                   help="r > 0 = LoRA adapters of rank r (peft), merged before saving (default %(default)s; measured: "
                        "r 16 at lr 2e-3 reached held-out KL 1.026 against 1.131 for full weights at lr 1e-3); "
                        "0 = train full weights (pass --lr 1e-3 with it)")
    p.add_argument("--history", type=float, default=D.history,
                   help="share of training examples in [0, 1] that are multi-turn histories (earlier training prompts "
                        "with the teacher's cached responses, then the final prompt; 300-800 prompt tokens, the long "
                        "regime); the log then also has the held-out KL on long held-out examples")
    p.add_argument("--threads", type=int, default=D.threads, help="torch threads (0 = torch's default)")
    p.add_argument("--checkpoint-s", type=positive_int("--checkpoint-s"), default=180,
                   help="seconds between checkpoints (an interrupted run resumes from the last one)")
    p.add_argument("--device", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--ship", action="store_true",
                   help="copy the trained students' fp16 LoRA adapters into kvlab/train/shipped/ (+ manifest.json) so "
                        "every machine rebuilds exactly these students; commit that folder afterwards")


def train_config(args):
    from kvlab.train.config import DEFAULT_TRAIN

    return DEFAULT_TRAIN.replace(steps=args.steps, batch=args.batch, lr=args.lr, ce_weight=args.ce_weight,
                                 seed=args.seed, train_prompts=args.train_prompts, heldout=args.heldout,
                                 eval_every=args.eval_every, threads=args.threads,
                                 lora_rank=args.lora_rank, history=args.history,
                                 data_seed=getattr(args, "data_seed", None))


def cmd_train_student(args) -> list:
    """Train every ``--student`` variant at ``--prune`` (cached: a second call returns at once)."""
    from kvlab.core.models import DEFAULT_SHAPE, resolve_device
    from kvlab.train.pair import check_student
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.train.weights import train_student

    for v in args.student:
        if v not in TRAINED_VARIANTS:
            raise ValueError(f"--student={v!r} must be one of {', '.join(TRAINED_VARIANTS)} (pruned is not trained)")
    _, shape = check_student("pruned", args.prune if args.prune is not None else DEFAULT_SHAPE)
    cfg = train_config(args)            # validates steps, batch, lr, ... (ValueError naming the flag)
    resolve_device(args.device)
    if args.ship and not cfg.lora_rank:
        raise ValueError("--ship needs LoRA students (--lora-rank > 0): full-weight students are too large to ship")
    from kvlab.train.plan import announce

    announce(args.student, shape, cfg, resolve_device(args.device), use_shipped=False)
    paths = []
    for v in args.student:      # always trained here (from scratch unless cached): never built from shipped
        path = train_student(v, shape, cfg, device=args.device, progress=not args.no_progress,
                             checkpoint_s=args.checkpoint_s)
        print(f"{v} {shape.flag}: {path}", flush=True)
        if args.ship:
            from kvlab.train.shipped import ship

            e = ship(v, shape, cfg)
            print(f"  shipped: kvlab/train/shipped/{e['file']} (sha256 {e['sha256'][:12]}…, held-out KL "
                  f"{e['heldout_kl']:.4f}); commit kvlab/train/shipped/", flush=True)
        paths.append(path)
    return paths
