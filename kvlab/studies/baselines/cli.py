"""``python -m kvlab baselines``: the Teacher / OverFill / Student table and its figures, and inside the main job
the same table on the long-prompt set (``baselines_long``) beside the short one (``baselines_regimes``).
Torch-free at import."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.harness import cli_common
from kvlab.harness.args import run_spec as _spec


def register(sub) -> None:
    """Add this study's subcommand(s) to ``sub`` (the router's subparsers)."""
    p = sub.add_parser("baselines", help="Teacher / OverFill / Student table + figure")
    cli_common.add_common_arguments(p)
    p.set_defaults(fn=cmd_baselines)


def cmd_baselines(args) -> list[Path]:
    """The baselines table (``--prompt-set`` long: ``baselines_long``) and, for the default set, its figures drawn
    by :func:`_render`; the regimes table when both sets' tables are in ``--out``."""
    from kvlab.studies.baselines.table import baselines, write_baselines
    from kvlab.store import RunStore

    spec = _spec(args)              # validates everything before any model loads
    # `python -m kvlab baselines` itself also needs the standalone student (its equal-budget row): say so up front
    teacher, student = cli_common.pair(args, standalone=getattr(args, "command", None) == "baselines")
    table, per_run = baselines(teacher, student, spec, RunStore(args.runs), progress=not args.no_progress,
                               rebuild_student_cache=getattr(args, "rebuild_student_cache", False),
                               alone=cli_common.alone_student(args, student))
    name = "baselines" + cli_common.set_suffix(args)
    paths = write_baselines(table, per_run, args.out, name=name)
    if name == "baselines":
        paths += [_render("baselines", args.out), _render("baselines_timing", args.out)]
    paths += _write_regimes(args.out)
    print((args.out / f"{name}.md").read_text() + "\n" + (args.out / f"{name}_timing.md").read_text())
    return paths


def _write_regimes(out: Path) -> list[Path]:
    """``baselines_regimes``: OverFill vs each student baseline in both prompt sets side by side (when both
    ``baselines`` and ``baselines_long`` are in ``out``)."""
    import pandas as pd

    from kvlab.studies.baselines.table import regimes_table
    from kvlab.harness.experiment import write_table
    from kvlab.core.metrics import MDE_NOTE
    from kvlab.harness.forced import FORCED_SCORE_NOTE

    files = {"short prompts, long answers (default)": out / "baselines.csv", "long prompts, short answers (long)": out / "baselines_long.csv"}
    if not all(f.is_file() for f in files.values()):
        return []
    tables = {k: pd.read_csv(f) for k, f in files.items()}
    if any("d_kl_forced" not in t for t in tables.values()):
        return []
    note = ("`d_*` = baseline − overfill, paired over prompts (bootstrap 95 % interval); positive: OverFill better. "
            "`student` = the OverFill decoder alone (the blog's Student); `standalone` = a separately trained student "
            "(the OverFill paper's equal-budget baseline).")
    return write_table(regimes_table(tables).round(4), out, "baselines_regimes", notes=[note, FORCED_SCORE_NOTE, MDE_NOTE])


def baselines_long(args) -> list[Path]:
    """The baselines table on the long-prompt / short-answer set too (``baselines_long`` and the side-by-side
    ``baselines_regimes``), same --prompts, 48 new tokens; skipped when the main job already used that set
    or a custom --prompts-file."""
    from kvlab.core.data import SET_TOKENS

    if cli_common.set_suffix(args) or getattr(args, "prompts_file", None) is not None:
        print("baselines-long: skipped (the prompt set is not the default one)", flush=True)
        return []
    return cmd_baselines(argparse.Namespace(**{**vars(args), "prompt_set": "long", "tokens": SET_TOKENS["long"]}))


def _render(name: str, out):
    """Draw this study's figure ``name`` from the tables in ``out`` (its plots module registers them)."""
    from kvlab.harness.figures import render
    from kvlab.studies.baselines import plots  # noqa: F401  (registers this study's figures)

    return render(name, out)
