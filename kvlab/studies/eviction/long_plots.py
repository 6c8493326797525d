"""The long-context eviction figures, one per context length, to pick a policy from: KL to the full cache (y, with
its 95 % interval) against speed (x: tok/s at batch 8 from ``bench evict`` where it was measured, else the mean
live length), marker size = resident K/V bytes. Registered in :mod:`kvlab.harness.figures` as
``evict_long_<context>``; functions of ``evict_long.csv``."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from kvlab.harness.figures import figure, new_figure

FIG_CONTEXTS = (2048, 4096, 8192)
BENCH_FILE = "evict_batch_bench_timing.jsonl"
# the study's families -> the bench's policy names (bench evict --batch runs each at budget = context / 4)
BENCH_NAMES = {"full": "full", "sliding": "sliding", "h2o": "h2o", "scissorhands": "scissorhands",
               "snapkv": "snapkv", "block": "block", "confkv_l": "confkv", "confkv_int8": "confkv",
               "confkv_l_fixed": "confkv"}


def bench_speed(folder, batch: int = 8) -> dict[tuple[str, int], float]:
    """``{(bench policy, cache_len): tok/s}`` at ``batch`` from ``folder/evict_batch_bench_timing.jsonl`` (the
    last row of each wins); empty when the file is absent."""
    p = Path(folder) / BENCH_FILE if folder is not None else None
    if p is None or not p.is_file():
        return {}
    out = {}
    for line in p.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("batch") == batch and "tok_s" in r and "policy" in r and "cache_len" in r \
                and r.get("every", 1) == 1:                           # the policy as the study runs it: every step
            out[(str(r["policy"]), int(r["cache_len"]))] = float(r["tok_s"])
    return out


def add_speed(table, speed: dict) -> "object":
    """``table`` with ``tok_s_b8``: the bench's tok/s at batch 8 for the row's family at its context (the bench
    runs each family at ITS budget, context / 4, not the row's), NaN where the bench has no such row."""
    t = table.copy()
    t["tok_s_b8"] = [speed.get((BENCH_NAMES.get(f, ""), int(c)), float("nan")) for f, c in zip(t.family, t.context)]
    return t


def _draw(tables, context: int):
    df = tables["evict_long"]
    g = df[df.context == context]
    if g.empty:                 # the table has no such context: no figure (not an empty one)
        return None
    fig = new_figure(figsize=(9, 6))
    ax = fig.subplots()
    speed = "tok_s_b8" in g and g.tok_s_b8.notna().any()
    x = g.tok_s_b8 if speed else g.mean_len
    full = g[g.policy == "full"]
    size = g.kv_mb16.to_numpy(dtype=float)
    smax = float(np.nanmax(size)) if len(size) else 1.0
    for i, (_, r) in enumerate(g.iterrows()):
        if r.policy == "full" or not (x.loc[r.name] == x.loc[r.name]):
            continue
        c = f"C{i % 10}"
        y, lo, hi = r.kl_forced, r.kl_forced_lo, r.kl_forced_hi
        yerr = [[y - lo], [hi - y]] if lo == lo and hi == hi else None
        ax.errorbar(x.loc[r.name], y, yerr=yerr, fmt="none", ecolor=c, lw=1.0, capsize=3)
        ax.scatter(x.loc[r.name], y, s=30 + 400 * r.kv_mb16 / smax, color=c, alpha=0.7, edgecolor="k",
                   marker="o" if r.budget == 256 else "s", zorder=3)
        ax.annotate(r.policy, (x.loc[r.name], y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_ylabel("KL(full ‖ policy), nats per token (mean over prompts, 95 % interval)")
    n = int(g.n_prompts.max())
    if speed:
        ax.set_xlabel("tok/s at batch 8 (bench evict: each family at the bench's budget = context / 4)")
        if len(full) and full.tok_s_b8.notna().any():
            ax.axvline(float(full.tok_s_b8.iloc[0]), color="k", ls=":", lw=0.8, label="full cache tok/s")
            ax.legend(fontsize=7)
    else:
        ax.set_xlabel("mean live entries (tok/s at batch 8 not measured: no " + BENCH_FILE + ")")
    ax.grid(linestyle=":", linewidth=0.6)
    full_mb = float(full.kv_mb16.iloc[0]) if len(full) else math.nan
    ax.set_title(f"Eviction at a {context}-token real-text context (n = {n} prompts): quality × speed × memory\n"
                 f"marker area ∝ resident K/V bytes at 16 bits (full cache {full_mb:.0f} MiB); ○ budget 256, "
                 "□ budget 512", fontsize=9)
    fig.tight_layout()
    return fig


for _c in FIG_CONTEXTS:
    figure(f"evict_long_{_c}", needs=("evict_long",))(lambda tables, _c=_c: _draw(tables, _c))


def render_long(out) -> list[Path]:
    """Draw every ``evict_long_<context>`` figure whose context ``out/evict_long.csv`` holds."""
    import pandas as pd

    from kvlab.harness.figures import render

    t = pd.read_csv(Path(out) / "evict_long.csv")
    return [p for c in FIG_CONTEXTS if (t.context == c).any() and (p := render(f"evict_long_{c}", out)) is not None]
