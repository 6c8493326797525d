"""``python -m kvlab sweep`` and ``python -m kvlab figures --from-results`` (argument parsing and
the commands; :mod:`kvlab.cli` only wires them in). Imports nothing heavy at module level."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("grid", nargs="?", type=Path, default=None,
                   help="TOML grid spec (see kvlab/sweep/spec.py, examples/sweep_refresh.toml); flags override it")
    g = p.add_argument_group("grid (the simple case without a file, or overrides)")
    g.add_argument("--name", default=None, help="sweep name (default: the file's stem)")
    g.add_argument("--modes", nargs="+", default=None, help="teacher student overfill")
    g.add_argument("--refresh", action="append", default=None, metavar="'FAMILY k=v1,v2 k2=a..b:step'",
                   help="a refresh family and its values, e.g. --refresh 'periodic T=16,32' --refresh 'entropy tau_bits=4..8'")
    g.add_argument("--evict", action="append", default=None, metavar="'FAMILY k=v1,v2'",
                   help="an eviction family (kvlab.eviction.EVICTION_POLICIES) and its values")
    g.add_argument("--prompts", type=int, default=None, help="number of prompts (prompts.count)")
    g.add_argument("--prompts-file", default=None, help="JSON Lines with a 'prompt' field (prompts.file)")
    g.add_argument("--tokens", type=int, nargs="+", default=None, help="N new tokens (a list sweeps it)")
    g.add_argument("--student-ratio", type=float, nargs="+", default=None, help="embedded student pruning ratio(s)")
    g.add_argument("--repeats", type=int, default=None, help="seeds per (config, prompt)")
    g.add_argument("--refresh-next", nargs="+", default=None, help="rerun student teacher")
    g.add_argument("--no-baseline", action="store_true", help="do not add each mode's no-policy run")
    g.add_argument("--temperature", type=float, nargs="+", default=None)
    g.add_argument("--top-p", type=float, nargs="+", default=None)
    g.add_argument("--seed", type=int, default=None, help="base seed (prompt i, repeat r: seed + i + 10000 r)")
    g.add_argument("--models", choices=("embedded", "tiny"), default=None,
                   help="'tiny': random tiny models (tests/benchmarks of the machinery)")
    g.add_argument("--teacher", default=None)
    g.add_argument("--student", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    e = p.add_argument_group("where and how it runs")
    e.add_argument("--engine", choices=("local", "ray"), default="local")
    e.add_argument("--workers", type=int, default=None,
                   help="local: processes (default 1 = in-process); ray: actors (default: one per CPU, or per GPU)")
    e.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray instance)")
    e.add_argument("--results", type=Path, default=None, help="results root (default $KVLAB_RESULTS or <runs>/results)")
    e.add_argument("--runs", type=Path, default=None, help="per-run JSON store (default $KVLAB_RUNS or ./runs)")
    e.add_argument("--no-store", action="store_true", help="do not go through the per-run JSON store")
    e.add_argument("--no-retry-errors", action="store_true", help="keep error rows instead of rerunning them")
    e.add_argument("--dry-run", action="store_true", help="validate, print the grid and what is left to run; run nothing")
    e.add_argument("--no-progress", action="store_true")


def overrides(args) -> dict:
    """The flags as a TOML-shaped dict (only flags that were given)."""
    from .spec import parse_policy_flag

    o: dict = {}

    def put(table, key, value):
        if value is not None:
            o.setdefault(table, {})[key] = value

    if args.name is not None:
        o["name"] = args.name
    put("run", "modes", args.modes)
    put("run", "tokens", args.tokens)
    put("run", "student_ratio", args.student_ratio)
    put("run", "repeats", args.repeats)
    put("run", "refresh_next", args.refresh_next)
    if args.no_baseline:
        put("run", "baseline", False)
    put("prompts", "count", args.prompts)
    put("prompts", "file", args.prompts_file)
    put("sampling", "temperature", args.temperature)
    put("sampling", "top_p", args.top_p)
    put("sampling", "seed", args.seed)
    put("models", "kind", args.models)
    for k in ("teacher", "student", "device", "dtype"):
        put("models", k, getattr(args, k))
    for section in ("refresh", "evict"):
        for flag in getattr(args, section) or []:
            o.setdefault(section, {}).update(parse_policy_flag(flag, section))
    return o


def spec_from_args(args):
    from .spec import load_spec, parse_spec

    o = overrides(args)
    if args.grid is not None:
        return load_spec(args.grid, o)
    if not any(k in o for k in ("run", "refresh", "evict")):
        raise ValueError("sweep needs a GRID.toml or grid flags (e.g. --modes teacher overfill "
                         "--refresh 'periodic T=16,32')")
    return parse_spec(o)


def cmd_sweep(args):
    from ..results import Results
    from .runner import pending, run_sweep

    spec = spec_from_args(args)               # every check before any model loads
    results = Results(args.results)
    runs = False if args.no_store else args.runs
    if args.dry_run:
        todo, skipped = pending(spec, results, not args.no_retry_errors)
        configs = spec.configs()
        print(f"sweep {spec.name!r}: {len(configs)} configs x {len(spec.prompts)} prompts x {spec.repeats} repeats "
              f"= {len(todo) + skipped} tasks; {skipped} stored, {len(todo)} to run -> {results.root}")
        for c in configs:
            print(f"  {c.mode:9s} N={c.tokens:<5d} ratio={c.student_ratio} T={c.temperature} {c.policy}")
        return spec
    try:
        report = run_sweep(spec, engine=args.engine, workers=args.workers, address=args.address, results=results,
                           runs=runs, progress=not args.no_progress, retry_errors=not args.no_retry_errors)
    except ConnectionError as e:
        raise ValueError(str(e)) from None
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished rows are stored in {results.root} — rerun the same command to resume",
              file=sys.stderr)
        raise SystemExit(130)
    print(report)
    for m in report.error_messages[:10]:
        print(f"  error: {m}", file=sys.stderr)
    df = results.load(compact=False)
    mine = df[df["row_id"].isin({t.row_id for t in spec.tasks()})] if len(df) else df
    ok = mine[mine["status"] == "ok"] if len(mine) else mine
    if len(ok):
        cols = [c for c in ("teacher_ppl", "kl", "repeat3", "refreshes", "teacher_tokens", "total_s") if c in ok]
        print(ok.groupby("policy", sort=False)[cols].mean().round(4).to_string())
    return report


def cmd_figures_from_results(args):
    from ..results import Results
    from .tables import write_from_results

    res = Results(args.results)
    if args.import_runs:
        print(f"imported {res.import_store(args.runs)} runs from the JSON run store")
    paths, note = write_from_results(res.load(), args.out, where=args.where)
    print(f"tables from results ({note}):")
    for p in paths:
        print(p)
    return paths
