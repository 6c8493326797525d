"""Readouts over N prompts × seeds: mean of the chosen configuration, mean of its baseline, and the
mean paired difference with a bootstrap 95 % interval over the (prompt, seed) pairs — the same
statistic as the tables (:func:`kvlab.harness.experiment.paired_bootstrap`), computed from stored runs and
refreshed as each pair finishes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvlab.playground.settings import Settings

# readouts averaged over pairs (every readout that is a number per run)
SPREAD_READOUTS = ("teacher_ppl", "kl", "repeat3", "refreshes", "teacher_tokens_pct", "teacher_time_pct", "cache_kib")


def pairs(s: Settings, prompts) -> list[Settings]:
    """The (prompt, seed) settings averaged for ``s``: its prompt first, then the next prompts of
    ``prompts`` (in list order, skipping its own), each with seeds ``seed .. seed + n_seeds - 1``.
    Every returned setting has ``n_prompts = n_seeds = 1`` (one run each)."""
    others = [p for p in prompts if p != s.prompt]
    chosen = [s.prompt] + others[: max(0, s.n_prompts - 1)]
    if len(chosen) < s.n_prompts:
        raise ValueError(f"n_prompts={s.n_prompts} but only {len(chosen)} distinct prompts are offered; "
                         f"lower n_prompts to {len(chosen)} or add prompts")
    return [replace(s, prompt=p, seed=s.seed + j, n_prompts=1, n_seeds=1) for p in chosen for j in range(s.n_seeds)]


@dataclass(frozen=True)
class Spread:
    """Readouts over the pairs finished so far (``done`` of ``total``)."""

    settings: Settings
    done: int
    total: int
    stats: dict        # readout -> {"mean", "base", "d", "lo", "hi", "n"} (lo/hi NaN below MIN_PAIRS pairs)

    @property
    def complete(self) -> bool:
        return self.done == self.total


def spread_stats(rows: list[tuple[dict, dict]], n_boot: int = 2000, seed: int = 0) -> dict:
    """``rows``: per finished pair, (readouts of the run, readouts of its baseline). Per readout:
    means, the mean paired difference and its bootstrap 95 % interval (NaN with fewer than
    :data:`kvlab.harness.experiment.MIN_PAIRS` pairs: the tables refuse such intervals too)."""
    import numpy as np
    import pandas as pd

    from kvlab.harness.experiment import MIN_PAIRS, paired_bootstrap

    out = {}
    for m in SPREAD_READOUTS:
        ok = [(r[m], b[m]) for r, b in rows if _finite(r.get(m)) and _finite(b.get(m))]
        if not ok:
            out[m] = {"mean": math.nan, "base": math.nan, "d": math.nan, "lo": math.nan, "hi": math.nan, "n": 0}
            continue
        a = np.array([x for x, _ in ok], dtype=float)
        b = np.array([y for _, y in ok], dtype=float)
        st = {"mean": float(a.mean()), "base": float(b.mean()), "d": float((a - b).mean()), "lo": math.nan,
              "hi": math.nan, "n": len(ok)}
        if len(ok) >= MIN_PAIRS:
            per_run = pd.DataFrame({"policy": ["run"] * len(ok) + ["base"] * len(ok),
                                    "prompt_idx": list(range(len(ok))) * 2, m: list(a) + list(b)})
            row = paired_bootstrap(per_run, "base", (m,), n_boot=n_boot, seed=seed).set_index("policy").loc["run"]
            st["lo"], st["hi"] = float(row[f"d_{m}_lo"]), float(row[f"d_{m}_hi"])
        out[m] = st
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
