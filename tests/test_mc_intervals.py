"""MC-dropout correlations with bootstrap intervals over prompts (issue 37): the interval resamples whole prompts."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvlab.studies.mc.real import correlation_intervals, correlation_row, correlations


def _traces(n_prompts: int, steps: int = 30, noise: float = 1.0, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n_prompts):
        h = rng.random(steps) * 4
        rows.append(pd.DataFrame({"prompt": i, "entropy": h, "u": h + noise * rng.standard_normal(steps),
                                  "mi": rng.random(steps), "flip": -h + 0.1 * rng.standard_normal(steps)}))
    return pd.concat(rows, ignore_index=True)


def test_interval_brackets_the_pooled_r_and_reads_the_signal():
    df = _traces(16)
    r, ci = correlations(df), correlation_intervals(df)
    for s in ("u", "mi", "flip"):
        assert ci[f"r_{s}_lo"] <= r[s] <= ci[f"r_{s}_hi"]
    assert ci["r_u_lo"] > 0.5 and ci["r_flip_hi"] < -0.9          # strong signals: interval away from 0
    assert ci["r_mi_lo"] < 0 < ci["r_mi_hi"]                       # unrelated noise: interval covers 0


def test_interval_equals_a_naive_resample_of_prompts():
    """The sufficient-statistics bootstrap gives what pooling the resampled prompts' rows gives."""
    df = _traces(6, steps=10, seed=2)
    n, B = 6, 50
    counts = np.random.default_rng(0).multinomial(n, [1 / n] * n, size=B)
    naive = []
    for c in counts:
        pooled = pd.concat([df[df.prompt == i] for i in range(n) for _ in range(c[i])])
        naive.append(pooled["u"].corr(pooled["entropy"]))
    got = correlation_intervals(df, n_boot=B, seed=0)
    assert got["r_u_lo"] == pytest.approx(np.percentile(naive, 2.5), abs=1e-9)
    assert got["r_u_hi"] == pytest.approx(np.percentile(naive, 97.5), abs=1e-9)


def test_too_few_prompts_give_no_interval_and_the_row_holds_every_column():
    ci = correlation_intervals(_traces(4))
    assert all(np.isnan(v) for v in ci.values())
    row = correlation_row(_traces(16), p=0.1, n_passes=8, prompts=16)
    assert list(row)[:7] == ["p", "n_passes", "steps", "prompts", "r_u", "r_u_lo", "r_u_hi"]
    assert row["steps"] == 16 * 30 and {"r_flip_hi", "mean_mi"} <= set(row)


def test_quotes_show_the_intervals_when_the_table_has_them(tmp_path):
    from kvlab.studies.mc.quotes import key_results, mc_real_view

    rows = [correlation_row(_traces(16, seed=s), p=p, n_passes=8, prompts=16) for s, p in ((0, 0.05), (1, 0.1))]
    pd.DataFrame(rows).to_csv(tmp_path / "mc_real_correlations.csv", index=False)
    what, text, _ = key_results(tmp_path)[0]
    assert "16 prompts, 95 % interval" in what and text.count("[") == 3
    assert "bootstrap 95 % interval over prompts" in mc_real_view(tmp_path)
    old = pd.DataFrame(rows).drop(columns=[c for c in rows[0] if c.endswith(("_lo", "_hi"))])
    old.to_csv(tmp_path / "mc_real_correlations.csv", index=False)        # a table from before: no intervals
    assert "[" not in key_results(tmp_path)[0][1] and "interval" not in mc_real_view(tmp_path)
