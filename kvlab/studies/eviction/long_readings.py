""""How to read this" texts of the long-context eviction tables (``evict_long``, ``evict_needle_long``): what each
of the seeds' eviction claims comes to at 2k–8k tokens, per context length. Computed from the tables, so a
reading stays true (and keeps its caveats) when the numbers change; notebook 05 and docs/eviction.md show them.
"""
from __future__ import annotations

import math

import pandas as pd

from kvlab.harness.prose import CONFKV, cap, join
from kvlab.harness.tableview import fmt

CONFKV_GAP_CLOSED = 0.74       # the Conf-KV paper: Conf-KV-L closes 74 % of the 512-window → full PPL gap (GPT-2)
LOOSE_FLOOR = 0.3              # issue 36: the cache must stand at the loose budget on >= 30 % of steps
ENOUGH = 32                    # prompts per context the issue asks for before a row supports a claim

# (row family, partner family, what the comparison tests) — each read as "row − partner" on kl_forced
CLAIMS = (("streamingllm", "sliding", "StreamingLLM (re-rotated window) vs the sliding window at original positions"),
          ("h2o", "confkv_l", "H2O vs Conf-KV-L"),
          ("confkv_l", "confkv_l_fixed", "Conf-KV-L's confidence schedule vs its own ranker at a fixed budget of "
                                         "the same mean memory (schedule vs ranker)"),
          ("pyramidkv", "snapkv", "the pyramid (PyramidKV) vs uniform budgets (SnapKV)"),
          ("confkv_int8", "confkv_l", "uniform Conf-KV + INT8 vs Conf-KV-L (pyramid + INT8) at equal memory"))


def _num(v) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return f


def _verdict(d, lo, hi, mde, n: int) -> str:
    """A paired Δ (row − partner, lower = row better) in words, with its caveat."""
    d, lo, hi, mde = map(_num, (d, lo, hi, mde))
    if math.isnan(d):
        return "not measured"
    if math.isnan(lo):
        return f"Δ {fmt(d, 3, signed=True)} (n = {n}: too few prompts for an interval, not evidence either way)"
    span = f"Δ {fmt(d, 3, signed=True)} [{fmt(lo, 3, signed=True)}, {fmt(hi, 3, signed=True)}]"
    if lo > 0 or hi < 0:
        return f"{span}: {'better' if hi < 0 else 'worse'} (the interval excludes 0, n = {n})"
    m = "" if math.isnan(mde) else f", MDE {fmt(mde, 3)}"
    return f"{span}: no detectable difference at n = {n}{m}"


def _row(part: pd.DataFrame, family: str, budget: float):
    hit = part[(part["family"].astype(str) == family) & (pd.to_numeric(part["budget"], errors="coerce") == budget)]
    return None if hit.empty else hit.iloc[0]


def _partner_delta(part: pd.DataFrame, fam: str, partner: str, budget: float, n: int) -> str | None:
    r = _row(part, fam, budget)
    if r is None or _row(part, partner, budget) is None:
        return None
    if str(r.get("partner", "")) == f"{partner}_b{int(budget)}":
        return _verdict(r["d_kl_partner"], r["d_kl_partner_lo"], r["d_kl_partner_hi"], r["d_kl_partner_mde"], n)
    q = _row(part, partner, budget)             # no stored pair: the difference of means, no interval
    return _verdict(_num(r["kl_forced"]) - _num(q["kl_forced"]), float("nan"), float("nan"), float("nan"), n)


def read_evict_long(table: pd.DataFrame) -> str:
    """``evict_long``: per context, the ranking at each budget, each claim's paired Δ, the paper's gap measure and
    Conf-KV's time at the loose budget — each with its n and what it can support."""
    if table.empty:
        return "No long-context eviction runs yet: run `python -m kvlab evict-long`."
    parts = ["**How to read this.** KL is teacher-forced on the full cache's own continuation (lower = closer to "
             "keeping everything), each row at its budget's mean memory; Δ is a paired difference over prompts with a "
             "bootstrap 95 % interval (row − the row it is compared with, lower = the row is better)."]
    for ctx, part in table.groupby("context", sort=True):
        n = int(_num(part["n_prompts"].min()))
        head = f"**{int(ctx):,} tokens** ({n} prompt{'s' if n != 1 else ''}"
        head += (": a pilot below the n = 32 the claims need — read the numbers as sizes, not findings)" if n < ENOUGH
                 else ")")
        lines = [head + "."]
        for budget in sorted(pd.to_numeric(part["budget"], errors="coerce").dropna().unique()):
            b = part[pd.to_numeric(part["budget"], errors="coerce") == budget]
            order = b.sort_values("kl_forced")
            lines.append(f"At {int(budget)} entries, lowest KL first: " + ", ".join(
                f"{r.family} {fmt(r.kl_forced, 3)}" for r in order.itertuples()) + ".")
            for fam, partner, what in CLAIMS:
                v = _partner_delta(b, fam, partner, budget, n)
                if v is not None:
                    lines.append(f"{cap(what)}: {v}.")
            ck = _row(b, "confkv_l", budget)
            if ck is not None:
                fl = _num(ck["frac_at_loose"])
                if not math.isnan(fl):
                    ok = "meets" if fl >= LOOSE_FLOOR else "misses"
                    lines.append(f"Conf-KV-L's cache stands at its loose budget on {fmt(100 * fl, 0)} % of steps "
                                 f"({ok} the {fmt(100 * LOOSE_FLOOR, 0)} % a fair test of its schedule needs).")
                g = _num(ck["gap_closed"])
                if not math.isnan(g):
                    lines.append(f"Perplexity of the text's continuation: Conf-KV-L closes {fmt(100 * g, 0)} % of the "
                                 f"gap between a 512-entry sliding window and the full cache ({CONFKV}: "
                                 f"{CONFKV_GAP_CLOSED:.0%} on GPT-2).")
        parts.append(" ".join(lines))
    return join(parts)


def read_needle_long(table: pd.DataFrame) -> str:
    """``evict_needle_long``: per setting and length, accuracy with its Wilson interval, and whether the full cache
    succeeds there (a miss is the policy's only where it does)."""
    if table.empty:
        return "No long-context retrieval runs yet: run `python -m kvlab needle-long`."
    parts = ["**How to read this.** Exact-match retrieval on RULER-style tasks; each accuracy has a Wilson 95 % "
             "interval over its n cases. With n below about 60 an interval is wide: 1/1 is [0.21, 1.00]."]
    for (setting, length), g in table.groupby(["setting", "length"], sort=True):
        full = g[g["policy"].astype(str) == "full"]
        fa = _num(full["accuracy"].iloc[0]) if len(full) else float("nan")
        cells = ", ".join(f"{r.policy} {fmt(r.accuracy, 2)} [{fmt(r.ci_lo, 2)}, {fmt(r.ci_hi, 2)}] (n = {int(r.n)})"
                          for r in g.itertuples())
        tail = ("" if math.isnan(fa) else
                " The full cache succeeds here, so a miss is the policy's." if fa >= 0.9 else
                " The full cache itself fails here often: misses are not only the policy's.")
        parts.append(f"**{setting}, {int(length):,} tokens:** {cells}.{tail}{_against_full(g, full)}")
    return join(parts)


def _against_full(g: pd.DataFrame, full: pd.DataFrame) -> str:
    """Which policies retrieve detectably less than the full cache (their Wilson interval lies wholly below the full
    cache's: a conservative test) and which are not apart from it at this n; empty below n = 2."""
    if not len(full) or int(full["n"].iloc[0]) < 2:
        return ""
    lo_full = _num(full["ci_lo"].iloc[0])
    rest = g[g["policy"].astype(str) != "full"]
    below = [str(r.policy) for r in rest.itertuples() if _num(r.ci_hi) < lo_full]
    level = [str(r.policy) for r in rest.itertuples() if _num(r.ci_hi) >= lo_full]
    out = []
    if below:
        out.append(f"below the full cache (Wilson intervals apart): {', '.join(below)}")
    if level:
        out.append(f"not apart from it at n = {int(full['n'].iloc[0])}: {', '.join(level)}")
    return " " + cap("; ".join(out)) + "." if out else ""


__all__ = ["read_evict_long", "read_needle_long", "CLAIMS"]
