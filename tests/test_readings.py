"""The "how to read this" texts are computed from the table they sit under, and the table views format
numbers for reading (plain Python; one test builds a real baselines table on the tiny pair)."""
from __future__ import annotations

import re

import pandas as pd
import pytest

from kvlab.viz import readings as R
from kvlab.harness.tableview import fmt, plural, show


def _baselines(ppl, n=8, std=0.3):
    return pd.DataFrame([{"policy": p, "teacher_ppl": v, "kl": k, "repeat3": r, "teacher_ppl_std": std if n > 1 else 0.0,
                          "kl_std": 0.1, "repeat3_std": 0.1, "n_prompts": n}
                         for p, v, k, r in zip(("teacher", "overfill", "student"), ppl, (0.0, 0.5, 0.6), (0.1, 0.5, 0.2))])


def test_fmt_and_plural():
    assert fmt(-0.0004) == "0.000" and fmt(-0.0004, signed=True) == "0.000" and fmt(0.0) == "0.000"
    assert fmt(-0.0126) == "-0.013" and fmt(0.0126, signed=True) == "+0.013" and fmt(float("nan")) == "–"
    assert fmt(7) == "7" and fmt(2.5, 1) == "2.5"
    assert plural(1, "prompt") == "1 prompt" and plural(2, "prompt") == "2 prompts" and plural(0, "entry", "entries") == "0 entries"


def test_show_hides_std_and_intervals_when_one_prompt_and_keeps_the_full_frame():
    t = pd.DataFrame([{"policy": "a", "ppl": 2.0, "ppl_std": 0.5, "d": -0.00001, "d_lo": -0.2, "d_hi": 0.1, "n_prompts": 3,
                       "secret_column": 1}])
    cols = {"policy": "policy", "teacher-PPL ↓": ("ppl", "ppl_std"), "Δ (95 % CI)": ("d", "d_lo", "d_hi"),
            "std": "ppl_std", "missing": "not_there"}
    v = show(t, cols)
    assert list(v.frame.columns) == ["policy", "teacher-PPL ↓", "Δ (95 % CI)", "std"]
    assert v.frame.iloc[0].tolist() == ["a", "2.000 ± 0.500", "0.000 [-0.200, +0.100]", "0.500"]
    assert v.full is t and "secret_column" in v.full
    one = show(t.assign(n_prompts=1), cols)
    assert list(one.frame.columns) == ["policy", "teacher-PPL ↓", "Δ (95 % CI)"]       # std column hidden at n = 1
    assert one.frame.iloc[0].tolist() == ["a", "2.000", "0.000"]                        # no ± and no interval
    assert "<table" in v._repr_html_() and "teacher-PPL ↓" in v.to_markdown()


@pytest.mark.parametrize("ppl, verdict", [((2.9, 4.7, 3.3), "contradicts"), ((1.64, 1.88, 2.35), "agrees")])
def test_baselines_reading_follows_the_numbers(ppl, verdict):
    text = R.read_baselines(_baselines(ppl))
    T, O, S = ppl
    assert f"({fmt(O, 2)} vs {fmt(S, 2)})" in text
    assert ("OverFill scores better" in text) == (O < S) and ("OverFill scores worse" in text) == (O > S)
    assert verdict in text and "1.64 < OverFill 1.88 < Student 2.35" in text
    assert "8 prompts" in text


def test_baselines_reading_says_when_the_gap_is_within_the_spread_and_when_there_is_one_prompt():
    assert "do not settle it" in R.read_baselines(_baselines((2.0, 3.1, 3.0), std=0.5))
    assert "do not settle it" not in R.read_baselines(_baselines((2.0, 4.0, 3.0), std=0.5))
    one = R.read_baselines(_baselines((2.0, 3.1, 3.0), n=1))
    assert "One prompt: there is no spread" in one and "1 prompts" not in one


def test_interval_verdict():
    assert "better" in R.interval_verdict(-0.1, -0.2, -0.01, False)
    assert "worse" in R.interval_verdict(0.1, 0.01, 0.2, False)
    assert "no measurable change" in R.interval_verdict(0.0, -0.1, 0.1, False)
    assert "one prompt" in R.interval_verdict(0.1, 0.1, 0.1, True)


def test_evict_reading_computes_the_gap_closed_and_the_ablation_order():
    rows = [("full", "reference", 2.0, 1.0), ("confkv", "target", 2.5, 1.0), ("sliding", "solved budget", 4.0, 1.0),
            ("h2o", "solved budget", 2.2, 1.0), ("confkv_recency", "Conf-KV schedule", 3.0, 1.3),
            ("random_rate", "Conf-KV eviction rate", 5.0, 1.0)]
    t = pd.DataFrame([{"policy": p, "matched_by": m, "teacher_ppl": v, "mem_vs_target": mem, "mean_mb": 1.0 if p != "full" else 4.0,
                       "d_teacher_ppl_vs_full": v - 2.0, "d_teacher_ppl_vs_full_lo": v - 2.2, "d_teacher_ppl_vs_full_hi": v - 1.8,
                       "n_prompts": 4} for p, m, v, mem in rows])
    text = R.read_evict_matched(t)
    assert "closes 75 % of the sliding-window" in text          # (4.0 - 2.5) / (4.0 - 2.0)
    assert "beats 1 of 2 (sliding)" in text and "keeps 25 %" in text
    assert "random_rate 5.00 > confkv_recency 3.00 > confkv 2.50" in text and "the same order" in text
    assert "confkv_recency (×1.30)" in text and "intervals are rough or not given" in text


def test_needle_reading_blames_the_model_when_the_full_cache_misses():
    t = pd.DataFrame([{"policy": p, "length": 128, "depth": d, "accuracy": a, "n": 1}
                      for p, d, a in [("full", 0.0, 1.0), ("full", 1.0, 0.0), ("h2o", 0.0, 0.0), ("h2o", 1.0, 1.0)]])
    text = R.read_needle(t)
    assert "retrieves only 0.50" in text and "h2o never do: they evicted it" in text and "2 cases" in text
    full_misses_old = t.assign(accuracy=[0.0, 1.0, 0.0, 1.0])
    assert "evicted it" not in R.read_needle(full_misses_old)      # the full cache misses there too: not blamed


def test_baselines_reading_matches_a_real_table(tiny_teacher, tiny_student, tmp_path):
    """Build the baselines table on the tiny pair (seconds); every number the reading quotes is the table's."""
    from kvlab.studies.baselines.table import baselines
    from kvlab.harness.experiment import RunSpec
    from kvlab.store import RunStore

    table, _ = baselines(tiny_teacher, tiny_student, RunSpec(prompts=("abc", "hello there"), tokens=4),
                         RunStore(tmp_path), progress=False)
    text = R.read_baselines(table)
    r = table.set_index("policy")
    O, S = r.loc["overfill", "teacher_ppl"], r.loc["student", "teacher_ppl"]
    assert f"({fmt(O, 2)} vs {fmt(S, 2)})" in text
    assert ("scores better" in text) == (O < S)
    order = re.search(r"Here, by teacher-PPL: (.*?)\. \*\*OverFill", text).group(1)
    assert order == " < ".join(f"{p} {fmt(r.loc[p, 'teacher_ppl'], 2)}" for p in r["teacher_ppl"].sort_values().index)
    assert "2 prompts" in text


def test_tick_reading_counts_positions_from_the_cache():
    frame = pd.DataFrame({"row": range(8), "position": range(8), "origin": ["written"] * 6 + ["insert", "add"]})
    before, after = [0, 1, 2, 3, 4, 5], [0, 1, 3, 6, 4, 5, 7]
    text = R.read_tick(frame, before, after, [0, 1, 3, 6, 4, 5, 7])
    assert "retired 1 row and wrote 2 rows (1 by `insert`, 1 by `add`)" in text and "0 changed position" in text
    assert "gaps where rows were deleted" in text
    assert "2 changed position (re-rotated)" in R.read_tick(frame, before, after, [0, 1, 2, 6, 3, 5, 7])


def test_phase_reading_finds_the_drift_in_the_blogs_simulation():
    from kvlab.studies.mc import sim as mcsim

    ps = mcsim.simulate().phase_summary
    text = R.read_phase_summary(ps)
    assert f"MC variance is highest in {ps.mean_mcvar.idxmax()}" in text and ps.mean_mcvar.idxmax() == "drift"


def test_markdown_tables_print_no_negative_zero():
    from kvlab.harness.experiment import to_markdown

    md = to_markdown(pd.DataFrame({"d": [-0.0001, -1.5, 10.0]}))
    assert "-0.000" not in md and "| 0.000 |" in md and "| -1.500 |" in md and "| 10.000 |" in md


def test_a_refused_interval_reads_as_too_few_prompts():
    assert "too few prompts for an interval" in R.interval_verdict(0.1, float("nan"), float("nan"), False)
    t = pd.DataFrame([{"policy": "a", "d": 0.1, "d_lo": float("nan"), "d_hi": float("nan"), "n_prompts": 3}])
    assert show(t, {"Δ": ("d", "d_lo", "d_hi")}).frame.iloc[0, 0] == "+0.100"


def test_confidence_reading_sees_conf_kv_signals(tiny_teacher):
    from kvlab.decode import DecodeConfig, Decoding
    from kvlab.eviction import ConfKV

    d = Decoding(tiny_teacher, None, "a prompt long enough to evict from", DecodeConfig(
        mode="teacher", max_new_tokens=6, evict=ConfKV(gamma=0.0, tight=20, loose=30, protect=4)))
    text = R.read_confidence(list(d), 0.0)
    assert "6 of 6 steps were confident" in text and "cut at 6 steps" in text


# --------------------------------------------------------------------------- both baselines, kl_forced, power

def _baselines4(d_student=(0.2, 0.1, 0.3), d_alone=(0.02, -0.1, 0.14), n=8):
    rows = _baselines((2.0, 3.0, 3.5), n=n).to_dict("records") + [
        {"policy": "standalone", "teacher_ppl": 2.9, "kl": 0.6, "repeat3": 0.6, "teacher_ppl_std": 0.3, "kl_std": 0.1,
         "repeat3_std": 0.1, "n_prompts": n}]
    t = pd.DataFrame(rows)
    t["d_kl_forced"], t["d_kl_forced_lo"], t["d_kl_forced_hi"], t["d_kl_forced_mde"] = float("nan"), float("nan"), float("nan"), float("nan")
    for p, (d, lo, hi) in (("student", d_student), ("standalone", d_alone)):
        t.loc[t.policy == p, ["d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi", "d_kl_forced_mde"]] = [d, lo, hi, 0.25]
    return t


def test_baselines_reading_names_both_baselines_and_reads_kl_forced_with_power():
    text = R.read_baselines(_baselines4())
    assert "`student` is the OverFill decoder itself" in text and "equal-budget baseline" in text
    assert "student (the blog's baseline) − OverFill: +0.200 [+0.100, +0.300]: OverFill better" in text  # Δ > 0
    assert "standalone (the paper's) − OverFill: +0.020 [-0.100, +0.140]: no detectable difference at n = 8 (MDE 0.250)" in text
    assert "looping decoder" in text and "copying" in text
    assert "no such student" in R.read_baselines(_baselines((2.0, 3.0, 3.5)))


def test_interval_verdict_states_the_detectable_difference():
    assert R.interval_verdict(0.01, -0.1, 0.12, False, mde=0.3, n=32).endswith("no detectable difference at n = 32 (MDE 0.300)")
    assert "no measurable change" in R.interval_verdict(0.01, -0.1, 0.12, False)
    assert "no detectable" not in R.interval_verdict(-0.2, -0.3, -0.1, False, mde=0.1, n=32)


def test_regimes_reading_quotes_each_row():
    t = pd.DataFrame([{"regime": "long prompts, short answers (long)", "baseline": "student", "n_prompts": 8,
                       "d_kl_forced": 0.1, "d_kl_forced_lo": 0.05, "d_kl_forced_hi": 0.2, "d_kl_forced_mde": 0.1,
                       "d_teacher_ppl": 1.0, "d_teacher_ppl_lo": -1.0, "d_teacher_ppl_hi": 3.0}])
    text = R.read_regimes(t)
    assert "long prompts, short answers (long), student: Δkl_forced +0.100 [+0.050, +0.200]: OverFill better" in text
    assert "Δteacher-PPL +1.000 [-1.000, +3.000]: no measurable change" in text      # no MDE column for PPL


def test_forced_reading_states_the_detectable_difference():
    t = pd.DataFrame([{"condition": c, "kl": 1.0, "d_kl_vs_overfill": d, "d_lo": lo, "d_hi": hi, "d_mde": m, "n_prompts": 8}
                      for c, d, lo, hi, m in (("student", 0.17, 0.1, 0.24, 0.1), ("overfill", 0.0, 0.0, 0.0, float("nan")),
                                               ("refreshed", 0.015, -0.03, 0.06, 0.07))])
    text = R.read_forced(t)
    assert "a teacher re-prefill of the generated text: ΔKL +0.015 [-0.030, +0.060]: no detectable difference at n = 8 (MDE 0.070)" in text


def test_refresh_readings_quote_kl_forced_with_power():
    rows = [{"policy": "none", "T": float("nan"), "tau_bits": float("nan"), "d_kl_forced": 0.0}] + [
        {"policy": f"periodic_T{T}", "T": T, "d_kl_forced": d, "d_kl_forced_lo": lo, "d_kl_forced_hi": hi,
         "d_kl_forced_mde": 0.05} for T, d, lo, hi in ((27, -0.01, -0.04, 0.02), (7, -0.08, -0.12, -0.04))]
    t = pd.DataFrame(rows).assign(teacher_ppl=[3.0, 3.1, 3.2], kl=1.0, d_kl=[0.0, 0.01, -0.02], d_kl_lo=-0.1,
                                  d_kl_hi=0.1, teacher_tokens=[0, 5, 20], n_prompts=8)
    text = R.read_periodic(t)
    assert "T=27: -0.010 [-0.040, +0.020]: no detectable difference at n = 8 (MDE 0.050)" in text
    assert "T=7: -0.080 [-0.120, -0.040]: better" in text
    m = R.read_methods(t)
    assert "Δkl_forced vs no refresh: periodic_T27: -0.010" in m
