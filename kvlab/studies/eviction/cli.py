"""``python -m kvlab evict``: the eviction study (sawtooth figure, matched-memory table, needle-retrieval table),
and its options, which the main job shares. Torch-free at import."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.core.args import positive_int
from kvlab.harness import cli_common
from kvlab.harness.args import run_spec as _spec


def register(sub) -> None:
    """Add the ``evict`` subcommand to ``sub`` (the router's subparsers)."""
    p = sub.add_parser("evict", help="eviction: sawtooth figure, matched-memory table, needle-retrieval table")
    cli_common.add_common_arguments(p, tokens=128)
    evict_args(p)
    p.set_defaults(fn=cmd_evict)


def evict_args(p: argparse.ArgumentParser) -> None:
    """Options of the eviction job, shared by `evict` and `all` (grid defaults = kvlab.studies.eviction.needle's)."""
    p.add_argument("--gamma", type=float, default=0.9, help="evict: Conf-KV confidence threshold γ in [0, 1]")
    p.add_argument("--needle-lengths", type=positive_int("--needle-lengths"), nargs="+", default=[256, 512, 1024],
                   help="evict: passkey prompt lengths in tokens (the full cache succeeds up to ~1k here)")
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   help="evict: needle depths in [0, 1] (0 = oldest)")
    p.add_argument("--needle-reps", type=positive_int("--needle-reps"), default=2,
                   help="evict: keys per grid cell (2: 10 prompts per length, 6 per depth)")
    p.add_argument("--needle-budget", type=positive_int("--needle-budget"), default=128,
                   help="evict: peak cache entries of every policy in the needle grid (PyramidKV: per-layer mean)")
    p.add_argument("--no-needle", action="store_true", help="evict: skip the needle grid")
    from kvlab.studies.eviction.design import policy_names

    p.add_argument("--kvpress", type=_press_names, default=(), metavar="NAME[,NAME...]",
                   help="evict: NVIDIA kvpress presses (class names, e.g. SnapKVPress,TOVAPress) as matched-memory "
                        "families beside kvlab's own, each at prompt compression and at decode time, and in the "
                        "needle grid (decode time, at the sliding window's budget; needs kvpress)")
    p.add_argument("--policy", type=policy_names, default=None, metavar="NAME[,NAME...]",
                   help="evict: the fixed-budget families of the matched-memory table, any registered eviction "
                        "policy by name (kvlab/eviction/*.py, KVLAB_PLUGINS modules; default: the study's own)")


def cmd_evict(args) -> list[Path]:
    """Eviction experiments: sawtooth figure, matched-memory table, needle-retrieval table."""
    from dataclasses import replace as _replace

    from kvlab.studies.eviction.plots import evict_sawtooth_figure  # noqa: F401  (registers the figures)
    from kvlab.studies.eviction.tables import EvictStudy, NeedleGrid, evict_tables, write_evict
    from kvlab.harness.figures import render     # the figures are this study's own (plots, imported above)
    from kvlab.refresh.policies import Periodic
    from kvlab.store import RunStore

    spec = _spec(args)              # validates everything before any model loads
    n, n_all, out = getattr(args, "evict_prompts", None), len(spec.prompts), args.out
    if n is not None and n < n_all:                 # `kvlab all --evict-prompts N`: a run below the committed size
        spec = _replace(spec, prompts=spec.prompts[:n])
        out = cli_common.reduced_out(args.out)      # under OUT/reduced: the committed tables stay as they are
        print(f"evict: the first {n} of {n_all} prompts (--evict-prompts): tables under {out}", flush=True)
    study = EvictStudy(gamma=args.gamma, only=getattr(args, "policy", None), kvpress=getattr(args, "kvpress", ()))
    grid = None if args.no_needle else NeedleGrid(tuple(args.needle_lengths), tuple(args.needle_depths),
                                                   args.needle_reps, args.needle_budget)
    teacher, student = cli_common.pair(args)
    tables = evict_tables(teacher, student, spec, RunStore(args.runs), study, grid,
                          refresh=Periodic(max(2, spec.tokens // 4)), progress=not args.no_progress)
    paths = write_evict(tables, out)
    paths += [p for p in (render("evict_sawtooth", out), render("evict_needle", out),
                          render("evict_gamma", out)) if p is not None]
    for name in ("evict_matched", "evict_needle"):
        if (out / f"{name}.md").is_file():
            print(f"### {name}\n" + (out / f"{name}.md").read_text())
    return paths


def _press_names(s: str) -> tuple[str, ...]:
    """``--kvpress``: comma-separated kvpress press class names, each checked (kvpress installed, the press
    exported and runnable by kvlab) before any model loads."""
    import argparse

    from kvlab.studies.kvpress.presses import make_press

    names = tuple(n.strip() for n in s.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("--kvpress names no press: give kvpress class names, e.g. SnapKVPress,TOVAPress")
    for n in names:
        try:
            make_press(n)
        except (ValueError, ImportError) as e:
            raise argparse.ArgumentTypeError(f"--kvpress {n}: {e}") from None
    return names
