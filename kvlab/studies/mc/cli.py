"""``python -m kvlab mc-sim`` (the blog's MC-dropout simulation) and ``mc-real`` (real MC dropout on the student),
and the bounded mc-real the main job runs. Torch-free at import."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvlab.harness import cli_common
from kvlab.harness.args import run_spec as _spec


MC_REAL_PROMPTS = 16     # the main job's mc-real prompts: ≥ 16, so the intervals over prompts mean something
MC_REAL_DROPOUT = (0.1,)  # and its dropout p (the README's row; the committed table also has 0.05 and 0.2)


def register(sub) -> None:
    """Add this study's subcommand(s) to ``sub`` (the router's subparsers)."""
    p = sub.add_parser("mc-sim", help="the blog's MC-dropout simulation: CSVs + figures, thresholds as JSON")
    p.add_argument("--out", type=Path, default=Path("figures"))
    p.set_defaults(fn=cmd_mc_sim)
    p = sub.add_parser("mc-real", help="real MC dropout on the student: U/MI/flip vs entropy correlations")
    cli_common.add_common_arguments(p, prompts=8, tokens=64)
    p.add_argument("--passes", type=int, default=8, help="N noisy passes per step (>= 2)")
    p.add_argument("--dropout", type=float, nargs="+", default=[0.1], help="dropout probabilities p in [0, 1)")
    p.set_defaults(fn=cmd_mc_real)


def cmd_mc_sim(args) -> list[Path]:
    from kvlab.studies.mc.sim import simulate, write_outputs

    result = simulate()
    info = write_outputs(result, args.out)
    paths = [_render(n, args.out) for n in ("mc_entropy", "mc_variance", "mc_triggers")]
    print(json.dumps(info, indent=1))
    return [p for p in paths if p is not None]


def cmd_mc_real(args) -> list[Path]:
    """Real MC dropout on the student: per-step U / MI / flip vs entropy; correlations as JSON."""
    from kvlab.harness.experiment import write_table
    from kvlab.studies.mc.real import correlation_study
    from kvlab.uncertainty.mc import check_n_passes, check_p

    check_n_passes(args.passes)
    ps = [check_p(p) for p in args.dropout]
    prompts = list(_spec(args).prompts)   # validates prompts and sampling before any model loads
    teacher, student = cli_common.pair(args)
    traces, table = correlation_study(teacher, student, prompts, ps=ps, tokens=args.tokens, n_passes=args.passes,
                                      sampling=_spec(args).sampling)
    args.out.mkdir(parents=True, exist_ok=True)
    traces.round(6).to_csv(args.out / "mc_real_traces.csv", index=False)
    paths = [args.out / "mc_real_traces.csv"] + list(write_table(table.round(4), args.out, "mc_real_correlations") or [])
    paths.append(_render("mc_real", args.out))
    print(json.dumps(table.round(4).to_dict(orient="records"), indent=1))
    return paths


def mc_real_small(args):
    """mc-real inside the main job: a bounded size (at most 16 prompts × 64 tokens, N = 8, p = 0.1 only: 13.0 min
    for the three p of the committed table, measured alone on the 2-core Xeon), 16 prompts so that the
    correlations' bootstrap intervals over prompts mean something (issue 37). Written under ``OUT/reduced``: the
    committed table (p ∈ {0.05, 0.1, 0.2}) is ``python -m kvlab mc-real --prompts 16 --tokens 64 --passes 8
    --dropout 0.05 0.1 0.2``'s, and make figures leaves it as it is."""
    return cmd_mc_real(argparse.Namespace(**{**vars(args), "prompts": min(args.prompts, MC_REAL_PROMPTS),
                                             "tokens": min(args.tokens, 64), "passes": 8,
                                             "dropout": list(MC_REAL_DROPOUT),
                                             "out": cli_common.reduced_out(args.out)}))


def _render(name: str, out):
    """Draw this study's figure ``name`` from the tables in ``out`` (its plots module registers them)."""
    from kvlab.harness.figures import render
    from kvlab.studies.mc import plots  # noqa: F401  (registers this study's figures)

    return render(name, out)
