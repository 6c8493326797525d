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
    g.add_argument("--student", nargs="+", default=None, metavar="VARIANT",
                   help="embedded student variant(s), a list sweeps it: pruned | standalone | overfill | refresh-aware "
                        "(default: overfill; trained ones must be in the model cache: python -m kvlab train-student); "
                        "or one hub id / model folder (= models.student)")
    g.add_argument("--prune", nargs="+", default=None, metavar="SHAPE",
                   help="prune shape(s) of the embedded student, e.g. h0.20,i0.50 (default kvlab.core.models.DEFAULT_SHAPE)")
    g.add_argument("--student-ratio", type=float, nargs="+", default=None,
                   help="old flag: the untrained student at these MLP ratio(s) (= --student pruned --prune iR)")
    g.add_argument("--repeats", type=int, default=None, help="seeds per (config, prompt)")
    g.add_argument("--refresh-next", nargs="+", default=None, help="rerun student teacher")
    g.add_argument("--no-baseline", action="store_true", help="do not add each mode's no-policy run")
    g.add_argument("--temperature", type=float, nargs="+", default=None)
    g.add_argument("--top-p", type=float, nargs="+", default=None)
    g.add_argument("--seed", type=int, default=None, help="base seed (prompt i, repeat r: seed + i + 10000 r)")
    g.add_argument("--models", choices=("embedded", "tiny"), default=None,
                   help="'tiny': random tiny models (tests/benchmarks of the machinery)")
    g.add_argument("--teacher", default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default=None)
    e = p.add_argument_group("where and how it runs")
    e.add_argument("--engine", choices=("local", "ray"), default="local")
    e.add_argument("--workers", type=int, default=None,
                   help="local: processes (default 1 = in-process); ray: actors (default: one per CPU, or per GPU)")
    e.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray instance)")
    e.add_argument("--batch", type=int, default=None, metavar="N",
                   help="tasks of one model pair and mode a worker decodes together (default "
                        "kvlab.harness.experiment.DEFAULT_BATCH; 1 = one run at a time); not part of a run's key")
    e.add_argument("--runs", "--results", dest="runs", type=Path, default=None,
                   help="run store (default $KVLAB_RUNS, else the project's runs/)")
    e.add_argument("--worker-memory", type=float, default=None, metavar="GiB",
                   help="ray: memory each actor (a teacher+student pair) reserves (default: measured pair size x2 + 1 GiB)")
    e.add_argument("--no-retry-errors", action="store_true", help="keep error rows instead of rerunning them")
    e.add_argument("--dry-run", action="store_true", help="validate, print the grid and what is left to run; run nothing")
    e.add_argument("--no-progress", action="store_true")


def overrides(args) -> dict:
    """The flags as a TOML-shaped dict (only flags that were given)."""
    from kvlab.sweep.spec import parse_policy_flag

    o: dict = {}

    def put(table, key, value):
        if value is not None:
            o.setdefault(table, {})[key] = value

    if args.name is not None:
        o["name"] = args.name
    put("run", "modes", args.modes)
    put("run", "tokens", args.tokens)
    put("run", "student_ratio", args.student_ratio)
    put("run", "prune", args.prune)
    if args.student is not None:
        from kvlab.train.config import STUDENT_VARIANTS

        if len(args.student) == 1 and args.student[0] not in STUDENT_VARIANTS and (
                "/" in args.student[0] or Path(args.student[0]).expanduser().exists()):
            put("models", "student", args.student[0])        # a model of one's own
        else:
            put("run", "student", args.student)
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
    for k in ("teacher", "device", "dtype"):
        put("models", k, getattr(args, k))
    for section in ("refresh", "evict"):
        for flag in getattr(args, section) or []:
            o.setdefault(section, {}).update(parse_policy_flag(flag, section))
    return o


def spec_from_args(args):
    from kvlab.sweep.spec import load_spec, parse_spec

    o = overrides(args)
    if args.grid is not None:
        return load_spec(args.grid, o)
    if not any(k in o for k in ("run", "refresh", "evict")):
        raise ValueError("sweep needs a GRID.toml or grid flags (e.g. --modes teacher overfill "
                         "--refresh 'periodic T=16,32')")
    return parse_spec(o)


def cmd_sweep(args):
    from kvlab.store.results import Store
    from kvlab.sweep.engines import LocalEngine
    from kvlab.sweep.runner import key_tasks, pending, run_sweep

    from kvlab.sweep.students import check_trained

    from kvlab.harness.experiment import check_batch

    check_batch(args.batch)                   # every check before any model loads
    spec = spec_from_args(args)
    check_trained(spec)                       # a trained student the model cache lacks: name train-student
    store = Store(args.runs)
    if args.dry_run:
        configs = spec.configs()
        tasks, probes = key_tasks(spec, LocalEngine())     # fingerprints of this machine's device
        todo, stored = pending(tasks, store, not args.no_retry_errors)
        for (_, student), p in probes.items():
            if "error" in p:
                print(f"  student {student.label if student else spec.models.student}: {p['error']} "
                      "(its tasks would be error rows)", file=sys.stderr)
        print(f"sweep {spec.name!r}: {len(configs)} configs x {len(spec.prompts)} prompts x {spec.repeats} repeats "
              f"= {len(tasks)} tasks; {len(stored)} stored (keyed for this machine's device), {len(todo)} to run "
              f"-> {store.root}")
        for c in configs:
            who = c.student.label if c.student is not None else spec.models.student
            print(f"  {c.mode:9s} N={c.tokens:<5d} student={who} T={c.temperature} {c.policy}")
        return spec
    kw = {}
    if args.worker_memory is not None:
        if args.engine != "ray" or not args.worker_memory > 0:
            raise ValueError(f"--worker-memory={args.worker_memory} needs --engine ray and a positive number of GiB")
        kw["memory_per_worker"] = int(args.worker_memory * (1 << 30))
    try:
        report = run_sweep(spec, engine=args.engine, workers=args.workers, address=args.address, store=store,
                           progress=not args.no_progress, retry_errors=not args.no_retry_errors, batch=args.batch,
                           **kw)
    except ConnectionError as e:
        raise ValueError(str(e)) from None
    except KeyboardInterrupt:
        print(f"\ninterrupted; finished runs are stored in {store.root} — rerun the same command to resume",
              file=sys.stderr)
        raise SystemExit(130)
    print(report)
    for m in report.error_messages[:10]:
        print(f"  error: {m}", file=sys.stderr)
    mine = store.load(sweep=spec.name, compact=False)
    ok = mine[mine["status"] == "ok"] if len(mine) else mine
    if len(ok):
        cols = [c for c in ("teacher_ppl", "kl", "repeat3", "refreshes", "teacher_tokens", "total_s") if c in ok]
        print(ok.groupby("policy", sort=False)[cols].mean().round(4).to_string())
    return report


def cmd_figures_from_results(args):
    from kvlab.store.results import Store
    from kvlab.sweep.tables import write_from_results

    store = Store(args.runs)
    if args.import_runs is not None:
        print(f"migrated {store.import_json(args.import_runs)} runs from the JSON files in {args.import_runs}")
    paths, note = write_from_results(store.load(), args.out, where=args.where)
    print(f"tables from the run store {store.root} ({note}):")
    for p in paths:
        print(p)
    return paths
