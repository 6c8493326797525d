"""``python -m kvlab bench <what>``: the benchmarks (each prints ratios measured in one run; timings written with
``--out`` are untracked). Torch-free at import."""
from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

from kvlab.core.args import positive_int


BENCHES = ("decode", "refresh", "surgery", "mc", "sweep", "evict", "students")


def register(sub, bench_sweep) -> None:
    """Add the ``bench`` subcommand to ``sub`` (the router's subparsers). ``bench_sweep(tokens=, prompts=, device=,
    dtype=)``: the sweep engine's benchmark (the router passes :func:`kvlab.sweep.bench.bench_sweep`; the sweep is
    in the apps layer, above the studies)."""
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
    p.add_argument("--every", type=_every_list, default=[1],
                   help="evict --batch: also ask each policy only every N-th step (kvpress's compression interval), "
                        "e.g. 1,16 (1 = every step)")
    p.add_argument("--policies", type=_name_list, default=None,
                   help="evict --batch: only these policies, e.g. full,h2o,confkv (default: all seven)")
    p.add_argument("--no-resident", dest="resident", action="store_false",
                   help="evict --batch: run every policy through the batched loop's evict phase, none as resident "
                        "rows (kvlab.cache.resident: sliding, H2O, Scissorhands, block, Conf-KV asked at every step, by default)")
    p.add_argument("--shapes", nargs="+", default=None,
                   help="students: prune shapes to compare, e.g. i0.30 h0.20,i0.50 h0.45,i0.45 (default: the default shape)")
    p.add_argument("--pairs", type=positive_int("--pairs"), default=16, help="surgery: replace_pairs in the tick")
    p.add_argument("--passes", type=int, default=8, help="mc: N noisy passes per step (>= 2)")
    p.add_argument("--dropout", type=float, default=0.1, help="mc: dropout probability p in [0, 1)")
    p.add_argument("--packed", choices=("auto", "mkl", "onednn"), default="auto",
                   help="the batched CPU step's packed weight products: auto (default: the faster library here, timed "
                        "once; kvlab.core.packed), mkl or onednn. Studies and figures run MKL where torch has it")
    p.add_argument("--decode-attention", choices=("auto", "sdpa", "eager"), default="auto",
                   help="the batched step's one-token attention: auto (default: the faster here, timed once; "
                        "kvlab.core.decode_attn), sdpa or eager. Studies and figures run SDPA")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--out", type=Path, default=None, help="evict: also write evict_bench_timing.{json,md} into this folder; decode: append one JSON line to "
                        "decode_bench_timing.jsonl there (untracked, like every timing)")
    p.set_defaults(fn=partial(cmd_bench, bench_sweep=bench_sweep))


def _positive_ints(s: str, what: str) -> list[int]:
    """Positive ints separated by commas, or ArgumentTypeError saying ``what`` is wanted (the flag and an example)."""
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise argparse.ArgumentTypeError(f"{what}, got {s!r}")
    return out


def _batch_list(s: str) -> list[int]:
    return _positive_ints(s, "--batch must be positive ints separated by commas (e.g. 1,4,8,16)")


def _every_list(s: str) -> list[int]:
    return _positive_ints(s, "--every must be positive ints separated by commas (e.g. 1,16; 1 = every step)")


def _name_list(s: str) -> list[str]:
    out = [x.strip() for x in s.split(",") if x.strip()]
    if not out:
        raise argparse.ArgumentTypeError(f"--policies must be names separated by commas (e.g. full,h2o), got {s!r}")
    return out


def _cache_lens(s: str) -> int | list[int]:
    """``--cache-len``: one positive int, or (bench evict --batch) several separated by commas (a list)."""
    out = _positive_ints(s, "--cache-len must be a positive int, or (bench evict --batch) several separated by "
                            "commas (e.g. 2048,4096)")
    return out[0] if len(out) == 1 else out


def cmd_bench(args, *, bench_sweep) -> None:
    """``python -m kvlab bench``: the bench's products through ``--packed``'s library (``kvlab.core.packed.BACKEND``)
    and its batched one-token attention through ``--decode-attention``'s (``kvlab.core.decode_attn.DECODE``), both
    put back afterwards: a bench run inside another program leaves its choices as it found them."""
    from kvlab.core import decode_attn, packed

    before = packed.BACKEND, decode_attn.DECODE
    packed.BACKEND = getattr(args, "packed", "auto")     # the bench's products: the faster library here by default
    decode_attn.DECODE = getattr(args, "decode_attention", "auto")     # ... and the faster one-token attention
    try:
        packed.backend()                                # checked (a library this torch lacks) before a model loads
        _cmd_bench(args, bench_sweep=bench_sweep)
    finally:
        packed.BACKEND, decode_attn.DECODE = before


def _cmd_bench(args, *, bench_sweep) -> None:
    from kvlab.studies.bench.bench import bench_decode, bench_mc
    from kvlab.core.data import load_prompts
    from kvlab.core.models import load_model, load_teacher
    from kvlab.train.pair import load_student

    if isinstance(args.cache_len, list) and not (args.what == "evict" and args.batch is not None):
        raise ValueError(f"--cache-len takes one value for bench {args.what} (a list only for bench evict --batch)")
    if getattr(args, "policies", None) is not None:
        if not (args.what == "evict" and args.batch is not None):
            raise ValueError(f"--policies is for bench evict --batch (got bench {args.what}"
                             f"{'' if args.batch is not None else ' without --batch'})")
        from kvlab.studies.bench.evict_batch import check_names

        check_names(args.policies)                  # before a model loads
    if not getattr(args, "resident", True) and not (args.what == "evict" and args.batch is not None):
        raise ValueError(f"--no-resident is for bench evict --batch (got bench {args.what}"
                         f"{'' if args.batch is not None else ' without --batch'})")
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
        if args.every != [1]:
            cmd = cmd.replace(" --out", f" --every {','.join(map(str, args.every))} --out")
        if args.policies is not None:
            cmd = cmd.replace(" --out", f" --policies {','.join(args.policies)} --out")
        if not getattr(args, "resident", True):
            cmd = cmd.replace(" --out", " --no-resident --out")
        for flag, v in (("--packed", getattr(args, "packed", "auto")),
                        ("--decode-attention", getattr(args, "decode_attention", "auto"))):
            if v != "auto":                             # a forced choice reproduces only with its flag
                cmd = cmd.replace(" --out", f" {flag} {v} --out")

        def emit(r):
            print(json.dumps(r), flush=True)
            if args.out is not None:
                _append_bench(args.out / "evict_batch_bench_timing.jsonl", r, cmd)

        bench_evict_batch(lm, args.batch, cache_len=lens, steps=args.tokens or 16, repeats=args.repeats,
                          on_row=emit, every=args.every, names=args.policies, resident=getattr(args, "resident", True))
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


def _append_bench(path: Path, res: dict, cmd: str) -> None:
    """Append one benchmark result (with its command, the checkout's commit, the machine and UTC time) as a JSON line:
    repeated runs accumulate, so every run of a noisy benchmark can be compared (and runs on different CPUs told
    apart: the same bench's ratios differ between CPU models; ``packed``: the library the batched step's weight products
    ran through, :func:`kvlab.core.packed.backend`; ``decode_attention``: the batched one-token attention,
    :func:`kvlab.core.decode_attn.described`)."""
    import datetime

    from kvlab.core.decode_attn import described
    from kvlab.core.packed import backend
    from kvlab.store.provenance import describe_machine, source_label

    path.parent.mkdir(parents=True, exist_ok=True)
    row = {"command": cmd, "commit": source_label(), "machine": describe_machine(), "packed": backend(),
           "decode_attention": described(),
           "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **res}
    with path.open("a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def _evict_bench_table(res: dict) -> str:
    """bench_evict's per-policy dict as an aligned table (ms per decode step, medians)."""
    import pandas as pd

    df = pd.DataFrame.from_dict(res["policies"], orient="index")
    df.index.name = "policy"
    return df.reset_index().to_string(index=False)
