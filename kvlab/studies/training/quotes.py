"""What README.md and docs/*.md quote from the training study (``kvlab.viz.docs`` renders it): the student
table, each variant's held-out KL before and after training, and the kept Pareto run (``docs/measured/``).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvlab.harness.quotes import ROOT, DocsError, View, as_number, cell, mde_note, read
from kvlab.harness.tableview import fmt


def heldout_table(figures: Path) -> str:
    """Each trained variant's held-out KL (teacher-forced, its own forward) before and after training."""
    df = read(figures, "train_curves")
    for c in ("variant", "step", "heldout_kl", "seconds"):
        if c not in df.columns:
            raise DocsError(f"figures/train_curves.csv has no column {c!r}")
    lines = ["| variant | steps | held-out KL, first evaluation | held-out KL, last | time in steps (min) |",
             "|---|---|---|---|---|"]
    for var, g in df.groupby("variant", sort=False):
        ev = g.dropna(subset=["heldout_kl"]).sort_values("step")
        if ev.empty:
            continue
        lines.append(f"| {var} | {int(g['step'].max())} | {fmt(float(ev['heldout_kl'].iloc[0]))} (step "
                     f"{int(ev['step'].iloc[0])}) | {fmt(float(ev['heldout_kl'].iloc[-1]))} | "
                     f"{fmt(float(g['seconds'].sum()) / 60, 1)} |")
    return "\n".join(lines) + "\n\n*Generated from `figures/train_curves.csv`.*"


MEASURED_PARETO = "docs/measured/train_pareto.csv"
MEASURED_PARETO_STANDALONE = "docs/measured/train_pareto_standalone.csv"


def pareto_table(figures: Path, measured: str = MEASURED_PARETO) -> str:
    """The training Pareto: one measured ``train-pareto`` run (held-out KL vs decode speed-up per prune shape
    and recipe), kept under ``docs/measured/`` because its speed columns depend on the machine."""
    path = ROOT / measured
    if not path.is_file():
        return (f"*No measured run is kept yet at `{measured}`: run `python -m kvlab train-pareto --out DIR`, keep "
                "DIR's train_pareto.csv there and run `python -m kvlab docs`.*")
    df = pd.read_csv(path)
    need = ("point", "status", "params_M", "heldout_kl", "heldout_kl_long", "speedup", "front", "front_long")
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise DocsError(f"{path} has no column(s) {missing}")
    lines = ["| point (shape : recipe) | params (M) | held-out KL, short ↓ | held-out KL, long ↓ | speed-up over "
             "the teacher ↑ | on the front (short / long) |", "|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        if r["status"] == "missing":
            lines.append(f"| `{r['point']}` | — | not trained | | | |")
            continue
        yes = lambda v: "yes" if str(v).lower() in ("true", "1", "yes") else "no"   # noqa: E731
        lines.append(f"| `{r['point']}` | {fmt(float(r['params_M']), 1)} | {fmt(float(r['heldout_kl']))} | "
                     f"{fmt(float(r['heldout_kl_long']))} | {fmt(float(r['speedup']), 2)}× | "
                     f"{yes(r['front'])} / {yes(r['front_long'])} |")
    first = df[df["status"] != "missing"].iloc[0] if (df["status"] != "missing").any() else None
    where = "" if first is None else f" on {first.get('device', 'cpu')} with {first.get('threads', '?')} thread(s)"
    variant = str(first.get("student", "overfill")) if first is not None else "overfill"
    return ("\n".join(lines) + f"\n\n*One run of `python -m kvlab train-pareto --student {variant}`{where}; from "
            f"[`{measured}`]({measured}) (the speed-ups depend on the machine).*")


def pareto_standalone_table(figures: Path) -> str:
    """The same for the standalone student: its recipes scored on its own held-out KL (issue 37's tuning)."""
    return pareto_table(figures, MEASURED_PARETO_STANDALONE)


VIEWS = {
    "train_study": View("train_study", [
        ("student (OverFill's)", "variant"), ("student alone", "student_alone"),
        ("forced KL: OverFill", "klf_OF"), ("alone", "klf_S"),
        ("forced ΔKL OF − S (95 % CI)", ("dklf_OF_vs_S", "dklf_OF_vs_S_lo", "dklf_OF_vs_S_hi")),
        ("forced ΔKL OF − own decoder alone", ("dklf_OF_vs_own", "dklf_OF_vs_own_lo", "dklf_OF_vs_own_hi")),
        ("refresh", ("text", "refresh")),
        ("forced ΔKL of the refresh", ("dklf_refresh", "dklf_refresh_lo", "dklf_refresh_hi")),
        ("on-path ΔKL OF − S", ("dkl_OF_vs_S", "dkl_OF_vs_S_lo", "dkl_OF_vs_S_hi")),
        ("prompts", "n_prompts")]),
    "train_heldout": heldout_table,
    "pareto": pareto_table,
    "pareto_standalone": pareto_standalone_table,
    **{name: View(name, [
        ("comparison (OverFill − baseline; negative = OverFill better)", "comparison"),
        ("OverFill decoder", "decoder_variant"), ("seeds", "n_seeds"), ("prompts", "n_prompts"),
        ("Δ forced KL, seeds × prompts (95 % CI)", ("d", "lo", "hi")), ("MDE", "mde"), ("SD over seeds", "sd_seeds"),
        ("prompts only (95 % CI)", ("d", "prompt_only_lo", "prompt_only_hi")), ("recipe", "recipe")])
       for name in ("train_seeds", "train_seeds_refresh_aware")},
}

SEEDS_NAMES = {"overfill − standalone": "a separately trained student (the paper's baseline)",
               "overfill − student": "the same decoder alone (the blog's baseline)"}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: OverFill − each baseline with training randomness in the interval
    (``train_seeds``: seeds × prompts, hierarchical bootstrap)."""
    df = read(figures, "train_seeds")
    first = df.iloc[0]
    what = (f"Training randomness ({int(as_number(first['n_seeds']))} training seeds × "
            f"{int(as_number(first['n_prompts']))} short prompts, {first['recipe']}, "
            f"{int(as_number(first['tokens']))} tokens): OverFill − baseline, teacher-forced KL (steps 2..N), "
            "seeds and prompts resampled (negative = OverFill better)")
    parts = [f"{SEEDS_NAMES.get(str(r['comparison']), r['comparison'])}: Δ " + cell(r, ("d", "lo", "hi"))
             + mde_note(r, "mde") + f", SD over seeds {cell(r, 'sd_seeds')}" for _, r in df.iterrows()]
    return [(what, "; ".join(parts), "train_seeds")]


__all__ = ["VIEWS", "key_results", "MEASURED_PARETO", "MEASURED_PARETO_STANDALONE", "heldout_table", "pareto_table",
           "pareto_standalone_table"]
