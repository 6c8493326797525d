"""``python -m kvlab needle-long``: RULER-style retrieval at 2k–8k tokens under eviction
(:mod:`kvlab.studies.eviction.needle_long`), written to ``OUT/evict_needle_long.csv`` (+ ``.md``) and
``OUT/evict_needle_long_full.csv`` (the full cache's accuracy in every cell). Torch-free at import."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.core.args import positive_int

# `kvlab all` runs it at this size (a few minutes on 2 cores), under OUT/reduced (cli_common.reduced_out); the
# committed table comes from a longer run of `python -m kvlab needle-long` and make figures leaves it as it is
ALL_SIZE = {"tasks": ("niah_single",), "lengths": (2048,), "n": 3}
# the names of kvlab.studies.eviction.ruler.TASKS / needle_long.POLICIES (those import torch; a test keeps them equal)
TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt")
POLICIES = ("full", "sliding", "streamingllm", "h2o", "snapkv", "confkv")


def _names(flag: str, allowed: tuple[str, ...]):
    def parse(s: str) -> tuple[str, ...]:
        got = tuple(x.strip() for x in s.split(",") if x.strip())
        bad = [x for x in got if x not in allowed]
        if not got or bad:
            raise argparse.ArgumentTypeError(f"{flag} {s!r}: unknown {bad or 'empty'}; choose from {','.join(allowed)}")
        return got
    return parse


def _lengths(s: str) -> tuple[int, ...]:
    try:
        got = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {s!r} must be comma-separated ints, e.g. 2048,4096,8192") from None
    if not got or any(n < 64 for n in got):
        raise argparse.ArgumentTypeError(f"--lengths {s!r} must be ints >= 64 (prompt tokens), e.g. 2048,4096,8192")
    return got


def _counts(s: str):
    try:
        got = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        got = ()
    if not got or any(n < 1 for n in got):
        raise argparse.ArgumentTypeError(f"--n {s!r} must be a positive int, or one per length (e.g. 60,20,8)")
    return got[0] if len(got) == 1 else got


def register(sub) -> None:
    """Add the ``needle-long`` subcommand to ``sub`` (the router's subparsers)."""
    policies = POLICIES
    p = sub.add_parser("needle-long", help="eviction: RULER-style retrieval at 2k-8k tokens (Wilson intervals)")
    p.add_argument("--tasks", type=_names("--tasks", TASKS), default=TASKS, metavar="TASK[,TASK...]",
                   help=f"tasks ({','.join(TASKS)})")
    p.add_argument("--lengths", type=_lengths, default=(2048, 4096, 8192), help="prompt lengths in tokens (<= 8128)")
    p.add_argument("--n", type=_counts, default=60, help="cases per (task, length): one int, or one per length")
    p.add_argument("--screen", type=int, default=5,
                   help="a cell whose full cache is below --threshold on its first SCREEN cases runs no more (0: off)")
    p.add_argument("--budget", type=positive_int("--budget"), default=256, help="peak cache entries of every policy")
    p.add_argument("--policies", type=_names("--policies", policies), default=policies, metavar="NAME[,NAME...]",
                   help=f"policies ({','.join(policies)}); 'full' decides which cells the table keeps")
    p.add_argument("--settings", type=_names("--settings", ("prefill", "streamed")), default=("prefill", "streamed"),
                   metavar="SETTING[,SETTING]", help="prefill, streamed")
    p.add_argument("--threshold", type=float, default=0.8,
                   help="full-cache accuracy a (task, length) cell needs to enter the table")
    p.add_argument("--gamma", type=float, default=0.9, help="Conf-KV confidence threshold")
    p.add_argument("--chunk", type=positive_int("--chunk"), default=1024, help="prefill chunk (tokens per forward)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated cases")
    p.add_argument("--time-limit", type=float, default=None,
                   help="compute no case after this many seconds, only reuse stored ones (0: tables of the stored runs)")
    p.add_argument("--out", type=Path, default=Path("figures"), help="where the tables go")
    p.add_argument("--runs", type=Path, default=None, help="the run store (default: the project's runs/)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fn=cmd_needle_long)


def grid_of(args):
    """The :class:`LongGrid` of parsed ``args`` (ValueError naming the flag before any model loads)."""
    from kvlab.studies.eviction.needle_long import LongGrid

    try:
        return LongGrid(tasks=tuple(args.tasks), lengths=tuple(args.lengths), n=args.n, budget=args.budget,
                        policies=tuple(args.policies), settings=tuple(args.settings), gamma=args.gamma,
                        threshold=args.threshold, chunk=args.chunk, seed=args.seed,
                        screen=getattr(args, "screen", 5))
    except ValueError as e:
        raise SystemExit(f"needle-long: --{str(e).split('=')[0].replace('_', '-')}: {e}") from None


def cmd_needle_long(args) -> list[Path]:
    """Run the grid (resuming from the store) and write the tables."""
    from kvlab.core.models import load_teacher
    from kvlab.store import RunStore
    from kvlab.studies.eviction.needle_long import run_grid
    from kvlab.studies.eviction.needle_long_table import write_long

    grid = grid_of(args)
    lm = load_teacher(device=args.device, dtype=args.dtype)
    runs = run_grid(lm, grid, RunStore(args.runs), progress=not args.no_progress,
                    time_limit=getattr(args, "time_limit", None))
    paths = write_long(runs, grid, args.out)
    print((Path(args.out) / "evict_needle_long.md").read_text())
    return paths


def needle_long_small(args) -> list[Path]:
    """needle-long inside the main job (`kvlab all`): :data:`ALL_SIZE`, every policy and setting at budget 256,
    written under ``OUT/reduced``."""
    from kvlab.harness.cli_common import reduced_out
    from kvlab.studies.eviction.needle_long import POLICIES, SETTINGS

    ns = argparse.Namespace(**{**vars(args), **ALL_SIZE, "out": reduced_out(args.out), "budget": 256,
                               "policies": POLICIES, "settings": SETTINGS,
                               "threshold": 0.8, "gamma": getattr(args, "gamma", 0.9), "chunk": 1024, "seed": 0,
                               "screen": 5})
    return cmd_needle_long(ns)
