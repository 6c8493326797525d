"""``python -m kvlab refresh``: the refresh tables (periodic, entropy, methods, forced, provenance, timing) and the
Pareto figure, or one ``--policy`` against no refresh. Torch-free at import."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.core.args import positive_int
from kvlab.harness import cli_common
from kvlab.harness.args import run_spec as _spec


POLICY_FLAGS = ("T", "W", "tau", "tau_percentile", "min_gap", "M", "kappa", "kappa_percentile", "k", "threshold",
                "percentile", "signal", "probe_every", "refractory", "passes", "dropout")


def register(sub) -> None:
    """Add this study's subcommand(s) to ``sub`` (the router's subparsers)."""
    p = sub.add_parser("refresh", help="refresh policies: periodic / entropy / methods tables + Pareto figure")
    cli_common.add_common_arguments(p)
    p.add_argument("--calib-prompts", type=positive_int("--calib-prompts"), default=4,
                   help="calibration prompts (data/calibration.jsonl) for the entropy/KL thresholds")
    _refresh_options(p)
    p.set_defaults(fn=cmd_refresh)
    q = sub.add_parser("refresh-long", help="the blog's refresh regime: long generations (N >= 512), periodic T = "
                                            "64/128/256, entropy / probe-KL at ~2.5 per 1k tokens, speculative k = 8; "
                                            "refresh_long + refresh_equal_cost tables and figure")
    cli_common.add_common_arguments(q, prompts=16, tokens=512)
    q.add_argument("--calib-prompts", type=positive_int("--calib-prompts"), default=8,
                   help="calibration prompts (data/calibration.jsonl) for τ and κ, run at the same --tokens")
    q.add_argument("--timing-prompts", type=positive_int("--timing-prompts"), default=1,
                   help="prompts timed side by side for latency_overhead (the first ones)")
    q.add_argument("--timing-repeats", type=int, default=1,
                   help="paired (no refresh, policy) timings per prompt and policy (0 = no timing)")
    q.add_argument("--policies", default=None,
                   help="comma-separated rows to run (default: every row; no_refresh is always run), e.g. "
                        "periodic_T64,periodic_T128,periodic_T256 (no calibration runs without entropy / probe-KL rows)")
    q.set_defaults(fn=cmd_refresh_long)


def _refresh_options(p: argparse.ArgumentParser) -> None:
    """``refresh``: one policy and its parameters (checked in kvlab.studies.refresh.choice), and the timing."""
    g = p.add_argument_group("one policy (default: the full table of every policy)")
    g.add_argument("--policy", default=None, help="periodic | entropy | probe-kl | speculative | mc")
    g.add_argument("--T", type=int, default=None, help="periodic: refresh every T steps")
    g.add_argument("--W", type=int, default=None, help="periodic/entropy/probe-kl: rewrite the last W entries")
    g.add_argument("--tau", type=float, default=None, help="entropy: threshold in bits")
    g.add_argument("--tau-percentile", type=float, default=None, help="entropy: τ = this percentile (calibrated)")
    g.add_argument("--min-gap", type=int, default=None, help="entropy: steps between refreshes (default 1)")
    g.add_argument("--M", type=int, default=None, help="probe-kl: probe every M steps")
    g.add_argument("--kappa", type=float, default=None, help="probe-kl: KL threshold in nats")
    g.add_argument("--kappa-percentile", type=float, default=None, help="probe-kl: κ = this percentile (calibrated)")
    g.add_argument("--k", type=int, default=None, help="speculative: burst length")
    g.add_argument("--threshold", type=float, default=None, help="mc: gate threshold on the signal")
    g.add_argument("--percentile", type=float, default=None, help="mc: threshold = this percentile (calibrated)")
    g.add_argument("--signal", default=None, help="mc: u | mi | flip (default mi)")
    g.add_argument("--probe-every", type=int, default=None, help="mc: probe every this many steps (default 16)")
    g.add_argument("--refractory", type=int, default=None, help="mc: steps after a refresh without firing (default 32)")
    g.add_argument("--passes", type=int, default=None, help="mc: noisy passes per probe (default 8)")
    g.add_argument("--dropout", type=float, default=None, help="mc: dropout probability (default 0.1)")
    g.add_argument("--refresh-next", default=None, help="who picks the token after a refresh: rerun | student | teacher")
    t = p.add_argument_group("overhead timing (side by side in this process)")
    t.add_argument("--timing-prompts", type=positive_int("--timing-prompts"), default=2,
                   help="prompts timed (the first ones of the spec)")
    t.add_argument("--timing-repeats", type=int, default=2,
                   help="paired (no refresh, policy) timings per prompt and policy (0 = no timing)")


def _calib_prompts(args, spec) -> tuple[str, ...]:
    """Calibration prompts: data/calibration.jsonl for the default set; for the long set the *last*
    ``--calib-prompts`` prompts of the long file, which must not overlap the ``--prompts`` evaluated."""
    from kvlab.core.data import calibration_file, load_prompts, prompt_set_file

    k = min(getattr(args, "calib_prompts", 4), 32)
    if cli_common.set_suffix(args):
        rows = load_prompts(prompt_set_file("long"))
        if len(spec.prompts) + k > len(rows):
            raise ValueError(f"--prompt-set long holds {len(rows)} prompts: --prompts {len(spec.prompts)} + "
                             f"--calib-prompts {k} (taken from its end) would overlap; lower one of them")
        return tuple(r["prompt"] for r in rows[-k:])
    return tuple(r["prompt"] for r in load_prompts(calibration_file(), n=k))


def cmd_refresh(args) -> list[Path]:
    """The full refresh tables (default) or one ``--policy`` against no refresh (kvlab.studies.refresh.choice)."""
    from dataclasses import replace as _replace

    from kvlab.studies.refresh.forced import forced_table
    from kvlab.studies.refresh.choice import policy_choice, single_policy_tables
    from kvlab.studies.refresh.tables import provenance_table, refresh_tables, write_refresh
    from kvlab.store import RunStore

    spec = _spec(args)              # validates everything before any model loads
    choice = policy_choice(getattr(args, "policy", None), getattr(args, "refresh_next", None),
                           **{k: getattr(args, k, None) for k in POLICY_FLAGS})
    if getattr(args, "rebuild_student_cache", False):
        raise ValueError("--rebuild-student-cache cannot be used with refresh: a refresh splices teacher K/V into "
                         "the student cache, which needs a student with the teacher's KV geometry")
    if getattr(args, "timing_repeats", 2) < 0:
        raise ValueError(f"--timing-repeats={args.timing_repeats} must be >= 0 (0 = no overhead timing)")
    progress = not args.no_progress
    calib = _replace(spec, prompts=_calib_prompts(args, spec))
    timing = {"timing_prompts": getattr(args, "timing_prompts", 2), "timing_repeats": getattr(args, "timing_repeats", 2)}
    teacher, student = cli_common.pair(args)
    store = RunStore(args.runs)
    if choice is not None:
        tables = single_policy_tables(teacher, student, spec, store, calib, choice, progress=progress, **timing)
        tables = {f"{k}{cli_common.set_suffix(args)}": v for k, v in tables.items()}
        paths = write_refresh(tables, args.out)
        for name in tables:
            print(f"### {name}\n" + (args.out / f"{name}.md").read_text())
        return paths
    tables = refresh_tables(teacher, student, spec, store, calib, progress=progress, **timing)
    split = max(2, spec.tokens // 2)
    if spec.tokens >= 4:   # teacher-forced: same tokens, only the cache's writer changes
        if progress:
            print(f"forced table: {len(spec.prompts)} prompts (stored runs are reused)", flush=True)
        tables["refresh_forced"], _ = forced_table(teacher, student, spec.prompts, store, tokens=spec.tokens,
                                                   split=split, window=max(1, min(8, split - 1)))
    suffix = cli_common.set_suffix(args)
    if not suffix:
        tables["refresh_provenance"] = provenance_table(teacher, student, spec, progress=progress)
    tables = {f"{k}{suffix}": v for k, v in tables.items()}
    paths = write_refresh(tables, args.out)
    if not suffix:
        paths += [p for n in ("refresh_pareto", "refresh_provenance") if (p := _render(n, args.out)) is not None]
    for name in ("refresh_periodic", "refresh_entropy", "refresh_methods", "refresh_timing", "refresh_forced"):
        if (args.out / f"{name}{suffix}.md").is_file():
            print(f"### {name}{suffix}\n" + (args.out / f"{name}{suffix}.md").read_text())
    return paths


def cmd_refresh_long(args) -> list[Path]:
    """``refresh-long``: kvlab.studies.refresh.long (flags checked before any model loads)."""
    import time
    from dataclasses import replace as _replace

    from kvlab.core.data import calibration_file, load_prompts
    from kvlab.store import RunStore
    from kvlab.studies.refresh.long import MIN_TOKENS, refresh_long, write_long

    t0 = time.perf_counter()
    if getattr(args, "prompt_set", "default") != "default" and getattr(args, "prompts_file", None) is None:
        raise ValueError("--prompt-set long holds short-answer prompts; refresh-long needs long-form answers "
                         "(the default set, data/prompts.jsonl, or --prompts-file)")
    if args.tokens is not None and args.tokens < MIN_TOKENS:
        raise ValueError(f"--tokens={args.tokens} must be >= {MIN_TOKENS}: refresh-long measures long generations "
                         "(the blog's N = 1,200); for short runs use `python -m kvlab refresh`")
    if args.timing_repeats < 0:
        raise ValueError(f"--timing-repeats={args.timing_repeats} must be >= 0 (0 = no latency timing)")
    if getattr(args, "rebuild_student_cache", False):
        raise ValueError("--rebuild-student-cache cannot be used with refresh-long: a refresh splices teacher K/V "
                         "into the student cache, which needs the teacher's KV geometry")
    _policies(args)
    spec = _spec(args)
    calib = _replace(spec, prompts=tuple(r["prompt"] for r in load_prompts(calibration_file(),
                                                                             n=min(args.calib_prompts, 32))))
    teacher, student = cli_common.pair(args)
    tables = refresh_long(teacher, student, spec, calib, RunStore(args.runs), timing_prompts=args.timing_prompts,
                          timing_repeats=args.timing_repeats, policies=_policies(args),
                          progress=not args.no_progress)
    paths = write_long(tables, args.out, spec, calib)
    if (p := _render("refresh_long", args.out)) is not None:
        paths.append(p)
    for name in ("refresh_long", "refresh_equal_cost"):
        print(f"### {name}\n" + (args.out / f"{name}.md").read_text())
    print(f"refresh-long: {(time.perf_counter() - t0) / 60:.1f} min wall", flush=True)
    return paths


def _policies(args):
    """``--policies`` as a list of row names (None: every row)."""
    raw = getattr(args, "policies", None)
    if raw is None:
        return None
    names = [p.strip() for p in raw.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--policies={raw!r} names no row; give comma-separated names such as periodic_T64,periodic_T128")
    return names


# `kvlab all`'s size: N = 512 (issue 37's floor for make figures) on the first ALL_PROMPTS prompts; only the rows
# without calibration runs or step-by-step forced scoring (periodic: a few batched forwards on the forced path), and
# no latency timing (untracked, machine-dependent). Measured alone on the 2-core Xeon at 16 prompts: 30.3 min
# (docs/measured/all_long_jobs_timing.jsonl), so 8. Written under OUT/reduced (cli_common.reduced_out): the committed
# table (every row, 16 prompts) is `python -m kvlab refresh-long`'s (docs/refresh.md) and stays as it is.
ALL_PROMPTS = 8
ALL_POLICIES = "periodic_T64,periodic_T128,periodic_T256"


def refresh_long_all(args) -> list[Path]:
    """refresh-long inside the main job (`kvlab all`): N = 512, ALL_PROMPTS prompts, the ALL_POLICIES rows, written
    under ``OUT/reduced``."""
    import argparse as _ap

    if getattr(args, "prompts_file", None) is not None or getattr(args, "prompt_set", "default") != "default":
        print("refresh-long: skipped (the prompt set is not the default one)", flush=True)
        return []
    return cmd_refresh_long(_ap.Namespace(**{**vars(args), "prompts": min(args.prompts, ALL_PROMPTS), "tokens": 512,
                                             "out": cli_common.reduced_out(args.out),
                                             "calib_prompts": 8, "timing_prompts": 1, "timing_repeats": 0,
                                             "policies": ALL_POLICIES}))


def _render(name: str, out):
    """Draw this study's figure ``name`` from the tables in ``out`` (its plots module registers them)."""
    from kvlab.harness.figures import render
    from kvlab.studies.refresh import plots  # noqa: F401  (registers this study's figures)

    return render(name, out)
