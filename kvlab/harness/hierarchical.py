"""A hierarchical bootstrap of paired differences over training seeds and prompts (issue 37, item 5).
Pure numbers: it reads arrays and data frames and touches nothing.

A comparison of two trained decoders on one prompt set has two sources of randomness: the prompts, and the
training run that made each decoder (LoRA init, batch order, refresh points; kvlab.train.config.TrainConfig.seed).
The prompt bootstrap of :func:`kvlab.harness.experiment.paired_bootstrap` covers the first only. Here the input is a
matrix of paired differences ``d[s, p]`` (training seed ``s``, prompt ``p``), and each bootstrap replicate

1. draws ``S`` seeds with replacement, then
2. draws ``P`` prompts with replacement, and averages ``d`` over the drawn (seed, prompt) cells.

``design`` says how step 2 draws. ``"crossed"`` (the default): one prompt draw shared by every drawn seed, because
every seed ran the *same* prompts (kvlab.studies.training.seeds), so a prompt's difficulty is common to all seeds
and must not be averaged away by drawing it independently per seed. ``"nested"``: an independent prompt draw
within each drawn seed, for designs where each seed has its own prompts; on a crossed design it understates the
prompt part of the variance by about the number of seeds (tests/test_train_seeds.py shows it).

Either way the result is the mean difference, the 2.5 / 97.5 % percentiles of the replicates' means, their
standard deviation (the standard error) and ``mde`` = 2.8 × that SE (the smallest difference detectable with 80 %
power at α = 0.05, as :data:`kvlab.core.metrics.MDE_NOTE` defines it for the prompt bootstrap). Deterministic
for a given ``seed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MDE_FACTOR = 2.8                 # as kvlab.core.metrics: z_{0.975} + z_{0.8}
DESIGNS = ("crossed", "nested")


@dataclass(frozen=True)
class HierarchicalCI:
    """The mean paired difference over seeds × prompts and its hierarchical bootstrap interval."""

    d: float
    lo: float
    hi: float
    se: float                    # SD of the bootstrap replicates' means
    mde: float                   # MDE_FACTOR × se
    n_seeds: int
    n_prompts: int
    sd_seeds: float              # SD (ddof 1) of the per-seed mean differences: how much the training run moves d
    n_boot: int
    design: str

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _matrix(diffs, min_seeds: int) -> np.ndarray:
    """``diffs`` as a (seeds, prompts) float array, checked (ValueError naming ``diffs``)."""
    if isinstance(diffs, np.ndarray):
        rows = list(diffs) if diffs.ndim == 2 else None
        if rows is None:
            raise ValueError(f"diffs must be 2-D (seeds × prompts), got an array of shape {diffs.shape}")
    else:
        rows = [np.asarray(r, dtype=float).ravel() for r in diffs]
    lens = sorted({len(r) for r in rows})
    if len(rows) < min_seeds:
        raise ValueError(f"diffs has {len(rows)} training seed(s); the hierarchical bootstrap needs at least "
                         f"{min_seeds} to say anything about training randomness (train more seeds, or use "
                         "kvlab.harness.experiment.paired_bootstrap for one seed)")
    if len(lens) > 1:
        raise ValueError(f"diffs is ragged: its seeds have {lens} prompts; every seed must score the same prompts "
                         "(drop the prompts a seed lacks first)")
    if not lens or lens[0] < 2:
        raise ValueError(f"diffs needs at least 2 prompts per seed, got {lens[0] if lens else 0}")
    m = np.asarray(rows, dtype=float)
    if not np.isfinite(m).all():
        bad = np.argwhere(~np.isfinite(m))[0]
        raise ValueError(f"diffs[{bad[0]}][{bad[1]}] is {m[tuple(bad)]}: every (seed, prompt) difference must be a "
                         "finite number")
    return m


def hierarchical_bootstrap(diffs, n_boot: int = 2000, seed: int = 0, design: str = "crossed",
                           min_seeds: int = 2) -> HierarchicalCI:
    """The mean of ``diffs`` (rows: training seeds, columns: the same prompts in the same order) and its 95 %
    interval from ``n_boot`` replicates that draw seeds, then prompts, with replacement (``design``: see the module
    docstring). ``min_seeds``: fewer rows than this is an error (1 lets a single seed through: then the interval is
    the prompt bootstrap's)."""
    if design not in DESIGNS:
        raise ValueError(f"design={design!r} must be one of {', '.join(DESIGNS)}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 100:
        raise ValueError(f"n_boot={n_boot!r} must be an integer ≥ 100")
    m = _matrix(diffs, min_seeds)
    S, P = m.shape
    rng = np.random.default_rng(seed)
    s_idx = rng.integers(0, S, size=(n_boot, S))
    means = np.empty(n_boot)
    chunk = max(1, 2_000_000 // (S * P))         # bounded memory for large S × P
    for a in range(0, n_boot, chunk):
        b = min(n_boot, a + chunk)
        if design == "crossed":
            p_idx = rng.integers(0, P, size=(b - a, 1, P))
        else:
            p_idx = rng.integers(0, P, size=(b - a, S, P))
        means[a:b] = m[s_idx[a:b, :, None], p_idx].mean(axis=(1, 2))
    lo, hi = np.percentile(means, [2.5, 97.5])
    se = float(means.std(ddof=1))
    per_seed = m.mean(axis=1)
    return HierarchicalCI(d=float(m.mean()), lo=float(lo), hi=float(hi), se=se, mde=MDE_FACTOR * se, n_seeds=S,
                          n_prompts=P, sd_seeds=float(per_seed.std(ddof=1)) if S > 1 else 0.0, n_boot=n_boot,
                          design=design)


def paired_matrix(per_run, name: str, base: str, metric: str, seed_col: str = "train_seed") -> tuple[list, np.ndarray]:
    """``(seeds, d)``: ``d[s, p]`` = ``metric`` of policy ``name`` − that of ``base`` on prompt ``p`` with
    training seed ``seeds[s]``, from per-run rows (columns ``policy``, ``prompt_idx``, ``seed_col``, ``metric``).
    A seed that lacks a prompt the others have is an error naming it (never a silent drop)."""
    for col in ("policy", "prompt_idx", seed_col, metric):
        if col not in per_run:
            raise ValueError(f"per_run has no column {col!r} (columns: {', '.join(map(str, per_run.columns))})")
    seeds = sorted(per_run[seed_col].unique().tolist())
    prompts = sorted(per_run.prompt_idx.unique().tolist())
    rows = []
    for s in seeds:
        g = per_run[per_run[seed_col] == s]
        a = g[g.policy == name].set_index("prompt_idx")[metric]
        b = g[g.policy == base].set_index("prompt_idx")[metric]
        missing = sorted(set(prompts) - (set(a.index) & set(b.index)))
        if missing:
            raise ValueError(f"{seed_col}={s}: no {name!r} / {base!r} run for prompt(s) {missing}; every seed must "
                             "score the same prompts")
        rows.append((a.loc[prompts] - b.loc[prompts]).to_numpy(dtype=float))
    return seeds, np.asarray(rows)


def prompt_only(diffs, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The prompt-only 95 % interval of the same mean: prompts resampled, the seeds held fixed (the interval a
    one-model-against-one-model table would print for the seed-averaged differences)."""
    m = _matrix(diffs, 1)
    per_prompt = m.mean(axis=0)
    rng = np.random.default_rng(seed)
    boots = per_prompt[rng.integers(0, len(per_prompt), size=(n_boot, len(per_prompt)))].mean(axis=1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return float(lo), float(hi)


__all__ = ["HierarchicalCI", "hierarchical_bootstrap", "paired_matrix", "prompt_only", "DESIGNS", "MDE_FACTOR"]
