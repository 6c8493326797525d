"""``python -m kvlab evict-long``: the long-context eviction study (issue 36: 2k-8k-token real texts, the Conf-KV
paper's budgets, KL to the full cache and the paper's perplexity gap), its table ``evict_long`` and one figure
per context length. Torch-free at import."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.core.args import positive_int

# inside `python -m kvlab all` (make figures): the size that fits its budget on a 2-core CPU, written under
# OUT/reduced (cli_common.reduced_out); the committed table comes from one longer run of the same command
# (docs/eviction.md, "At 2k-8k tokens") and make figures leaves it as it is
ALL_CONTEXTS = (2048,)
ALL_PROMPTS = 4


def int_list(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            vals = tuple(int(x) for x in str(text).split(",") if x.strip())
        except ValueError:
            vals = ()
        if not vals or any(v < 1 for v in vals):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: give comma-separated positive ints, e.g. 2048,4096")
        return vals
    return parse


def families(text: str) -> tuple[str, ...]:
    from kvlab.studies.eviction.long_policies import FAMILIES

    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    bad = [n for n in names if n not in FAMILIES]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"--families {text!r}: unknown {bad or '(empty)'}; choose from "
                                         f"{', '.join(FAMILIES)}")
    return names


def long_args(p: argparse.ArgumentParser) -> None:
    from kvlab.studies.eviction.long_policies import FAMILIES, GAMMA, GAP

    p.add_argument("--contexts", type=int_list("--contexts"), default=(2048, 4096, 8192),
                   help="context lengths in tokens (<= 8192, the embedded model's positions)")
    p.add_argument("--prompts", type=positive_int("--prompts"), default=32, help="documents (data/long_texts.jsonl)")
    p.add_argument("--tokens", type=positive_int("--tokens"), default=32,
                   help="forced continuation tokens per prompt (scored: steps 2..tokens)")
    p.add_argument("--budgets", type=int_list("--budgets"), default=(256, 512), help="cache budgets in entries")
    p.add_argument("--gamma", type=float, default=GAMMA, help="Conf-KV confidence threshold γ in [0, 1]")
    p.add_argument("--confkv-gap", type=positive_int("--confkv-gap"), default=GAP,
                   help="Conf-KV: loose - tight in entries (loose = the budget)")
    p.add_argument("--families", type=families, default=FAMILIES, metavar="NAME[,NAME...]",
                   help="policy families to run (default: all)")
    p.add_argument("--out", type=Path, default=Path("figures"), help="where the table and figures go")
    p.add_argument("--runs", type=Path, default=None, help="run store (default: the project's)")
    p.add_argument("--bench", type=Path, default=None,
                   help="folder with evict_batch_bench_timing.jsonl (`bench evict --batch 8 --cache-len ...`) for "
                        "the figures' tok/s axis (default: --out)")
    p.add_argument("--stored-only", action="store_true",
                   help="run nothing: the table and figures from the rows the run store holds (a prompt counts when "
                        "all its rows are stored; contexts may then differ in prompts)")
    p.add_argument("--no-progress", action="store_true")


def register(sub) -> None:
    p = sub.add_parser("evict-long", help="eviction at 2k-8k-token real texts: KL to full, perplexity gap, figures")
    long_args(p)
    p.set_defaults(fn=cmd_evict_long)


def cmd_evict_long(args) -> list[Path]:
    import time

    from kvlab.core.models import load_teacher
    from kvlab.harness.experiment import write_table
    from kvlab.store import RunStore
    from kvlab.studies.eviction.long_tables import LongStudy, long_notes, long_runs, long_table

    study = LongStudy(contexts=tuple(args.contexts), prompts=args.prompts, tokens=args.tokens,
                      budgets=tuple(args.budgets), gamma=args.gamma, gap=args.confkv_gap,
                      families=tuple(args.families))          # validates before the model loads
    t0 = time.perf_counter()
    lm = load_teacher()
    per_run = long_runs(lm, study, RunStore(args.runs), progress=not args.no_progress,
                        stored_only=bool(getattr(args, "stored_only", False)))
    from kvlab.studies.eviction.long_plots import add_speed, bench_speed, render_long

    if not len(per_run):
        raise SystemExit("evict-long: no complete prompt stored for these contexts (--stored-only): run without it")

    bench = getattr(args, "bench", None)
    table = add_speed(long_table(per_run), bench_speed(bench if bench is not None else args.out))
    paths = write_table(table, args.out, "evict_long", notes=long_notes(study))
    paths += render_long(args.out)
    print(f"### evict_long ({(time.perf_counter() - t0) / 60:.1f} min)\n" + (Path(args.out) / "evict_long.md").read_text())
    return paths


def evict_long_small(args) -> list[Path]:
    """evict-long inside the main job: ``--contexts 2048 --prompts 4`` at the job's defaults otherwise, written under
    ``OUT/reduced`` (its speed columns from OUT's bench timing, as the committed table's)."""
    from kvlab.harness.cli_common import reduced_out

    ns = argparse.Namespace(contexts=ALL_CONTEXTS, prompts=min(ALL_PROMPTS, args.prompts), tokens=32,
                            budgets=(256, 512), gamma=None, confkv_gap=None, families=None,
                            out=reduced_out(args.out), runs=args.runs, bench=args.out, no_progress=args.no_progress,
                            stored_only=False)
    from kvlab.studies.eviction.long_policies import FAMILIES, GAMMA, GAP

    ns.gamma, ns.confkv_gap, ns.families = GAMMA, GAP, FAMILIES
    return cmd_evict_long(ns)
