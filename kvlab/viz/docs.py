"""Numbers in README.md and docs/*.md, generated from the committed tables (``figures/*.csv``), never typed.

A Markdown file marks each generated part; :func:`fill` rewrites what lies between the markers from the CSVs
and leaves everything else byte for byte:

* ``<!-- kvlab:table NAME -->`` … ``<!-- /kvlab:table -->`` — the table view ``NAME`` of :data:`VIEWS`
  (a handful of columns of one CSV with plain headers, every row, in the CSV's order); ``md:TABLE`` instead
  of a view name includes ``figures/TABLE.md`` as its job wrote it (a new table needs no view);
* ``<!-- kvlab:value CSV ROW COLUMNS [digits=N] -->`` … ``<!-- /kvlab:value -->`` — one number inline.
  ``ROW`` selects one row: a value of the CSV's first column (``periodic_T27``), ``col=value`` pairs
  joined by ``&`` (``p=0.1``), or ``#i`` for the i-th row; ``COLUMNS`` is one column (the value), two joined by ``,`` (``mean ± std``) or
  three (``d [lo, hi]``, a paired difference with its 95 % interval).

Views select columns by name, so a table that gains columns or rows needs no change here; a column or row a
marker names that the table lacks is an error naming the file, the marker and the column. ``python -m kvlab
docs`` rewrites the files (``make figures`` runs it last, after the tables); ``python -m kvlab docs --check``
and ``tests/test_docs.py`` fail when a quoted number disagrees with its table. Reads only ``figures/*.csv``
and writes only the Markdown files it is given; no model, cache or run store is touched.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence, Union

import pandas as pd

from kvlab.harness.tableview import fmt

ROOT = Path(__file__).resolve().parents[2]          # the project: README.md, docs/, figures/
FIGURES = ROOT / "figures"

Cell = Union[str, tuple]


class DocsError(ValueError):
    """A marker names a table, row or column that ``figures/`` does not have."""


# ----------------------------------------------------------------------------------------------- cells
def _num(v):
    if v is None or isinstance(v, str):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return v
    return f


def _nan(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def whole_columns(df: pd.DataFrame) -> set[str]:
    """Numeric columns of whole numbers, not all zero (counts: ``8``, not ``8.000``)."""
    out = set()
    for c in df.columns:
        v = pd.to_numeric(df[c], errors="coerce").dropna()
        if df[c].dtype.kind in "iuf" and len(v) and (v % 1 == 0).all() and (v != 0).any():
            out.add(c)
    return out


def cell(row: pd.Series, spec: Cell, digits: int = 3, ints: frozenset | set = frozenset()) -> str:
    """One cell: ``"col"`` the value; ``(mean, std)`` ``mean ± std``; ``(d, lo, hi)`` ``+d [lo, hi]``;
    ``("text", col)`` the column's text as written (labels, interval strings). Columns in ``ints`` are
    printed without decimals."""
    if isinstance(spec, str):
        v = _num(row[spec])
        if not _nan(v) and spec in ints:
            return str(int(v))
        return "–" if _nan(v) else (v if isinstance(v, str) else fmt(v, digits))
    if spec[0] == "text":
        v = row[spec[1]]
        return "–" if _nan(_num(v)) else str(v)
    if len(spec) == 2:
        mean, std = (_num(row[c]) for c in spec)
        return fmt(mean, digits) if _nan(std) else f"{fmt(mean, digits)} ± {fmt(std, digits)}"
    d, lo, hi = (_num(row[c]) for c in spec)
    if _nan(lo) or _nan(hi):
        return fmt(d, digits, signed=True)
    return f"{fmt(d, digits, signed=True)} [{fmt(lo, digits, signed=True)}, {fmt(hi, digits, signed=True)}]"


def _columns(spec: Cell) -> list[str]:
    if isinstance(spec, str):
        return [spec]
    return [spec[1]] if spec[0] == "text" else list(spec)


# ----------------------------------------------------------------------------------------------- views
@dataclass(frozen=True)
class View:
    """Columns of one CSV for people: ``columns`` is ``[(header, cell spec), …]``; ``rows`` (optional) keeps
    only the rows whose first column is listed, in that order; ``digits`` per view."""

    csv: str
    columns: Sequence[tuple[str, Cell]]
    rows: Sequence[str] | None = None
    digits: int = 3
    note: str = ""

    def render(self, figures: Path) -> str:
        df = read(figures, self.csv)
        for _, spec in self.columns:
            for c in _columns(spec):
                if c not in df.columns:
                    raise DocsError(f"figures/{self.csv}.csv has no column {c!r} (columns: {', '.join(df.columns)})")
        key = df.columns[0]
        if self.rows is not None:
            missing = [r for r in self.rows if r not in set(df[key].astype(str))]
            if missing:
                raise DocsError(f"figures/{self.csv}.csv has no row {missing[0]!r} in column {key!r}")
            df = df.set_index(df[key].astype(str)).loc[list(self.rows)].reset_index(drop=True)
        lines = ["| " + " | ".join(h for h, _ in self.columns) + " |",
                 "|" + "---|" * len(self.columns)]
        ints = whole_columns(df)
        for _, row in df.iterrows():
            lines.append("| " + " | ".join(cell(row, spec, self.digits, ints) for _, spec in self.columns) + " |")
        src = f"*Generated from `figures/{self.csv}.csv`" + (f"; {self.note}" if self.note else "") + ".*"
        return "\n".join(lines) + "\n\n" + src


def _needle(figures: Path) -> str:
    """Passkey accuracy per policy and context length (mean over depths and keys, weighted by ``n``); one row per
    (setting, policy) when the table has a ``setting`` column."""
    df = read(figures, "evict_needle")
    for c in ("policy", "length", "accuracy", "n"):
        if c not in df.columns:
            raise DocsError(f"figures/evict_needle.csv has no column {c!r}")
    keys = ["setting", "policy"] if "setting" in df.columns else ["policy"]
    df = df.assign(hits=df["accuracy"] * df["n"])
    by = df.groupby(keys + ["length"], sort=False)[["hits", "n"]].sum()
    acc = (by["hits"] / by["n"]).unstack("length")
    total = df.groupby(keys, sort=False)[["hits", "n"]].sum()
    lengths = sorted(acc.columns)
    head = keys + [f"{int(L)} tokens" for L in lengths] + ["all", "prompts"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in total.index:
        k = key if isinstance(key, tuple) else (key,)
        cells = [str(x) for x in k] + [fmt(acc.loc[key, L], 2) for L in lengths]
        cells += [fmt(total.loc[key, "hits"] / total.loc[key, "n"], 2), str(int(total.loc[key, "n"]))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n*Generated from `figures/evict_needle.csv` (exact-match accuracy).*"


def _train_heldout(figures: Path) -> str:
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


def _key_results(figures: Path) -> str:
    """README's small table: one line per finding, each number from its own table. Decoder comparisons and
    refresh are read on ``kl_forced`` (teacher-forced on a fixed reference, which loops cannot fool), each
    with its paired interval and the smallest difference detectable at that n (MDE)."""
    rows = []

    def one(csv: str, row: str, spec: Cell, digits: int = 3) -> str:
        return cell(pick(read(figures, csv), row, csv), spec, digits)

    def mde(r: pd.Series) -> str:
        v = _num(r.get("d_kl_forced_mde"))
        return "" if _nan(v) else f" (MDE {fmt(v, 2)})"

    reg = read(figures, "baselines_regimes")
    names = {"student": "the student alone (the blog's baseline)",
             "standalone": "a separately trained student (the paper's baseline)"}
    for _, r in reg.iterrows():
        regime = str(r["regime"]).split(",")[0]
        rows.append((f"{regime}: {names.get(str(r['baseline']), r['baseline'])} − OverFill, teacher-forced KL",
                     f"{cell(r, 'kl_forced_base')} vs {cell(r, 'kl_forced_OF')}; Δ "
                     + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")) + mde(r)
                     + f", n = {int(_num(r['n_prompts']))}", "baselines_regimes"))
    per = read(figures, "refresh_periodic")
    per = per[per["policy"].astype(str) != "none"]
    for _, r in per.sort_values("T").iterrows():
        rows.append((f"Periodic refresh T = {fmt(_num(r['T']), 0)} − no refresh (OverFill), teacher-forced KL",
                     "Δ " + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")) + mde(r), "refresh_periodic"))
    met = read(figures, "refresh_methods")
    for pol in met["policy"].astype(str):
        if pol.startswith(("speculative", "probe_kl", "entropy")):
            r = pick(met, pol, "refresh_methods")
            rows.append((f"{pol} − no refresh, teacher-forced KL",
                         "Δ " + cell(r, ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")) + mde(r),
                         "refresh_methods"))
    rows.append(("Student reading its own prompt cache − reading the teacher's (same tokens, teacher-forced)",
                 "ΔKL " + one("refresh_forced", "student", ("d_kl_vs_overfill", "d_lo", "d_hi")), "refresh_forced"))
    rows.append(("MC dropout (p = 0.1): correlation with the student's entropy",
                 "U " + one("mc_real_correlations", "p=0.1", "r_u", 2) + ", MI "
                 + one("mc_real_correlations", "p=0.1", "r_mi", 2) + ", flip "
                 + one("mc_real_correlations", "p=0.1", "r_flip", 2), "mc_real_correlations"))
    em = read(figures, "evict_matched")
    have = set(em["policy"].astype(str))
    if "confkv" in have:
        rows.append(("Eviction at matched mean memory: Conf-KV, teacher-forced KL to the full cache",
                     one("evict_matched", "confkv", "kl_forced") + f" (loose budget on "
                     + one("evict_matched", "confkv", "frac_loose", 2) + " of steps)", "evict_matched"))
    labels = {"confkv_fixed": "its ranker at a fixed budget (schedule off)", "h2o": "H2O",
              "scissorhands": "Scissorhands", "sliding": "sliding window", "confkv_l": "Conf-KV-L (equal-memory pyramid + INT8)",
              "confkv_pyramidal": "equal-memory pyramid"}
    for pol, label in labels.items():
        if pol in have:
            r = pick(em, pol, "evict_matched")
            rows.append((f"Eviction: {label} − Conf-KV, teacher-forced KL",
                         "Δ " + cell(r, ("d_kl_forced_vs_confkv", "d_kl_forced_vs_confkv_lo", "d_kl_forced_vs_confkv_hi")),
                         "evict_matched"))
    nd = read(figures, "evict_needle")
    if {"policy", "accuracy", "n"} <= set(nd.columns):
        settings = list(dict.fromkeys(nd["setting"])) if "setting" in nd.columns else [None]
        for st in settings:
            part = nd if st is None else nd[nd["setting"] == st]
            acc = (part["accuracy"] * part["n"]).groupby(part["policy"]).sum() / part["n"].groupby(part["policy"]).sum()
            got = [p for p in ("full", "confkv", "h2o", "block", "sliding") if p in acc.index]
            label = "Passkey retrieval under eviction (exact match)" + (f", {st} setting" if st else "")
            rows.append((label, ", ".join(f"{p} {fmt(acc[p], 2)}" for p in got), "evict_needle"))
    lines = ["| what | result | table |", "|---|---|---|"]
    lines += [f"| {a} | {b} | [`{c}`](figures/{c}.md) |" for a, b, c in rows]
    return "\n".join(lines) + "\n\n*Generated from `figures/*.csv` by `python -m kvlab docs`.*"


def _jsonl(rel: str) -> list[dict]:
    import json

    path = ROOT / rel
    if not path.is_file():
        raise DocsError(f"{path} does not exist: keep one run of its benchmark there (docs/benchmarks.md)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise DocsError(f"{path} is empty")
    return rows


MEASURED_PHASES = "docs/measured/make_figures_timing.jsonl"


def _phases(figures: Path) -> str:
    """The main job's phase table: one measured ``make figures`` run from an empty model cache and run store
    (``all_timing.jsonl`` as ``python -m kvlab all`` wrote it, kept under ``docs/measured/``)."""
    if not (ROOT / MEASURED_PHASES).is_file():
        return (f"*No measured run is kept yet: copy the lines of one `make figures` run from `figures/all_timing.jsonl` "
                f"to `{MEASURED_PHASES}` and run `python -m kvlab docs`.*")
    rows = _jsonl(MEASURED_PHASES)
    first = rows[0]
    lines = ["| job | minutes |", "|---|---|"]
    lines += [f"| {r['job']} | {fmt(r['seconds'] / 60, 1)} |" for r in rows]
    lines.append(f"| **all** | **{fmt(sum(r['seconds'] for r in rows) / 60, 1)}** |")
    return ("\n".join(lines) + f"\n\n*One run of `make figures` at {first['prompts']} prompts from an empty model cache "
            f"and run store, on {first.get('cpu') or 'the CPU'} with {first['threads']} threads ({first['device']}), "
            f"started {first['started']}; from [`{MEASURED_PHASES}`]({MEASURED_PHASES}), excluding the "
            "install.*")


MEASURED_BENCH = "docs/measured/decode_bench_batch.jsonl"
MEASURED_EVICT = "docs/measured/evict_bench_batch.jsonl"


def _measured_note(rows: list[dict], rel: str) -> str:
    r = rows[0]
    return (f"*One run of `{r.get('command', '?')}` at commit `{r.get('commit', '?')}`, {r.get('device', '?')} "
            f"{str(r.get('dtype', '')).replace('torch.', '')}, started {r.get('utc', '?')}; from "
            f"[`{rel}`]({rel}).*")


def _bench_decode(figures: Path) -> str:
    """The kept run of ``bench decode --batch``: kvlab vs HF ``generate`` per batch size, and the batch-8 variants
    against the plain batched loop."""
    rows = _jsonl(MEASURED_BENCH)
    lines = ["| batch | mode | kvlab tok/s | HF tok/s | kvlab / HF | gain over batch 1: kvlab / HF | vs the plain "
             "batched loop |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" in r:
            gain = (f"{fmt(r['kvlab_gain_vs_b1'], 2)}× / {fmt(r['hf_gain_vs_b1'], 2)}×"
                    if "kvlab_gain_vs_b1" in r else "–")
            lines.append(f"| {r['batch']} | {r['mode']} | {fmt(r['kvlab_tok_s'], 1)} | {fmt(r['hf_tok_s'], 1)} | "
                         f"{fmt(r['ratio'])} | {gain} | – |")
        else:
            lines.append(f"| {r['batch']} | {r['mode']} | {fmt(r['kvlab_tok_s'], 1)} | – | – | – | "
                         f"{fmt(r['vs_plain'])} (plain {r.get('plain_mode', '?')}: {fmt(r['plain_tok_s'], 1)} tok/s) |")
    return "\n".join(lines) + "\n\n" + _measured_note(rows, MEASURED_BENCH)


def _bench_evict(figures: Path) -> str:
    """The kept run of ``bench evict --batch``: each policy's decode speed over the full cache's, per batch size."""
    rows = _jsonl(MEASURED_EVICT)
    batches = sorted({r["batch"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    sp = {(r["policy"], r["batch"]): r["speedup_vs_full"] for r in rows}
    lines = ["| policy | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(f"{fmt(sp[(p, b)])}×" if (p, b) in sp else "–" for b in batches) + " |"
              for p in policies]
    r = rows[0]
    return ("\n".join(lines) + f"\n\n*Speed over the full cache's in the same run, a {r['cache_len']}-entry cache "
            f"evicted to about {min(x['final_len'] for x in rows)} entries, {r['steps']} steps.* " + _measured_note(rows, MEASURED_EVICT))


MEASURED_PARETO = "docs/measured/train_pareto.csv"


def _pareto(figures: Path) -> str:
    """The training Pareto: one measured ``train-pareto`` run (held-out KL vs decode speed-up per prune shape
    and recipe), kept under ``docs/measured/`` because its speed columns depend on the machine."""
    path = ROOT / MEASURED_PARETO
    if not path.is_file():
        return (f"*No measured run is kept yet: run `python -m kvlab train-pareto --out docs/measured` and "
                "`python -m kvlab docs`.*")
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
    return ("\n".join(lines) + f"\n\n*One run of `python -m kvlab train-pareto`{where}; from "
            f"[`{MEASURED_PARETO}`]({MEASURED_PARETO}) (the speed-ups depend on the machine).*")


VIEWS: dict[str, Union[View, Callable[[Path], str]]] = {
    "baselines": View("baselines", [
        ("policy", "policy"), ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")),
        ("KL(p_T‖q) ↓", ("kl", "kl_std")), ("teacher-forced KL ↓", ("kl_forced", "kl_forced_std")),
        ("Δ forced KL vs OverFill (95 % CI)", ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")),
        ("MDE", "d_kl_forced_mde"), ("repeat@3 ↓", ("repeat3", "repeat3_std")), ("distinct-2 ↑", "distinct2"),
        ("prompts", "n_prompts")]),
    "train_study": View("train_study", [
        ("student (OverFill's)", "variant"), ("student alone", "student_alone"),
        ("forced KL: OverFill", "klf_OF"), ("alone", "klf_S"),
        ("forced ΔKL OF − S (95 % CI)", ("dklf_OF_vs_S", "dklf_OF_vs_S_lo", "dklf_OF_vs_S_hi")),
        ("forced ΔKL OF − own decoder alone", ("dklf_OF_vs_own", "dklf_OF_vs_own_lo", "dklf_OF_vs_own_hi")),
        ("refresh", ("text", "refresh")),
        ("forced ΔKL of the refresh", ("dklf_refresh", "dklf_refresh_lo", "dklf_refresh_hi")),
        ("on-path ΔKL OF − S", ("dkl_OF_vs_S", "dkl_OF_vs_S_lo", "dkl_OF_vs_S_hi")),
        ("prompts", "n_prompts")]),
    "refresh_periodic": View("refresh_periodic", [
        ("policy", "policy"), ("refreshes", "refreshes"), ("teacher tokens", "teacher_tokens"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("MDE", "d_kl_forced_mde"), ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi")), ("repeat@3 ↓", "repeat3")]),
    "refresh_entropy": View("refresh_entropy", [
        ("policy", "policy"), ("τ (bits)", "tau_bits"), ("refreshes / 1k", "refreshes_per_1k"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi")), ("repeat@3 ↓", "repeat3")]),
    "refresh_methods": View("refresh_methods", [
        ("policy", "policy"), ("refresh_next", ("text", "refresh_next")), ("refreshes", "refreshes"),
        ("teacher tokens", "teacher_tokens"), ("probe tokens", "probe_tokens"),
        ("teacher-forced KL ↓", "kl_forced"), ("Δ forced KL vs none (95 % CI)", ("d_kl_forced", "d_kl_forced_lo",
                                                                                 "d_kl_forced_hi")),
        ("teacher-PPL ↓", ("teacher_ppl", "teacher_ppl_std")), ("KL ↓", ("kl", "kl_std")),
        ("ΔKL vs none (95 % CI)", ("d_kl", "d_kl_lo", "d_kl_hi"))]),
    "refresh_forced": View("refresh_forced", [
        ("cache written by", "condition"), ("KL(p_T‖q_S) ↓", ("kl", "kl_std")),
        ("Δ vs OverFill's cache (95 % CI)", ("d_kl_vs_overfill", "d_lo", "d_hi")), ("prompts", "n_prompts")]),
    "refresh_calibration": View("refresh_calibration", [
        ("student steps", "n_steps"), ("entropy p90 (bits)", "entropy_p90"), ("p95", "entropy_p95"),
        ("p99", "entropy_p99"), ("KL p90 (nats)", "kl_p90")]),
    "mc_real": View("mc_real_correlations", [
        ("dropout p", "p"), ("passes", "n_passes"), ("probed steps", "steps"), ("r(U, H)", "r_u"),
        ("r(MI, H)", "r_mi"), ("r(flip, H)", "r_flip"), ("mean MI (nats)", "mean_mi"), ("mean flip", "mean_flip")],
        digits=2, note="Pearson r with the student's entropy H"),
    "mc_sim": View("mc_phase_summary", [
        ("phase", "phase"), ("steps", "steps"), ("mean entropy (nats)", "mean_entropy"),
        ("entropy fires", "frac_entropy_fire"), ("MC-variance fires", "frac_mcvar_fire")]),
    "evict_matched": View("evict_matched", [
        ("policy", "policy"), ("matched by", ("text", "matched_by")), ("mean K/V MiB", "mean_mb"),
        ("vs target", "mem_vs_target"), ("KL to full ↓", ("kl", "kl_std")),
        ("steps on loose", "frac_loose"), ("teacher-forced KL ↓", "kl_forced"),
        ("Δ forced KL vs Conf-KV (95 % CI)", ("d_kl_forced_vs_confkv", "d_kl_forced_vs_confkv_lo",
                                              "d_kl_forced_vs_confkv_hi")),
        ("ΔKL vs full", "d_kl_vs_full"), ("95 % CI", ("text", "d_kl_vs_full_ci")),
        ("ΔKL vs Conf-KV (95 % CI)", ("d_kl_vs_confkv", "d_kl_vs_confkv_lo", "d_kl_vs_confkv_hi")),
        ("teacher-PPL", "teacher_ppl"), ("repeat@3", "repeat3")]),
    "evict_needle": _needle,
    "train_heldout": _train_heldout,
    "key_results": _key_results,
    "phases": _phases,
    "pareto": _pareto,
    "bench_decode": _bench_decode,
    "bench_evict": _bench_evict,
}


# ----------------------------------------------------------------------------------------------- tables
def read(figures: Path, name: str) -> pd.DataFrame:
    path = Path(figures) / f"{name}.csv"
    if not path.exists():
        raise DocsError(f"{path} does not exist: run `make figures` (or the job that writes {name}) first")
    return pd.read_csv(path)


def pick(df: pd.DataFrame, row: str, csv: str) -> pd.Series:
    """The one row ``row`` names: a first-column value, ``col=value&col=value``, or ``#i`` (the i-th row)."""
    if row.startswith("#") and row[1:].isdigit():
        if int(row[1:]) >= len(df):
            raise DocsError(f"figures/{csv}.csv has {len(df)} rows, no row {row}")
        return df.iloc[int(row[1:])]
    conds = [c.split("=", 1) for c in row.split("&")] if "=" in row else [(df.columns[0], row)]
    mask = pd.Series(True, index=df.index)
    for col, val in conds:
        if col not in df.columns:
            raise DocsError(f"figures/{csv}.csv has no column {col!r} (row selector {row!r})")
        try:
            f = float(val)
            mask &= pd.to_numeric(df[col], errors="coerce").sub(f).abs().lt(1e-12) | (df[col].astype(str) == val)
        except ValueError:
            mask &= df[col].astype(str) == val
    hits = df[mask]
    if len(hits) != 1:
        raise DocsError(f"figures/{csv}.csv: row selector {row!r} matches {len(hits)} rows, not 1")
    return hits.iloc[0]


# ----------------------------------------------------------------------------------------------- markers
BLOCK = re.compile(r"(<!-- kvlab:table (?P<name>(?:md:)?[\w-]+) -->\n)(?P<body>.*?)(<!-- /kvlab:table -->)", re.S)
VALUE = re.compile(r"(<!-- kvlab:value (?P<args>[^>]*?) -->)(?P<body>.*?)(<!-- /kvlab:value -->)", re.S)


def render_view(name: str, figures: Path = FIGURES) -> str:
    if name.startswith("md:"):                      # a table's own Markdown, as its job wrote it
        path = Path(figures) / f"{name[3:]}.md"
        if not path.exists():
            raise DocsError(f"{path} does not exist: run `make figures` (or the job that writes {name[3:]}) first")
        return path.read_text().strip()
    if name not in VIEWS:
        raise DocsError(f"no table view {name!r}; known: {', '.join(VIEWS)}")
    v = VIEWS[name]
    return v.render(Path(figures)) if isinstance(v, View) else v(Path(figures))


def render_value(args: str, figures: Path = FIGURES) -> str:
    parts = args.split()
    digits = 3
    for p in list(parts):
        if p.startswith("digits="):
            digits = int(p.split("=", 1)[1])
            parts.remove(p)
    if len(parts) != 3:
        raise DocsError(f"kvlab:value {args!r}: expected 'CSV ROW COLUMNS [digits=N]'")
    csv, row, cols = parts
    df = read(figures, csv)
    spec = cols.split(",")
    for c in spec:
        if c not in df.columns:
            raise DocsError(f"figures/{csv}.csv has no column {c!r} (marker kvlab:value {args})")
    return cell(pick(df, row, csv), spec[0] if len(spec) == 1 else tuple(spec), digits, whole_columns(df))


LINK = re.compile(r"\]\((?P<path>[^)\s]+)\)")


def rebase_links(md: str, base: str) -> str:
    """``md``'s relative links, written from the project root (``figures/x.md``, ``docs/measured/y.jsonl``), as
    seen from the folder ``base`` of the file they go into (``docs`` → ``../figures/x.md``, ``measured/y.jsonl``)."""
    import os

    if not base:
        return md

    def one(m):
        path = m.group("path")
        if re.match(r"^(?:[a-z][a-z0-9+.-]*:|/|#|\.\./)", path):     # a URL, absolute, an anchor, or rebased
            return m.group(0)
        return "](" + os.path.relpath(path, base).replace(os.sep, "/") + ")"

    return LINK.sub(one, md)


def fill(text: str, figures: Path = FIGURES, where: str = "", base: str = "") -> str:
    """``text`` with every marked block regenerated from the CSVs in ``figures``; ``base`` is the folder of the
    file the text goes into, relative to the project root (``""``: README.md; ``"docs"``), so the generated
    links, written from the root, resolve from there (:func:`rebase_links`)."""
    def table(m):
        try:
            return m.group(1) + rebase_links(render_view(m.group("name"), figures), base) + "\n" + m.group(4)
        except DocsError as e:
            raise DocsError(f"{where}: {e}") from None

    def value(m):
        try:
            return m.group(1) + render_value(m.group("args"), figures) + m.group(4)
        except DocsError as e:
            raise DocsError(f"{where}: {e}") from None

    return VALUE.sub(value, BLOCK.sub(table, text))


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md of the project."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def stale(root: Path = ROOT, figures: Path | None = None) -> list[Path]:
    """The files whose generated parts differ from what the tables give now."""
    figures = Path(figures) if figures is not None else root / "figures"
    return [p for p in doc_files(root) if fill(p.read_text(), figures, str(p), _base(p, root)) != p.read_text()]


def _base(path: Path, root: Path) -> str:
    """``path``'s folder relative to ``root`` (``""`` for a file at the root)."""
    rel = Path(path).resolve().parent.relative_to(Path(root).resolve())
    return "" if str(rel) == "." else rel.as_posix()


def write(root: Path = ROOT, figures: Path | None = None) -> list[Path]:
    """Regenerate every marked block in README.md and docs/*.md; returns the files that changed."""
    figures = Path(figures) if figures is not None else root / "figures"
    changed = []
    for p in doc_files(root):
        old = p.read_text()
        new = fill(old, figures, str(p), _base(p, root))
        if new != old:
            p.write_text(new)
            changed.append(p)
    return changed


def cmd_docs(args) -> list[Path]:
    """``python -m kvlab docs [--check]``: fill (or check) the generated numbers of README.md and docs/."""
    figures = Path(args.out).resolve() if getattr(args, "out", None) else FIGURES
    if figures != FIGURES.resolve():
        print(f"docs: skipped ({figures} is not the project's figures/ folder; the docs quote that one)")
        return []
    if getattr(args, "check", False):
        bad = stale(ROOT, figures)
        if bad:
            raise DocsError("generated numbers disagree with figures/ in " + ", ".join(str(p) for p in bad)
                            + ": run `python -m kvlab docs`")
        print(f"docs: {len(doc_files())} files agree with figures/")
        return []
    changed = write(ROOT, figures)
    for p in changed:
        print(f"docs: regenerated {p}")
    if not changed:
        print("docs: already up to date")
    return changed
