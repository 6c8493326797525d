""""How to read this" building blocks, shared by every study's readings (``kvlab/studies/<study>/readings.py``).

A reading takes the numbers a notebook shows and returns Markdown: which direction is better, what the spread
or interval means at this sample size, what the paper or blog found for the same quantity, and whether this
table agrees. Here: the sources the studies quote, the lookups (:func:`row_of`, :func:`n_of`) and the sentences
every study uses (:func:`interval_verdict`, :func:`paired_verdict`, :func:`spread_sentence`). The readings
themselves live beside their study's tables; ``kvlab.viz.readings`` gathers them for the notebooks.
"""
from __future__ import annotations

import math

import pandas as pd

from kvlab.harness.tableview import fmt, plural, single_prompt

# --- the sources, named (links where the source has one) --------------------------------------------------------
OVERFILL = "[OverFill (Kim et al. 2025)](https://arxiv.org/abs/2508.08446)"
BLOG = ("the blog *KV-Cache Refresh Methods for Long Generation* (Emara, Kim & Abdelfattah 2025; code: "
        "[friendshipkim/overfill](https://github.com/friendshipkim/overfill))")
BLOG_SETTING = "50 ELI5 prompts × 1200 tokens, a larger teacher/student pair"
CONFKV = ("the Conf-KV paper (*Conf-KV: Confidence-Aware KV Cache Eviction with Mixed-Precision Storage for "
          "Long-Horizon LLM*, Li & Miao 2026)")
OPENVINO = ("[OpenVINO GenAI's KV-cache eviction](https://github.com/openvinotoolkit/openvino.genai/blob/master/"
            "site/docs/concepts/optimization-techniques/kvcache-eviction-algorithm.md)")

HOW = "**How to read this.** "


def cap(s: str) -> str:
    """``s`` with its first letter upper-case (a source's name at the start of a sentence)."""
    return s[:1].upper() + s[1:]


def row_of(table: pd.DataFrame, policy: str, col: str = "policy"):
    """The first row whose ``col`` is ``policy``, or None."""
    hit = table[table[col] == policy]
    return None if hit.empty else hit.iloc[0]


def n_of(table: pd.DataFrame) -> int:
    """The table's largest prompt (or run) count: ``n_prompts``, ``n`` or ``n_runs``; 0 without one."""
    for c in ("n_prompts", "n", "n_runs"):
        if c in table.columns:
            return int(pd.to_numeric(table[c], errors="coerce").max())
    return 0


def join(parts) -> str:
    """The non-empty ``parts``, stripped, joined by spaces."""
    return " ".join(p.strip() for p in parts if p.strip())


def interval_verdict(d: float, lo: float, hi: float, one: bool, lower_is_better: bool = True,
                     mde: float | None = None, n: int | None = None) -> str:
    """What a paired difference and its bootstrap 95 % interval say, in words; with ``mde`` and ``n`` an
    interval that spans 0 reads "no detectable difference at n = N (MDE x)": how large an effect these
    prompts could have seen (kvlab.core.metrics.mde: 2.8 × SD / √n, 80 % power at α = 0.05)."""
    if one:
        return f"{fmt(d, 3, signed=True)} (one prompt: no interval, not evidence either way)"
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return f"{fmt(d, 3, signed=True)} (too few prompts for an interval: not evidence either way)"
    span = f"{fmt(d, 3, signed=True)} [{fmt(lo, 3, signed=True)}, {fmt(hi, 3, signed=True)}]"
    if lo > 0 or hi < 0:
        good = (hi < 0) == lower_is_better
        return f"{span}: {'better' if good else 'worse'} (the interval excludes 0)"
    if mde is not None and n is not None and not (isinstance(mde, float) and math.isnan(mde)):
        return f"{span}: no detectable difference at n = {n} (MDE {fmt(mde, 3)})"
    return f"{span}: no measurable change (the interval spans 0)"


def paired_verdict(r, m: str, one: bool, n: int, lower_is_better: bool = True) -> str:
    """:func:`interval_verdict` of row ``r``'s paired columns ``d_<m>``, ``_lo``, ``_hi``, ``_mde``."""
    g = (lambda c: float(r[c]) if c in r.index and pd.notna(r[c]) else float("nan"))
    return interval_verdict(g(f"d_{m}"), g(f"d_{m}_lo"), g(f"d_{m}_hi"), one, lower_is_better,
                            mde=g(f"d_{m}_mde"), n=n)


def spread_sentence(table: pd.DataFrame) -> str:
    """What ``±`` and the intervals mean at this table's prompt count."""
    n = n_of(table)
    if single_prompt(table):
        return "One prompt: there is no spread, and a single prompt can rank these rows either way. "
    rough = f" With only {plural(n, 'prompt')}, intervals are rough or not given." if n < 5 else ""
    return (f"`±` is the standard deviation across the {plural(n, 'prompt')} (how much one prompt differs from "
            f"another, not the uncertainty of the mean); paired differences carry a bootstrap 95 % interval.{rough} ")


__all__ = ["OVERFILL", "BLOG", "BLOG_SETTING", "CONFKV", "OPENVINO", "HOW", "cap", "row_of", "n_of", "join",
           "interval_verdict", "paired_verdict", "spread_sentence"]
