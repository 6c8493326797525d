"""What README.md and docs/*.md quote from the eviction study (``kvlab.viz.docs`` renders it): matched memory,
the needle's accuracy per context length, and the key results (Conf-KV at matched memory, each fixed budget
− Conf-KV, passkey retrieval).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvlab.harness.quotes import DocsError, View, cell, mde_note, pick, quote, read
from kvlab.harness.tableview import fmt
from kvlab.studies.eviction.long_readings import read_evict_long, read_needle_long


def needle_table(figures: Path) -> str:
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


LONG_BUDGET = 512          # the Conf-KV paper's budget; the README quotes this one (docs/eviction.md has both)
LONG_VS_SLIDING = ("streamingllm", "h2o", "scissorhands", "snapkv", "block", "confkv_l", "confkv_int8")


def _long_rows(figures: Path) -> list[tuple[str, str, str]]:
    """The long-context table at the paper's 512-entry budget, over the contexts with an interval (n >= 2): one row
    for each policy − the sliding window, one for the seeds' paired claims (``CLAIMS`` of
    :mod:`kvlab.studies.eviction.long_readings`); each row's cell holds every such context in turn, so another
    context adds no row."""
    from kvlab.studies.eviction.long_readings import CLAIMS

    if not (Path(figures) / "evict_long.csv").exists():
        return []
    t = read(figures, "evict_long")
    t = t[pd.to_numeric(t["budget"], errors="coerce") == LONG_BUDGET]
    vs, paired, ctxs, ns = [], [], [], set()
    for ctx, part in t.groupby("context", sort=True):
        n = int(part["n_prompts"].min())
        if n < 2:
            continue
        at = f"{int(ctx):,}"
        ctxs.append(at)
        ns.add(n)
        fam = {str(r["family"]): r for _, r in part.iterrows()}
        parts = [f"{f}: Δ " + cell(fam[f], ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi"))
                 + mde_note(fam[f], "d_kl_forced_mde", 3) for f in LONG_VS_SLIDING if f in fam]
        vs.append(f"**{at} tokens:** " + "; ".join(parts))
        claims = []
        for f, partner, what in CLAIMS:
            r = fam.get(f)
            if r is not None and str(r.get("partner", "")) == f"{partner}_b{LONG_BUDGET}":
                claims.append(f"{f} − {partner}: Δ " + cell(r, ("d_kl_partner", "d_kl_partner_lo", "d_kl_partner_hi"))
                              + mde_note(r, "d_kl_partner_mde", 3))
        ck = fam.get("confkv_l")
        if ck is not None:
            claims.append(f"Conf-KV-L at its loose budget on {fmt(float(ck['frac_at_loose']), 2)} of steps, closes "
                          f"{fmt(float(ck['gap_closed']), 2)} of the 512-window → full PPL gap (paper: 0.74)")
        paired.append(f"**{at} tokens:** " + "; ".join(claims))
    if not ctxs:
        return []
    n_txt = "/".join(str(x) for x in sorted(ns))                       # one number when every context has the same n
    listed = ctxs[0] if len(ctxs) == 1 else f"{', '.join(ctxs[:-1])} and {ctxs[-1]}"
    where = f"Eviction at {listed} tokens, {LONG_BUDGET} entries (n = {n_txt} per context)"
    return [(f"{where}: each policy − sliding window, teacher-forced KL to the full cache", " ".join(vs), "evict_long"),
            (f"{where}: the seeds' paired claims, teacher-forced KL", " ".join(paired), "evict_long")]


def _needle_long_rows(figures: Path) -> list[tuple[str, str, str]]:
    """Long-context retrieval (``evict_needle_long``), one row per setting over its lengths with n >= 2 cases: each
    policy's exact-match accuracy as hits/n with its Wilson 95 % interval, written "a to b" (an interval of a
    proportion, not of a difference: the key-results audit, which reads ``[lo, hi]`` as a paired difference, leaves
    it out)."""
    if not (Path(figures) / "evict_needle_long.csv").exists():
        return []
    t = read(figures, "evict_needle_long")
    rows = []
    for setting, gs in t.groupby("setting", sort=True):
        parts, lengths, ns, tasks, budget = [], [], set(), {}, 0
        for length, g in gs.groupby("length", sort=True):
            n = int(g["n"].min())
            if n < 2:
                continue
            ns.add(n)
            lengths.append(f"{int(length):,}")
            tasks.update(dict.fromkeys(str(x) for x in g["task"]))
            budget = max(budget, int(g["budget"].max()))
            cells = [f"{r.policy} {fmt(r.accuracy, 2)} ({round(r.accuracy * r.n)}/{int(r.n)}; Wilson "
                     f"{fmt(r.ci_lo, 2)} to {fmt(r.ci_hi, 2)})" for r in g.itertuples()]
            parts.append(f"**{int(length):,} tokens:** " + ", ".join(cells))
        if not parts:
            continue
        listed = lengths[0] if len(lengths) == 1 else f"{', '.join(lengths[:-1])} and {lengths[-1]}"
        n_txt = "/".join(str(x) for x in sorted(ns))
        rows.append((f"Retrieval at {listed} tokens ({', '.join(tasks)}, at most {budget} entries, n = {n_txt} "
                     f"cases per length), {setting} setting: exact match", " ".join(parts), "evict_needle_long"))
    return rows


VIEWS = {
    "evict_matched": View("evict_matched", [
        ("policy", "policy"), ("matched by", ("text", "matched_by")), ("mean K/V MiB", "mean_mb"),
        ("vs target", "mem_vs_target"), ("KL to full ↓", ("kl", "kl_std")),
        ("steps on loose", "frac_loose"), ("teacher-forced KL ↓", "kl_forced"),
        ("Δ forced KL vs Conf-KV (95 % CI)", ("d_kl_forced_vs_confkv", "d_kl_forced_vs_confkv_lo",
                                              "d_kl_forced_vs_confkv_hi")),
        ("ΔKL vs full", "d_kl_vs_full"), ("95 % CI", ("text", "d_kl_vs_full_ci")),
        ("ΔKL vs Conf-KV (95 % CI)", ("d_kl_vs_confkv", "d_kl_vs_confkv_lo", "d_kl_vs_confkv_hi")),
        ("teacher-PPL", "teacher_ppl"), ("repeat@3", "repeat3")]),
    "evict_needle": needle_table,
    "evict_long": View("evict_long", [
        ("context", "context"), ("policy", "policy"), ("mean entries", "mean_len"), ("K/V MiB (16-bit)", "kv_mb16"),
        ("KL to full ↓ (95 % CI)", ("kl_forced", "kl_forced_lo", "kl_forced_hi")),
        ("Δ KL vs sliding, same budget (95 % CI)", ("d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi")),
        ("MDE", "d_kl_forced_mde"), ("partner", ("text", "partner")),
        ("Δ KL vs partner (95 % CI)", ("d_kl_partner", "d_kl_partner_lo", "d_kl_partner_hi")),
        ("ppl of the text", "ppl"), ("gap closed", "gap_closed"), ("at loose", "frac_at_loose"),
        ("prompts", "n_prompts")]),
    "evict_long_reading": lambda figures: read_evict_long(read(figures, "evict_long")),
    "evict_needle_long_reading": lambda figures: read_needle_long(read(figures, "evict_needle_long")),
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: Conf-KV at matched mean memory, each other policy − Conf-KV on
    ``kl_forced``, and passkey retrieval per needle setting."""
    rows = []
    em = read(figures, "evict_matched")
    have = set(em["policy"].astype(str))
    if "confkv" in have:
        rows.append(("Eviction at matched mean memory: Conf-KV, teacher-forced KL to the full cache",
                     quote(figures, "evict_matched", "confkv", "kl_forced") + " (loose budget on "
                     + quote(figures, "evict_matched", "confkv", "frac_loose", 2) + " of steps)", "evict_matched"))
    labels = {"confkv_fixed": "its ranker at a fixed budget (schedule off)", "h2o": "H2O",
              "scissorhands": "Scissorhands", "sliding": "sliding window",
              "confkv_l": "Conf-KV-L (equal-memory pyramid + INT8)", "confkv_pyramidal": "equal-memory pyramid"}
    parts = [f"{label}: Δ " + cell(r, ("d_kl_forced_vs_confkv", "d_kl_forced_vs_confkv_lo", "d_kl_forced_vs_confkv_hi"))
             for pol, label in labels.items() if pol in have for r in [pick(em, pol, "evict_matched")]]
    if parts:
        rows.append(("Eviction at matched mean memory: each policy − Conf-KV, teacher-forced KL", "; ".join(parts),
                     "evict_matched"))
    rows += _long_rows(figures)
    rows += _needle_long_rows(figures)
    nd = read(figures, "evict_needle")
    if {"policy", "accuracy", "n"} <= set(nd.columns):
        settings = list(dict.fromkeys(nd["setting"])) if "setting" in nd.columns else [None]
        for st in settings:
            part = nd if st is None else nd[nd["setting"] == st]
            acc = (part["accuracy"] * part["n"]).groupby(part["policy"]).sum() / part["n"].groupby(part["policy"]).sum()
            # every policy of the grid: these first, then the rest in the table's order (SnapKV, ...)
            got = [p for p in dict.fromkeys(("full", "confkv", "h2o", "block", "sliding", *part["policy"]))
                   if p in acc.index]
            label = "Passkey retrieval under eviction (exact match)" + (f", {st} setting" if st else "")
            rows.append((label, ", ".join(f"{p} {fmt(acc[p], 2)}" for p in got), "evict_needle"))
    return rows


__all__ = ["VIEWS", "key_results", "needle_table"]
