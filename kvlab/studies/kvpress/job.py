"""The kvpress study's job: ``python -m kvlab.studies.kvpress.job`` writes ``evict_kvpress`` (and, with
``--heads``, ``evict_kvpress_heads``) under ``--out`` from runs stored under ``--runs`` (a rerun is free).

Until the CLI gains a ``kvpress`` subcommand this is its entry point; :func:`main` takes the same argv.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvlab.studies.kvpress.job", description=__doc__.split("\n\n")[0])
    add_kvpress_arguments(p)
    return p


def add_kvpress_arguments(p: argparse.ArgumentParser) -> None:
    """The job's flags on ``p`` (the CLI's ``kvpress`` subcommand reuses them)."""
    from kvlab.studies.kvpress.presses import MODES, PRESSES

    p.add_argument("--kvpress", default=",".join(PRESSES),
                   help="presses, comma-separated (kvpress class names; default: the study's list)")
    p.add_argument("--modes", default=",".join(MODES), help="prefill, decode or both (default)")
    p.add_argument("--budget", type=int, default=128, help="live entries per layer (default 128)")
    p.add_argument("--sinks", type=int, default=4, help="attention sinks every row keeps (default 4)")
    p.add_argument("--prompts", type=int, default=16, help="first N prompts of the prompt set (default 16)")
    p.add_argument("--prompt-set", default="long", help="default or long (default: long, 300-800 tokens)")
    p.add_argument("--tokens", type=int, default=16, help="new tokens per run (default 16)")
    p.add_argument("--batch", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default="runs/kvpress", help="run store folder (default runs/kvpress)")
    p.add_argument("--out", default="figures", help="where the tables go (default figures/)")
    p.add_argument("--heads", action="store_true", help="also the head-mean vs per-head table")
    p.add_argument("--heads-only", action="store_true", help="only the head-mean vs per-head table")
    p.add_argument("--heads-prompts", type=int, default=12, help="prompts of the heads table (default 12)")


def spec_of(args):
    from kvlab.core.data import load_prompts, prompt_set_file
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec

    rows = load_prompts(prompt_set_file(args.prompt_set), n=args.prompts)
    return RunSpec(prompts=tuple(r["prompt"] for r in rows), tokens=args.tokens,
                   sampling=Sampling(temperature=0.7, top_p=0.9, seed=args.seed), batch=args.batch)


def check_args(args) -> None:
    """The flags, before any model loads: a ValueError naming the flag and the fix."""
    from kvlab.studies.kvpress.presses import check_modes, make_press

    for flag in ("budget", "prompts", "tokens", "batch", "heads_prompts"):
        v = getattr(args, flag)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={v!r} must be a positive int")
    if not 0 <= args.sinks < args.budget:
        raise ValueError(f"--sinks={args.sinks} must be in [0, --budget={args.budget})")
    check_modes(tuple(m for m in args.modes.split(",") if m))
    names = [p for p in args.kvpress.split(",") if p]
    if not names:
        raise ValueError("--kvpress names no press: give kvpress class names, e.g. --kvpress SnapKVPress,KnormPress")
    for name in names:
        make_press(name)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    cmd_kvpress(parser().parse_args(argv), "python -m kvlab.studies.kvpress.job " + " ".join(map(shlex.quote, argv)))
    return 0


def cmd_kvpress(args, command: str = "") -> list[Path]:
    """Write the tables ``args`` asks for (the flags of :func:`add_kvpress_arguments`); ``command``: what the
    notes name as the command that made them. Returns the written paths."""
    import kvpress  # noqa: F401  (imported before any model runs: kvpress wraps transformers' attention functions
    # at import, and its wrapper passes `dropout` positionally, which kvlab's attention function does not take)
    import torch

    from kvlab.core.models import load_teacher
    from kvlab.store import RunStore
    from kvlab.studies.kvpress import heads, table

    check_args(args)
    spec = spec_of(args)
    teacher = load_teacher(device="cpu", dtype=torch.float32)
    store = RunStore(args.runs)
    lens = [len(teacher.encode_prompt(p)) for p in spec.prompts]
    note = (f" (the first {len(lens)} of data/{args.prompt_set} set; {min(lens)}-{max(lens)} tokens with the chat "
            f"template, mean {sum(lens) / len(lens):.0f})")
    presses = [p for p in args.kvpress.split(",") if p]
    written: list[Path] = []
    if not args.heads_only:
        t, _, skipped = table.kvpress_table(teacher, spec, presses, args.budget, store,
                                            modes=tuple(m for m in args.modes.split(",") if m), sinks=args.sinks,
                                            progress=True)
        paths = table.write_kvpress(t, args.out, table.table_notes(spec, args.budget, args.sinks, skipped,
                                                                   command, note))
        print("wrote", *paths, flush=True)
        written += paths
    if args.heads or args.heads_only:
        from dataclasses import replace

        hspec = replace(spec, prompts=spec.prompts[:args.heads_prompts])
        ht = heads.heads_table(teacher, hspec, heads.PER_HEAD, args.budget, store, progress=True)
        paths = heads.write_heads(ht, args.out, heads.heads_notes(hspec, args.budget, command, note))
        print("wrote", *paths, flush=True)
        written += paths
    return written


if __name__ == "__main__":
    raise SystemExit(main())
