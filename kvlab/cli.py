"""``python -m kvlab <command>``: the main job, its pieces, and the benchmarks. Parses arguments, checks them
before any model loads, and calls the packages that do the work; writes only through them (tables and figures
under ``--out``, runs in the run store, the docs' generated numbers)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvlab.harness.args import check_model_args as _check_model_args
from kvlab.core.args import positive_int
from kvlab.harness.args import run_spec as _spec


# Prompts per table by default: 32, the smallest n at which a paired interval can resolve about 0.1-0.2 nats
# (each table prints the smallest difference it could detect at its n); batched decoding makes it affordable.
DEFAULT_PROMPTS = 32


def _common(p: argparse.ArgumentParser, prompts: int = DEFAULT_PROMPTS, tokens: int = 128) -> None:
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


def _announce(args, variants) -> None:
    """Say up front which trained students this command will train (or rebuild from the shipped adapters),
    roughly how long, and how to skip it (kvlab.train.plan); silent when they are cached."""
    from kvlab.core.models import resolve_device
    from kvlab.train.command import student_choice, train_choice
    from kvlab.train.plan import announce

    variant, shape = student_choice(args)
    if variant is not None:
        announce(variants or [variant], shape, train_choice(args), resolve_device(args.device))


def _pair(args):
    """(teacher, student): ``--student`` variant at ``--prune`` (trained and cached first if missing)."""
    from kvlab.train.pair import load_pair
    from kvlab.train.command import student_choice, train_choice

    variant, shape = student_choice(args)
    if variant is not None:   # baselines also needs the standalone student (its equal-budget row)
        alone = getattr(args, "fn", None) is cmd_baselines and _needs_standalone(variant)
        _announce(args, [variant] + (["standalone"] if alone else []))
    if variant is None:
        return load_pair(args.teacher, args.student, device=args.device, dtype=args.dtype)
    return load_pair(args.teacher, None, device=args.device, dtype=args.dtype, variant=variant, shape=shape,
                     train_if_missing=True, train=train_choice(args))


def _needs_standalone(variant) -> bool:
    """Whether the Student row of ``variant`` (a ``--student`` variant, None for a model path) is a separately
    trained ``standalone`` student: only for trained variants other than standalone itself."""
    return variant not in (None, "pruned", "standalone")


def _alone_student(args, student):
    """The Student row's model: ``standalone`` at the same shape when the OverFill student is a trained
    embedded variant (OverFill's own baseline), else the same student."""
    from kvlab.train.pair import load_student
    from kvlab.train.command import student_choice, train_choice

    variant, shape = student_choice(args)
    if not _needs_standalone(variant):
        return student
    return load_student("standalone", shape, device=args.device, dtype=args.dtype, train_if_missing=True,
                        train=train_choice(args))


def cmd_baselines(args) -> list[Path]:
    from kvlab.studies.baselines.table import baselines, write_baselines
    from kvlab.viz.figures import render
    from kvlab.store import RunStore

    spec = _spec(args)              # validates everything before any model loads
    teacher, student = _pair(args)
    table, per_run = baselines(teacher, student, spec, RunStore(args.runs), progress=not args.no_progress,
                               rebuild_student_cache=getattr(args, "rebuild_student_cache", False),
                               alone=_alone_student(args, student))
    name = "baselines" + _set_suffix(args)
    paths = write_baselines(table, per_run, args.out, name=name)
    if name == "baselines":
        paths += [render("baselines", args.out), render("baselines_timing", args.out)]
    paths += _write_regimes(args.out)
    print((args.out / f"{name}.md").read_text() + "\n" + (args.out / f"{name}_timing.md").read_text())
    return paths


def _set_suffix(args) -> str:
    """Table-name suffix of the prompt set: "" for the default set, "_long" for the long one (a custom
    --prompts-file keeps the default names)."""
    return "_long" if getattr(args, "prompt_set", "default") == "long" and getattr(args, "prompts_file", None) is None else ""


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


def cmd_mc_sim(args) -> list[Path]:
    from kvlab.viz.figures import render
    from kvlab.studies.mc.sim import simulate, write_outputs

    result = simulate()
    info = write_outputs(result, args.out)
    paths = [render(n, args.out) for n in ("mc_entropy", "mc_variance", "mc_triggers")]
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
    teacher, student = _pair(args)
    traces, table = correlation_study(teacher, student, prompts, ps=ps, tokens=args.tokens, n_passes=args.passes,
                                      sampling=_spec(args).sampling)
    args.out.mkdir(parents=True, exist_ok=True)
    from kvlab.viz.figures import render

    traces.round(6).to_csv(args.out / "mc_real_traces.csv", index=False)
    paths = [args.out / "mc_real_traces.csv"] + list(write_table(table.round(4), args.out, "mc_real_correlations") or [])
    paths.append(render("mc_real", args.out))
    print(json.dumps(table.round(4).to_dict(orient="records"), indent=1))
    return paths


def _calib_prompts(args, spec) -> tuple[str, ...]:
    """Calibration prompts: data/calibration.jsonl for the default set; for the long set the *last*
    ``--calib-prompts`` prompts of the long file, which must not overlap the ``--prompts`` evaluated."""
    from kvlab.core.data import calibration_file, load_prompts, prompt_set_file

    k = min(getattr(args, "calib_prompts", 4), 32)
    if _set_suffix(args):
        rows = load_prompts(prompt_set_file("long"))
        if len(spec.prompts) + k > len(rows):
            raise ValueError(f"--prompt-set long holds {len(rows)} prompts: --prompts {len(spec.prompts)} + "
                             f"--calib-prompts {k} (taken from its end) would overlap; lower one of them")
        return tuple(r["prompt"] for r in rows[-k:])
    return tuple(r["prompt"] for r in load_prompts(calibration_file(), n=k))


def cmd_refresh(args) -> list[Path]:
    """The full refresh tables (default) or one ``--policy`` against no refresh (kvlab.studies.refresh.choice)."""
    from dataclasses import replace as _replace

    from kvlab.viz.figures import render
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
    teacher, student = _pair(args)
    store = RunStore(args.runs)
    if choice is not None:
        tables = single_policy_tables(teacher, student, spec, store, calib, choice, progress=progress, **timing)
        tables = {f"{k}{_set_suffix(args)}": v for k, v in tables.items()}
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
    suffix = _set_suffix(args)
    if not suffix:
        tables["refresh_provenance"] = provenance_table(teacher, student, spec, progress=progress)
    tables = {f"{k}{suffix}": v for k, v in tables.items()}
    paths = write_refresh(tables, args.out)
    if not suffix:
        paths += [p for n in ("refresh_pareto", "refresh_provenance") if (p := render(n, args.out)) is not None]
    for name in ("refresh_periodic", "refresh_entropy", "refresh_methods", "refresh_timing", "refresh_forced"):
        if (args.out / f"{name}{suffix}.md").is_file():
            print(f"### {name}{suffix}\n" + (args.out / f"{name}{suffix}.md").read_text())
    return paths


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


def _mc_real_small(args):
    """mc-real inside the main job: a small, bounded size (at most 4 prompts × 64 tokens, N = 8,
    p ∈ {0.05, 0.1, 0.2})."""
    from argparse import Namespace

    return cmd_mc_real(Namespace(**{**vars(args), "prompts": min(args.prompts, 4), "tokens": min(args.tokens, 64),
                                    "passes": 8, "dropout": [0.05, 0.1, 0.2]}))


def _evict_args(p: argparse.ArgumentParser) -> None:
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


def cmd_evict(args) -> list[Path]:
    """Eviction experiments: sawtooth figure, matched-memory table, needle-retrieval table."""
    from dataclasses import replace as _replace

    from kvlab.studies.eviction.plots import evict_sawtooth_figure  # noqa: F401  (registers the figures)
    from kvlab.studies.eviction.tables import EvictStudy, NeedleGrid, evict_tables, write_evict
    from kvlab.viz.figures import render
    from kvlab.refresh.policies import Periodic
    from kvlab.store import RunStore

    spec = _spec(args)              # validates everything before any model loads
    n = getattr(args, "evict_prompts", None)
    if n is not None and n < len(spec.prompts):
        spec = _replace(spec, prompts=spec.prompts[:n])
    study = EvictStudy(gamma=args.gamma)
    grid = None if args.no_needle else NeedleGrid(tuple(args.needle_lengths), tuple(args.needle_depths),
                                                   args.needle_reps, args.needle_budget)
    teacher, student = _pair(args)
    tables = evict_tables(teacher, student, spec, RunStore(args.runs), study, grid,
                          refresh=Periodic(max(2, spec.tokens // 4)), progress=not args.no_progress)
    paths = write_evict(tables, args.out)
    paths += [p for p in (render("evict_sawtooth", args.out), render("evict_needle", args.out),
                          render("evict_gamma", args.out)) if p is not None]
    for name in ("evict_matched", "evict_needle"):
        if (args.out / f"{name}.md").is_file():
            print(f"### {name}\n" + (args.out / f"{name}.md").read_text())
    return paths


def cmd_train_missing(args) -> list[Path]:
    """Train (or find cached) every trained variant of the embedded student's shape."""
    from kvlab.train.command import student_choice, train_choice
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.train.weights import trained_student_path

    variant, shape = student_choice(args)
    if variant is None:
        print("train: skipped (--student is a model folder/hub id)", flush=True)
        return []
    _announce(args, list(TRAINED_VARIANTS))
    # cached, else built from the shipped adapters, else trained (make figures trains nothing when they match)
    return [trained_student_path(v, shape, train_choice(args), train_if_missing=True, device=args.device,
                                 progress=not args.no_progress) for v in TRAINED_VARIANTS]


def cmd_train_study(args) -> list[Path]:
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.studies.training.report import train_study

    _check_model_args(args)
    _announce(args, list(TRAINED_VARIANTS))
    return train_study(args)


# The main job: every table/figure, in order. Each entry: (name, handler). First the trained students that
# are missing, last the training study that compares them.
def _baselines_long(args) -> list[Path]:
    """The baselines table on the long-prompt / short-answer set too (``baselines_long`` and the side-by-side
    ``baselines_regimes``), same --prompts, 48 new tokens; skipped when the main job already used that set
    or a custom --prompts-file."""
    from argparse import Namespace

    from kvlab.core.data import SET_TOKENS

    if _set_suffix(args) or getattr(args, "prompts_file", None) is not None:
        print("baselines-long: skipped (the prompt set is not the default one)", flush=True)
        return []
    return cmd_baselines(Namespace(**{**vars(args), "prompt_set": "long", "tokens": SET_TOKENS["long"]}))


JOBS = [("train", cmd_train_missing), ("baselines", cmd_baselines), ("baselines-long", _baselines_long),
        ("mc-sim", cmd_mc_sim),
        ("mc-real", _mc_real_small), ("refresh", cmd_refresh), ("evict", cmd_evict),
        ("train-study", cmd_train_study)]


# Jobs that splice teacher K/V into the student cache: they need the pair's KV geometry to match.
# evict: its OverFill + refresh row; train-study: OverFill (+ refresh) with each trained student.
NEEDS_SAME_GEOMETRY = ("refresh", "evict", "train-study")


def cmd_all(args) -> list[Path]:
    """Every job of :data:`JOBS`, then the figures and the docs. Each job's wall time is printed and appended
    to ``--out/all_timing.jsonl`` (one line per job of this run; untracked, like every timing)."""
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
    env = {"started": stamp, "prompts": args.prompts, "device": str(resolve_device(args.device)),
           "threads": torch.get_num_threads(), "cpu": cpu}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn(args)
        dt = time.perf_counter() - t0
        print(f"== {name}: {dt / 60:.1f} min (all so far {(time.perf_counter() - t_all) / 60:.1f} min)", flush=True)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        with open(Path(args.out) / "all_timing.jsonl", "a") as f:
            f.write(json.dumps({**env, "job": name, "seconds": round(dt, 1)}) + "\n")
        return out

    for name, fn in JOBS:
        if getattr(args, "rebuild_student_cache", False) and name in NEEDS_SAME_GEOMETRY:
            print(f"== {name}: skipped (--rebuild-student-cache: the pair's KV geometry differs, and a refresh "
                  "splices teacher K/V into the student cache)", flush=True)
            continue
        print(f"== {name}", flush=True)
        paths += timed(name, fn)
    paths += timed("figures", cmd_figures)
    paths += timed("docs", cmd_docs)        # last: README.md and docs/ quote the tables just written
    return paths


def _batch_list(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"--batch must be positive ints separated by commas (e.g. 1,4,8,16), got {s!r}")
    return out


def _cache_lens(s: str) -> int | list[int]:
    """``--cache-len``: one positive int, or (bench evict --batch) several separated by commas (a list)."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"--cache-len must be a positive int, or (bench evict --batch) several "
                                         f"separated by commas (e.g. 2048,4096), got {s!r}")
    return out[0] if len(out) == 1 else out


def cmd_bench(args) -> None:
    from kvlab.studies.bench.bench import bench_decode, bench_mc
    from kvlab.core.data import load_prompts
    from kvlab.core.models import load_model, load_teacher
    from kvlab.train.pair import load_student

    if isinstance(args.cache_len, list) and not (args.what == "evict" and args.batch is not None):
        raise ValueError(f"--cache-len takes one value for bench {args.what} (a list only for bench evict --batch)")
    if args.what == "decode" and args.batch is not None:
        from kvlab.studies.bench.bench import bench_decode_batch

        lm = load_teacher(args.device, args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        student = None
        if args.model is None and 8 in args.batch:      # refresh's cost does not depend on training: untrained pruned
            student = load_student("pruned", device=args.device, dtype=args.dtype)
        prompts = [r["prompt"] for r in load_prompts(n=max(args.batch))]
        cmd = (f"python -m kvlab bench decode --batch {','.join(map(str, args.batch))} --tokens {args.tokens or 64} "
               f"--repeats {args.repeats} --out {args.out}")

        def emit(r):                                    # each row as soon as it is measured
            print(json.dumps(r), flush=True)
            if args.out is not None:
                _append_bench(args.out / "decode_bench_timing.jsonl", r, cmd)

        bench_decode_batch(lm, prompts, args.batch, tokens=args.tokens or 64, repeats=args.repeats, student=student,
                           on_row=emit)
    elif args.what == "evict" and args.batch is not None:
        from kvlab.studies.bench.bench import bench_evict_batch

        lens = args.cache_len if isinstance(args.cache_len, list) else [args.cache_len]
        if min(lens) < 64:
            raise ValueError(f"--cache-len={min(lens)} must be >= 64 for bench evict")
        lm = load_teacher(args.device, args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        cmd = (f"python -m kvlab bench evict --batch {','.join(map(str, args.batch))} "
               f"--cache-len {','.join(map(str, lens))} "
               f"--tokens {args.tokens or 16} --repeats {args.repeats} --out {args.out}")

        def emit(r):
            print(json.dumps(r), flush=True)
            if args.out is not None:
                _append_bench(args.out / "evict_batch_bench_timing.jsonl", r, cmd)

        bench_evict_batch(lm, args.batch, cache_len=lens, steps=args.tokens or 16, repeats=args.repeats,
                          on_row=emit)
    elif args.what == "decode":
        lm = load_teacher(args.device, args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        prompt = load_prompts(n=1)[0]["prompt"]
        res = bench_decode(lm, prompt, tokens=args.tokens or 64, repeats=args.repeats)
        print(json.dumps(res, indent=1))
        if args.out is not None:     # decode_bench_timing.jsonl (untracked, like every timing)
            _append_bench(args.out / "decode_bench_timing.jsonl", res,
                          f"python -m kvlab bench decode --tokens {args.tokens or 64} --repeats {args.repeats} "
                          f"--out {args.out}")
    elif args.what == "surgery":
        from kvlab.studies.bench.bench import bench_surgery

        lm = load_teacher(args.device, args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        print(json.dumps(bench_surgery(lm, cache_len=args.cache_len, pairs=args.pairs, repeats=args.repeats), indent=1))
    elif args.what == "mc":
        from kvlab.uncertainty.mc import check_n_passes, check_p

        check_n_passes(args.passes), check_p(args.dropout)   # before any model loads
        lm = load_student(device=args.device, dtype=args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        prompt = load_prompts(n=1)[0]["prompt"]
        print(json.dumps(bench_mc(lm, prompt, tokens=args.tokens or 64, n_passes=args.passes, p=args.dropout), indent=1))
    elif args.what == "sweep":
        from kvlab.sweep.bench import bench_sweep

        print(bench_sweep(tokens=args.tokens or 16, prompts=args.prompts, device=args.device, dtype=args.dtype))
    elif args.what == "refresh":
        from kvlab.studies.bench.bench import bench_refresh
        from kvlab.train.pair import load_pair

        teacher, student = load_pair(device=args.device, dtype=args.dtype)
        prompts = [r["prompt"] for r in load_prompts(n=args.prompts)]
        res = bench_refresh(teacher, student, prompts, tokens=args.tokens or 256, repeats=args.repeats)
        print(res.to_string(index=False))
    elif args.what == "students":   # the student's speed-up over the teacher beside its held-out KL, per shape
        from kvlab.studies.training.speed import speed_quality

        df = speed_quality(args.shapes or [None], device=args.device, dtype=args.dtype, steps=args.tokens or 32,
                           repeats=args.repeats)
        print(df.to_string(index=False))
        if args.out is not None:
            from kvlab.harness.experiment import write_table

            write_table(df, args.out, "students_speed_timing", notes=[
                "Decode ms per cached step (batch 1), teacher and student timed alternately in one process; "
                "held-out KL: the training log's teacher-forced KL on the held-out prompts (untrained: measured "
                f"here). `python -m kvlab bench students --shapes {' '.join(args.shapes or [])}`. Machine-dependent."])
    elif args.what == "evict":
        from kvlab.studies.bench.bench import bench_evict

        if args.cache_len < 64:   # before any model loads
            raise ValueError(f"--cache-len={args.cache_len} must be >= 64 for bench evict")
        lm = load_teacher(args.device, args.dtype) if args.model is None else load_model(args.model, args.device, args.dtype)
        res = bench_evict(lm, cache_len=args.cache_len, steps=args.tokens or 16, repeats=args.repeats)
        print(json.dumps({k: v for k, v in res.items() if k != "policies"}))
        print(_evict_bench_table(res))
        if args.out is not None:     # evict_bench_timing.{json,md} (untracked, like every timing)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "evict_bench_timing.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
            cmd = (f"python -m kvlab bench evict --cache-len {args.cache_len} --tokens {args.tokens or 16} "
                   f"--repeats {args.repeats} --out {args.out}")
            (args.out / "evict_bench_timing.md").write_text(f"`{cmd}` (device {lm.device})\n\n```\n"
                                                     + _evict_bench_table(res) + "\n```\n")


BENCHES = ("decode", "refresh", "surgery", "mc", "sweep", "evict", "students")


POLICY_FLAGS = ("T", "W", "tau", "tau_percentile", "min_gap", "M", "kappa", "kappa_percentile", "k", "threshold",
                "percentile", "signal", "probe_every", "refractory", "passes", "dropout")


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
def _append_bench(path: Path, res: dict, cmd: str) -> None:
    """Append one benchmark result (with its command and UTC time) as a JSON line: repeated runs
    accumulate, so every run of a noisy benchmark can be compared."""
    import datetime

    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"command": cmd, "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **res}
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _evict_bench_table(res: dict) -> str:
    """bench_evict's per-policy dict as an aligned table (ms per decode step, medians)."""
    import pandas as pd

    df = pd.DataFrame.from_dict(res["policies"], orient="index")
    df.index.name = "policy"
    return df.reset_index().to_string(index=False)




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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kvlab", description=__doc__, formatter_class=_DefaultsHelp)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("baselines", help="Teacher / OverFill / Student table + figure")
    _common(p)
    p.set_defaults(fn=cmd_baselines)
    p = sub.add_parser("mc-sim", help="the blog's MC-dropout simulation: CSVs + figures, thresholds as JSON")
    p.add_argument("--out", type=Path, default=Path("figures"))
    p.set_defaults(fn=cmd_mc_sim)
    p = sub.add_parser("mc-real", help="real MC dropout on the student: U/MI/flip vs entropy correlations")
    _common(p, prompts=8, tokens=64)
    p.add_argument("--passes", type=int, default=8, help="N noisy passes per step (>= 2)")
    p.add_argument("--dropout", type=float, nargs="+", default=[0.1], help="dropout probabilities p in [0, 1)")
    p.set_defaults(fn=cmd_mc_real)
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
    from kvlab.sweep.command import add_sweep_arguments

    p = sub.add_parser("sweep", help="run a grid of configs over prompts (resumable; local, processes or Ray)")
    add_sweep_arguments(p)
    p.set_defaults(fn=cmd_sweep)
    p = sub.add_parser("refresh", help="refresh policies: periodic / entropy / methods tables + Pareto figure")
    _common(p)
    p.add_argument("--calib-prompts", type=positive_int("--calib-prompts"), default=4,
                   help="calibration prompts (data/calibration.jsonl) for the entropy/KL thresholds")
    _refresh_options(p)
    p.set_defaults(fn=cmd_refresh)
    p = sub.add_parser("evict", help="eviction: sawtooth figure, matched-memory table, needle-retrieval table")
    _common(p, tokens=128)
    _evict_args(p)
    p.set_defaults(fn=cmd_evict)
    p = sub.add_parser("all", help="the main job: every table and figure (what `make figures` runs)")
    # 32 prompts x 64 new tokens (48 on the long set): the size that keeps `make figures` within 90 minutes on a
    # 2-core CPU from an empty cache (README's phase table); every job alone keeps its own default (128)
    _common(p, tokens=64)
    p.add_argument("--calib-prompts", type=positive_int("--calib-prompts"), default=4,
                   help="refresh: calibration prompts for the entropy/KL thresholds")
    # 1 prompt (not refresh's 2): the overhead timing is machine-dependent and untracked, and at 2 prompts it was
    # 17 of the main job's minutes on the 2-core CPU (`python -m kvlab refresh` keeps 2 x 2)
    p.add_argument("--timing-prompts", type=positive_int("--timing-prompts"), default=1,
                   help="refresh: prompts timed side by side for the overhead (python -m kvlab refresh: 2)")
    p.add_argument("--timing-repeats", type=int, default=2, help="refresh: paired timings per prompt and policy")
    _evict_args(p)
    p.add_argument("--evict-prompts", type=positive_int("--evict-prompts"), default=None,
                   help="prompts of the eviction job (default: all of --prompts; fewer = the first of them, >= 5 for "
                        "intervals; it runs ~25 configurations per prompt + the needle grid)")
    p.set_defaults(fn=cmd_all)
    p = sub.add_parser("docs", help="regenerate the numbers quoted in README.md and docs/ from figures/*.csv")
    p.add_argument("--out", type=Path, default=None, help="the tables (default and only choice: the project's figures/)")
    p.add_argument("--check", action="store_true", help="only check: fail when a quoted number disagrees")
    p.set_defaults(fn=cmd_docs)
    p = sub.add_parser("train-study", help="student variants compared: OverFill vs student alone, refresh, speed, curves")
    _common(p)
    p.set_defaults(fn=cmd_train_study)
    p = sub.add_parser("train-student", help="train the embedded student variants on the teacher (cached)")
    from kvlab.train.command import add_train_arguments, cmd_train_student

    add_train_arguments(p)
    p.set_defaults(fn=cmd_train_student)
    p = sub.add_parser("train-pareto", help="held-out KL vs decode speed-up per prune shape and training recipe "
                                            "(trains the missing points only with --train)")
    from kvlab.studies.training.pareto import add_pareto_arguments, cmd_train_pareto

    add_pareto_arguments(p)
    p.set_defaults(fn=cmd_train_pareto)
    p = sub.add_parser("bench", help="benchmarks (print ratios measured in one run)")
    p.add_argument("what", choices=BENCHES)
    p.add_argument("--model", default=None, help="hub id or folder (default: embedded teacher; mc: embedded student)")
    p.add_argument("--tokens", type=positive_int("--tokens"), default=None,
                   help="default: decode 64, refresh 256, mc 64, evict 16")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=3)
    p.add_argument("--batch", type=_batch_list, default=None,
                   help="decode / evict: batch sizes, e.g. 1,4,8,16 (decode: kvlab's batched loop vs HF generate per "
                        "size, plus eviction and refresh at batch 8; evict: eviction speed-up per size)")
    p.add_argument("--prompts", type=positive_int("--prompts"), default=2, help="refresh: prompts")
    p.add_argument("--cache-len", type=_cache_lens, default=2048,
                   help="surgery / evict: cache entries (bench evict --batch: a list, e.g. 2048,4096,8192)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="students: prune shapes to compare, e.g. i0.30 h0.20,i0.50 h0.45,i0.45 (default: the default shape)")
    p.add_argument("--pairs", type=positive_int("--pairs"), default=16, help="surgery: replace_pairs in the tick")
    p.add_argument("--passes", type=int, default=8, help="mc: N noisy passes per step (>= 2)")
    p.add_argument("--dropout", type=float, default=0.1, help="mc: dropout probability p in [0, 1)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", type=Path, default=None, help="evict: also write evict_bench_timing.{json,md} into this folder; decode: append one JSON line to "
                        "decode_bench_timing.jsonl there (untracked, like every timing)")
    p.set_defaults(fn=cmd_bench)
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

        args.tokens = SET_TOKENS["long"] if _set_suffix(args) else args.default_tokens
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
