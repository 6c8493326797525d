"""The long-context readings (notebook 05 section 6b, docs/eviction.md) follow the table: a pilot's n is named as
one, an interval that excludes 0 is called so, Conf-KV's time at the loose budget is checked against 30 %."""
from __future__ import annotations

import math

import pandas as pd

from kvlab.studies.eviction.long_readings import read_evict_long, read_needle_long

NAN = math.nan


def _table(n: int, lo: float, hi: float, at_loose: float) -> pd.DataFrame:
    rows = [dict(context=2048, policy="full", family="full", budget=NAN, n_prompts=n, kl_forced=0.0, partner="",
                 d_kl_partner=NAN, d_kl_partner_lo=NAN, d_kl_partner_hi=NAN, d_kl_partner_mde=NAN, gap_closed=NAN,
                 frac_at_loose=NAN)]
    for fam, kl in (("sliding", 0.06), ("h2o", 0.05), ("confkv_l", 0.04), ("confkv_l_fixed", 0.045)):
        partner = {"h2o": "confkv_l_b256", "confkv_l": "confkv_l_fixed_b256"}.get(fam, "")
        rows.append(dict(context=2048, policy=f"{fam}_b256", family=fam, budget=256.0, n_prompts=n, kl_forced=kl,
                         partner=partner, d_kl_partner=(0.01 if math.isnan(lo) else (lo + hi) / 2) if partner else NAN,
                         d_kl_partner_lo=lo if partner else NAN, d_kl_partner_hi=hi if partner else NAN,
                         d_kl_partner_mde=0.02 if partner else NAN, gap_closed=0.5 if fam == "confkv_l" else NAN,
                         frac_at_loose=at_loose if fam == "confkv_l" else NAN))
    return pd.DataFrame(rows)


def test_pilot_and_verdicts():
    text = read_evict_long(_table(3, NAN, NAN, 0.1))
    assert "3 prompts: a pilot" in text and "too few prompts for an interval" in text
    assert "confkv_l 0.040, confkv_l_fixed 0.045, h2o 0.050, sliding 0.060" in text     # lowest KL first
    assert "on 10 % of steps (misses the 30 %" in text

    text = read_evict_long(_table(32, 0.01, 0.03, 0.4))
    assert "pilot" not in text
    assert "worse (the interval excludes 0, n = 32)" in text and "meets the 30 %" in text
    text = read_evict_long(_table(32, -0.01, 0.03, 0.4))
    assert "no detectable difference at n = 32, MDE 0.020" in text
    assert "closes 50 % of the gap" in text


def test_needle_reading_names_full_cache_failures():
    t = pd.DataFrame([dict(setting="prefill", policy="full", length=2048, accuracy=0.5, n=4, ci_lo=0.15, ci_hi=0.85),
                      dict(setting="prefill", policy="h2o", length=2048, accuracy=0.25, n=4, ci_lo=0.05, ci_hi=0.7)])
    text = read_needle_long(t)
    assert "h2o 0.25 [0.05, 0.70] (n = 4)" in text and "full cache itself fails here" in text
    assert "No long-context retrieval runs yet" in read_needle_long(t.iloc[:0])


def test_needle_reading_says_which_policies_fall_below_the_full_cache():
    rows = [dict(setting="streamed", policy="full", length=2048, accuracy=1.0, n=60, ci_lo=0.94, ci_hi=1.0),
            dict(setting="streamed", policy="snapkv", length=2048, accuracy=0.97, n=60, ci_lo=0.89, ci_hi=0.99),
            dict(setting="streamed", policy="h2o", length=2048, accuracy=0.05, n=60, ci_lo=0.02, ci_hi=0.14)]
    text = read_needle_long(pd.DataFrame(rows))
    assert "Below the full cache (Wilson intervals apart): h2o; not apart from it at n = 60: snapkv." in text
    assert "apart" not in read_needle_long(pd.DataFrame(rows).assign(n=1))      # a pilot: no verdict


def test_readme_long_rows_hold_every_context_with_an_interval(tmp_path):
    """The README's long-context key results: one row for each policy − sliding and one for the paired claims, each
    cell holding every context with n >= 2 in turn (another context adds no README line); a context with one prompt
    (a pilot) is left out, and none left gives no row."""
    from kvlab.harness.quotes import FIGURES
    from kvlab.studies.eviction.quotes import _long_rows

    t = pd.read_csv(FIGURES / "evict_long.csv")
    three = t.copy()
    three.loc[three.context.isin([2048, 4096, 8192]), "n_prompts"] = 32
    three.to_csv(tmp_path / "evict_long.csv", index=False)
    assert _long_rows(tmp_path)[0][0].startswith("Eviction at 2,048, 4,096 and 8,192 tokens, 512 entries (n = 32 per")
    two = t[t.context.isin([2048, 4096])].copy()
    two.loc[two.context == 4096, "n_prompts"] = 32
    two.loc[two.context == 2048, "n_prompts"] = 32
    two.to_csv(tmp_path / "evict_long.csv", index=False)
    rows = _long_rows(tmp_path)
    assert [r[2] for r in rows] == ["evict_long", "evict_long"]
    assert all(r[0].startswith("Eviction at 2,048 and 4,096 tokens, 512 entries (n = 32 per context)") for r in rows)
    for _, text, _ in rows:
        assert text.index("**2,048 tokens:**") < text.index("**4,096 tokens:**")
    assert "scissorhands: Δ" in rows[0][1] and "pyramidkv − snapkv: Δ" in rows[1][1]
    assert "loose budget on" in rows[1][1].split("**4,096 tokens:**")[1]
    two.loc[two.context == 4096, "n_prompts"] = 20                 # contexts at different n: both named
    two.to_csv(tmp_path / "evict_long.csv", index=False)
    assert _long_rows(tmp_path)[0][0].startswith("Eviction at 2,048 and 4,096 tokens, 512 entries (n = 20/32 per")
    pilot = two.copy()
    pilot.loc[pilot.context == 4096, "n_prompts"] = 1
    pilot.to_csv(tmp_path / "evict_long.csv", index=False)
    rows = _long_rows(tmp_path)
    assert rows[0][0].startswith("Eviction at 2,048 tokens, 512 entries") and "4,096" not in rows[0][1]
    pilot.assign(n_prompts=1).to_csv(tmp_path / "evict_long.csv", index=False)
    assert _long_rows(tmp_path) == []
