"""Counting the intervals a quoted README section holds and flagging the fragile ones (issue 37)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.harness.intervals import (QuotedInterval, audit_intervals, audit_section, interval_summary,
                                     section)

PAGE = """# Title

## Key results

Some words [1, 2] outside a table are not counted.

| what | result | table |
|---|---|---|
| a − b | Δ +0.225 [+0.190, +0.260] (MDE 0.05), n = 32 | `t` |
| c − b | Δ -0.031 [-0.057, -0.004] (MDE 0.04) | `t` |
| d − b | Δ +0.014 [0.000, +0.031] | `t` |
| mc | U +0.10 [−0.02, +0.20], MI +0.46 [+0.30, +0.60] (MDE 0.50) | `t` |

### A subsection stays in

| e − b | Δ +0.069 [-0.056, +0.169] (MDE 0.17) | `t` |

## Next section

| f − b | Δ +1 [+0.001, +2] (MDE 1) | `t` |
"""


def test_counts_every_interval_of_the_section_and_pairs_each_with_its_own_mde():
    got = audit_intervals(section(PAGE, "Key results"))
    assert [(q.row, q.lo, q.hi, q.mde) for q in got] == [
        ("a − b", 0.19, 0.26, 0.05), ("c − b", -0.057, -0.004, 0.04), ("d − b", 0.0, 0.031, None),
        ("mc", -0.02, 0.2, None), ("mc", 0.3, 0.6, 0.5), ("e − b", -0.056, 0.169, 0.17)]


def test_fragile_means_an_endpoint_within_a_tenth_of_the_mde_of_zero():
    got = {(q.row, q.lo): q for q in audit_intervals(section(PAGE, "Key results"))}
    assert got["c − b", -0.057].fragile is True             # |−0.004| <= 0.004
    assert got["a − b", 0.19].fragile is False
    assert got["e − b", -0.056].fragile is False              # crosses 0, but both ends far from it
    assert got["d − b", 0.0].fragile is None                   # no MDE quoted: not judged
    assert QuotedInterval("x", 0.0051, 0.2, 0.05).fragile is False
    assert QuotedInterval("x", -0.3, -0.005, 0.05).fragile is True
    assert not got["d − b", 0.0].excludes_zero and got["c − b", -0.057].excludes_zero


def test_summary_says_the_count_and_names_the_fragile_ones():
    text = interval_summary(audit_intervals(section(PAGE, "Key results")))
    assert text.startswith("6 unadjusted 95 % intervals, 3 of them excluding 0; 1 fragile")
    assert "c − b [-0.057, -0.004] (MDE 0.04)" in text and "2 quoted without an MDE" in text


def test_missing_heading_names_the_headings_there_are():
    with pytest.raises(ValueError, match="heading='Results' is not a heading.*Key results"):
        section(PAGE, "Results")


def test_the_readme_key_results_parse():
    """The real README: every interval of its key-results table is read (endpoints ordered)."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    got = audit_section(readme)
    assert len(got) >= 10 and all(q.lo <= q.hi for q in got)
    assert got[0].mde is not None


def test_needle_key_result_lists_every_policy_of_the_grid(tmp_path):
    import pandas as pd

    from kvlab.studies.eviction.quotes import key_results

    root = Path(__file__).resolve().parents[1] / "figures"
    for name in ("evict_matched", "evict_needle"):
        pd.read_csv(root / f"{name}.csv").to_csv(tmp_path / f"{name}.csv", index=False)
    rows = [r for r in key_results(tmp_path) if r[0].startswith("Passkey")]
    policies = set(pd.read_csv(root / "evict_needle.csv").policy)
    assert rows and all(f"{p} " in r[1] for r in rows for p in policies)
    assert "snapkv" in policies and rows[0][1].startswith("full 1.00, confkv")


def test_refresh_views_show_the_forced_path_costs_when_the_table_has_them(tmp_path):
    import pandas as pd

    from kvlab.studies.refresh.quotes import VIEWS

    df = pd.read_csv(Path(__file__).resolve().parents[1] / "figures" / "refresh_methods.csv")
    df.drop(columns=[c for c in ("refreshes_forced", "teacher_tokens_forced") if c in df]).to_csv(
        tmp_path / "refresh_methods.csv", index=False)
    assert "forced path" not in VIEWS["refresh_methods"](tmp_path)
    df.assign(refreshes_forced=2.5, teacher_tokens_forced=40.0).to_csv(tmp_path / "refresh_methods.csv", index=False)
    head = VIEWS["refresh_methods"](tmp_path).splitlines()[0]
    assert "| refreshes (forced path) | teacher tokens (forced path) | teacher-forced KL ↓ |" in head
