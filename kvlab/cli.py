"""``python -m kvlab <command>``: the main job, its pieces, and the benchmarks. Parses arguments, checks them
before any model loads, and calls the packages that do the work; writes only through them (tables and figures
under ``--out``, runs in the run store, the docs' generated numbers)."""
# A router (the docstring above is `--help`'s description): each study's cli module (kvlab/studies/<study>/cli.py)
# adds its own subcommands, their flags and command functions; here are the top parser, the apps' own commands
# (figures, sweep, docs), the main job `all` that runs every study, and main().
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.core.args import positive_int
from kvlab.harness import cli_common
from kvlab.studies.baselines import cli as baselines_cli
from kvlab.studies.bench import cli as bench_cli
from kvlab.studies.eviction import cli as eviction_cli
from kvlab.studies.eviction import cli_long as needle_long_cli
from kvlab.studies.eviction import long_cli as evict_long_cli
from kvlab.studies.kvpress import cli as kvpress_cli
from kvlab.studies.mc import cli as mc_cli
from kvlab.studies.refresh import cli as refresh_cli
from kvlab.studies.training import cli as training_cli


def cmd_figures(args) -> list[Path]:
    from kvlab.viz.figures import render_all

    if getattr(args, "from_results", False):
        from kvlab.sweep.command import cmd_figures_from_results

        return cmd_figures_from_results(args)

    paths = render_all(args.out)
    for p in paths:
        print(p)
    return paths


def cmd_docs(args) -> list[Path]:
    from kvlab.viz.docs import cmd_docs as run

    return run(args)


def cmd_sweep(args):
    from kvlab.sweep.command import cmd_sweep as run

    return run(args)


# The main job: every table/figure, in order. Each entry: (name, handler). First the trained students that
# are missing, last the training study that compares them.
JOBS = [("train", training_cli.cmd_train_missing), ("baselines", baselines_cli.cmd_baselines),
        ("baselines-long", baselines_cli.baselines_long), ("mc-sim", mc_cli.cmd_mc_sim),
        ("mc-real", mc_cli.mc_real_small), ("refresh", refresh_cli.cmd_refresh),
        ("refresh-long", refresh_cli.refresh_long_all), ("evict", eviction_cli.cmd_evict),
        ("evict-long", evict_long_cli.evict_long_small), ("needle-long", needle_long_cli.needle_long_small),
        ("train-study", training_cli.cmd_train_study)]


# The short-context studies: refresh at 64 tokens with T = 3-14, eviction at 100-1,024-token contexts (the regimes
# issues 36 and 37 moved past: refresh-long, evict-long and needle-long are the blog's and the papers'). They were
# 52 of the 73 min of the AMD EPYC run (docs/measured/make_figures_timing_amd.jsonl: refresh 22.8, evict 29.6), and
# the 2-core Xeon runs the shared jobs 1.7-2.4 times slower (docs/measured/make_figures_timing.jsonl), so with them
# make figures cannot stay within 90 min there. `all` runs them only with --short-studies; otherwise their committed
# tables stay as they are (`python -m kvlab refresh` / `evict` regenerate them alone, at their own defaults).
SHORT_STUDIES = ("refresh", "evict")

# Jobs that splice teacher K/V into the student cache: they need the pair's KV geometry to match.
# refresh-long: OverFill + refresh; evict: its OverFill + refresh row; train-study: OverFill (+ refresh) with each trained student.
NEEDS_SAME_GEOMETRY = ("refresh", "refresh-long", "evict", "train-study")


# Minutes each job took, 2 threads, alone: the make figures run of docs/measured/make_figures_timing.jsonl (2-core Intel
# Xeon, 2026-11-27); the short-context studies (--short-studies) from the AMD EPYC run of
# docs/measured/make_figures_timing_amd.jsonl (1.7-2.4 times faster per job than the Xeon). Only their order is used: with
# --jobs > 1 the longest start first (longest-processing-time order).
JOB_MINUTES = {"train-study": 19.2, "refresh-long": 12.9, "baselines-long": 11.5, "baselines": 8.3,
               "evict-long": 5.1, "mc-real": 3.7, "needle-long": 2.1, "mc-sim": 0.1,
               "evict": 29.6, "refresh": 22.8}


def cmd_all(args) -> list[Path]:
    """Every job of :data:`JOBS`, then the figures and the docs. Each job's wall time is printed and appended
    to ``--out/all_timing.jsonl`` (one line per job of this run; untracked, like every timing). ``--jobs N``
    (N > 1): after ``train`` (the students the others load), the jobs run in N worker processes, each with
    1/N of the threads, longest first (:data:`JOB_MINUTES`); a job's tables do not depend on another's."""
    import platform
    import time

    import torch

    from kvlab.core.models import resolve_device

    paths, t_all = [], time.perf_counter()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    cpu = platform.processor() or platform.machine()
    try:                                       # the CPU's model name where Linux gives it
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    workers = getattr(args, "jobs", 1)
    env = {"started": stamp, "prompts": args.prompts, "device": str(resolve_device(args.device)),
           "threads": torch.get_num_threads(), "cpu": cpu, "workers": workers}

    def record(name, dt, threads=None):
        print(f"== {name}: {dt / 60:.1f} min (all so far {(time.perf_counter() - t_all) / 60:.1f} min)", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "all_timing.jsonl", "a") as f:
            f.write(json.dumps({**env, **({} if threads is None else {"threads": threads}), "job": name,
                                "seconds": round(dt, 1)}) + "\n")

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn(args)
        record(name, time.perf_counter() - t0)
        return out

    todo = []
    for name, fn in JOBS:
        if getattr(args, "rebuild_student_cache", False) and name in NEEDS_SAME_GEOMETRY:
            print(f"== {name}: skipped (--rebuild-student-cache: the pair's KV geometry differs, and a refresh "
                  "splices teacher K/V into the student cache)", flush=True)
            continue
        if name in SHORT_STUDIES and not getattr(args, "short_studies", False):
            print(f"== {name}: not run (a short-context study; its committed tables stay as they are: "
                  f"--short-studies runs it here, `python -m kvlab {name}` alone)", flush=True)
            continue
        todo.append((name, fn))
    if workers > 1:
        first = [(n, f) for n, f in todo if n == "train"]
        for name, fn in first:
            print(f"== {name}", flush=True)
            paths += timed(name, fn)
        rest = sorted((n for n, _ in todo if n != "train"), key=lambda n: -JOB_MINUTES.get(n, 0.0))
        threads = max(1, torch.get_num_threads() // workers)
        for name, got, dt in _run_parallel(rest, args, workers, threads):
            paths += [Path(p) for p in got]
            record(name, dt, threads)
        record("wall", time.perf_counter() - t_all)     # train + the side-by-side jobs, start to end
    else:
        for name, fn in todo:
            print(f"== {name}", flush=True)
            paths += timed(name, fn)
    paths += timed("figures", cmd_figures)
    paths += timed("docs", cmd_docs)        # last: README.md and docs/ quote the tables just written
    return paths


def _job_worker(name: str, args, threads: int):
    """One job of :data:`JOBS` in a worker process (``--jobs``): ``threads`` torch threads; returns its paths and
    seconds."""
    import time

    import torch

    torch.set_num_threads(threads)          # MPLBACKEND comes with the parent's environment (main sets it)
    t0 = time.perf_counter()
    out = dict(JOBS)[name](args)
    return name, [str(p) for p in (out or [])], time.perf_counter() - t0


def _run_parallel(names: list[str], args, workers: int, threads: int):
    """Run the jobs ``names`` (in this order) in ``workers`` fresh processes (spawned: no forked torch threads),
    one process per job; yields ``(name, paths, seconds)`` as each finishes. A failing job stops the rest
    (no new job starts) and its error is raised here."""
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("spawn")
    fresh = {"max_tasks_per_child": 1} if sys.version_info >= (3, 11) else {}   # a job's memory goes with it
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, **fresh) as pool:
        pending = list(names)
        running = {}
        while pending or running:
            while pending and len(running) < workers:
                name = pending.pop(0)
                print(f"== {name} (worker, {threads} thread{'s' if threads > 1 else ''})", flush=True)
                running[pool.submit(_job_worker, name, args, threads)] = name
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                running.pop(fut)
                try:
                    yield fut.result()
                except BaseException:
                    pending.clear()
                    for other in running:
                        other.cancel()
                    raise


class _DefaultsHelp(argparse.HelpFormatter):
    """Help that states every option's default (unless it is off/None or the help already says it)."""

    NONE_DEFAULTS = {"--device": "a CUDA GPU when present, else the CPU",
                     "--dtype": "bfloat16 on CUDA, float32 on CPU"}

    def _format_action(self, action):
        d, opt = action.default, (action.option_strings or [""])[-1]
        if "default" not in (action.help or "") and action.option_strings:
            text = None
            if d is None and opt in self.NONE_DEFAULTS:
                text = self.NONE_DEFAULTS[opt]
            elif not (d is None or d is False or d is argparse.SUPPRESS):
                text = "%(default)s"
            if text is not None:
                from copy import copy

                action = copy(action)
                action.help = f"{action.help} (default: {text})" if action.help else f"default: {text}"
        return super()._format_action(action)


def _bench_sweep(**kw):
    """``bench sweep``: the sweep engine's benchmark (:func:`kvlab.sweep.bench.bench_sweep`, imported when run)."""
    from kvlab.sweep.bench import bench_sweep

    return bench_sweep(**kw)


def _add_figures(sub) -> None:
    p = sub.add_parser("figures", help="render every registered figure from the tables in --out")
    p.add_argument("--out", type=Path, default=Path("figures"))
    p.add_argument("--from-results", action="store_true",
                   help="first rebuild baselines / refresh tables from the sweep results table")
    p.add_argument("--runs", "--results", dest="runs", type=Path, default=None,
                   help="run store (default $KVLAB_RUNS, else the project's runs/)")
    p.add_argument("--where", default=None, help="pandas query selecting result rows, e.g. 'max_new_tokens == 128'")
    p.add_argument("--import-runs", type=Path, default=None, metavar="DIR",
                   help="first migrate the per-run JSON files of older kvlab versions in DIR into the run store")
    p.set_defaults(fn=cmd_figures)


def _add_sweep(sub) -> None:
    from kvlab.sweep.command import add_sweep_arguments

    p = sub.add_parser("sweep", help="run a grid of configs over prompts (resumable; local, processes or Ray)")
    add_sweep_arguments(p)
    p.set_defaults(fn=cmd_sweep)


def _add_all(sub) -> None:
    p = sub.add_parser("all", help="the main job (what `make figures` runs): every table and figure but the short-context "
                                   "studies', which --short-studies adds")
    # 32 prompts x 64 new tokens (48 on the long set): the size that keeps `make figures` within 90 minutes on a
    # 2-core CPU from an empty cache (README's phase table); every job alone keeps its own default (128)
    cli_common.add_common_arguments(p, tokens=64)
    p.add_argument("--calib-prompts", type=positive_int("--calib-prompts"), default=4,
                   help="refresh: calibration prompts for the entropy/KL thresholds")
    # 1 prompt (not refresh's 2): the overhead timing is machine-dependent and untracked, and at 2 prompts it was
    # 17 of the main job's minutes on the 2-core CPU (`python -m kvlab refresh` keeps 2 x 2)
    p.add_argument("--timing-prompts", type=positive_int("--timing-prompts"), default=1,
                   help="refresh: prompts timed side by side for the overhead (python -m kvlab refresh: 2)")
    # 1 repeat (the refresh command keeps 2): the same untracked timing at half the cost
    p.add_argument("--timing-repeats", type=int, default=1, help="refresh: paired timings per prompt and policy")
    p.add_argument("--short-studies", action="store_true",
                   help="also run the short-context studies (" + ", ".join(SHORT_STUDIES) + "): refresh at 64 "
                        "tokens and eviction at 100-1,024 tokens, about two thirds of the main job's time; without "
                        "it their committed tables stay as they are")
    eviction_cli.evict_args(p)
    # The short passkey grid (256-1,024 tokens) took half of the evict job at 8 prompts on the 2-core Xeon (17 of
    # 35 min, cProfile): make figures leaves its committed table (`python -m kvlab evict`, which runs it) as it is;
    # the retrieval study at 2k-8k tokens is needle-long
    p.add_argument("--needle", dest="no_needle", action="store_false",
                   help="evict (with --short-studies): also run the short passkey grid (python -m kvlab evict runs it "
                        "by default)")
    p.set_defaults(no_needle=True)
    p.add_argument("--evict-prompts", type=positive_int("--evict-prompts"), default=None,
                   help="prompts of the eviction job (with --short-studies; default: all of --prompts; fewer = the first of them, >= 5 for "
                        "intervals, written under OUT/reduced so the committed tables stay; it runs ~25 "
                        "configurations per prompt)")
    # --jobs 2 on the 2-core Xeon: evict-long + needle-long side by side, one thread each, took 6.6 min against
    # 6.7 one after another with 2 threads (the pair is unbalanced: the short job's core idles); whether the whole
    # job list gains is not measured yet, so the default stays 1
    p.add_argument("--jobs", type=positive_int("--jobs"), default=1,
                   help="jobs run side by side in worker processes, each with its share of the threads, longest "
                        "first (1 = one after another, each with every thread)")
    p.set_defaults(fn=cmd_all)


def _add_docs(sub) -> None:
    p = sub.add_parser("docs", help="regenerate the numbers quoted in README.md and docs/ from figures/*.csv")
    p.add_argument("--out", type=Path, default=None, help="the tables (default and only choice: the project's figures/)")
    p.add_argument("--check", action="store_true", help="only check: fail when a quoted number disagrees")
    p.set_defaults(fn=cmd_docs)


def build_parser() -> argparse.ArgumentParser:
    """The top parser. Each study's cli module (kvlab/studies/<study>/cli.py, ``register``) adds its subcommands:
    their flags and command functions; the router adds its own (figures, sweep, the main job ``all``, docs). In
    this order, the order ``--help`` lists them."""
    ap = argparse.ArgumentParser(prog="python -m kvlab", description=__doc__, formatter_class=_DefaultsHelp)
    sub = ap.add_subparsers(dest="command", required=True)
    baselines_cli.register(sub)
    mc_cli.register(sub)
    _add_figures(sub)
    _add_sweep(sub)
    refresh_cli.register(sub)
    eviction_cli.register(sub)
    needle_long_cli.register(sub)
    evict_long_cli.register(sub)
    kvpress_cli.register(sub)
    _add_all(sub)
    _add_docs(sub)
    training_cli.register(sub)
    bench_cli.register(sub, bench_sweep=_bench_sweep)
    for p in sub.choices.values():      # every command's --help states the defaults
        p.formatter_class = _DefaultsHelp
    return ap


def main(argv=None) -> int:
    import os

    os.environ.setdefault("MPLBACKEND", "Agg")   # headless rendering; kvlab figures never need pyplot
    ap = build_parser()
    args = ap.parse_args(argv)
    if getattr(args, "default_tokens", None) is not None and getattr(args, "tokens", 0) is None:
        from kvlab.core.data import SET_TOKENS

        args.tokens = SET_TOKENS["long"] if cli_common.set_suffix(args) else args.default_tokens
    from kvlab.store import SESSION

    SESSION.clear()
    try:
        args.fn(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for root, stats in SESSION.items():   # what `make figures` reused vs recomputed
        print(f"run store {root}: {stats.summary()}")
    return 0
