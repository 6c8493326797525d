"""kvlab.studies.refresh.long (python -m kvlab refresh-long): the blog's long-generation refresh regime."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import kvlab.studies.refresh.long as L


# --------------------------------------------------------------------------- per-sequence metrics on known sequences


def test_repeat3_on_known_sequences():
    assert L.repeat3([1, 2, 3, 4, 5]) == 0.0                       # 3 distinct 3-grams
    # 1 2 3 1 2 3: 3-grams (1,2,3) (2,3,1) (3,1,2) (1,2,3) -> 3 unique of 4
    assert L.repeat3([1, 2, 3, 1, 2, 3]) == pytest.approx(0.25)
    assert L.repeat3([7] * 10) == pytest.approx(1 - 1 / 8)         # one unique 3-gram of 8
    assert L.repeat3([1, 2]) == 0.0                                # no 3-gram


def test_distinct2_on_known_sequences():
    assert L.distinct2([1, 2, 3, 4]) == 1.0
    assert L.distinct2([1, 2, 1, 2, 1]) == pytest.approx(2 / 4)    # (1,2) (2,1) (1,2) (2,1)
    assert math.isnan(L.distinct2([5]))


def test_tail_logprob_is_the_mean_of_the_last_50():
    lp = [-10.0] * 100 + [-1.0] * 50
    assert L.tail_logprob(lp) == pytest.approx(-1.0)
    assert L.tail_logprob([-1.0, -3.0]) == pytest.approx(-2.0)     # shorter than the tail: all of it
    assert L.tail_logprob(list(range(-60, 0)), tail=10) == pytest.approx(np.mean(range(-10, 0)))
    with pytest.raises(ValueError, match="empty"):
        L.tail_logprob([])


# --------------------------------------------------------------------------- calibration and knobs


@pytest.mark.parametrize("per_1k", [2.5, 8.0])
def test_calibration_hits_its_target_rate_on_a_toy_trace(per_1k):
    from kvlab.refresh.base import tau_for_budget

    trace = np.random.default_rng(0).gamma(2.0, 1.0, size=40_000)       # a toy entropy trace (bits)
    tau = tau_for_budget(trace, per_1k)
    assert L.achieved_rate(trace, tau) == pytest.approx(per_1k, rel=0.1)
    cal = L.LongCalibration(tuple(trace), tuple(trace))
    assert cal.tau(per_1k) == tau
    # probe-KL sees one value per M tokens: its κ still fires ~per_1k times per 1,000 tokens
    assert L.achieved_rate(trace, cal.kappa(per_1k, M=8), probe_every=8) == pytest.approx(per_1k, rel=0.25)


def test_period_for_rate_spreads_the_refreshes():
    for N, r in ((512, 2.0), (512, 8.0), (1200, 2.0), (1200, 8.0)):
        T = L.period_for_rate(N, r)
        c = L.count_for_rate(N, r)
        assert (N - 1) // T == c and (N - 1) // (T - 1) > c or T == 1   # smallest T with exactly c refreshes
    assert L.period_for_rate(512, 2.0) == 256 and L.period_for_rate(1200, 8.0) == 110


def test_long_policies_names_and_knobs():
    trace = tuple(np.random.default_rng(1).gamma(2.0, 1.0, size=5000))
    cfgs, info = L.long_policies(512, L.LongCalibration(trace, trace))
    for name in ("no_refresh", "periodic_T64", "periodic_T128", "periodic_T256", "entropy_b2.5", "entropy_b8",
                 "speculative_k8", "probe_kl_M8"):
        assert name in cfgs, name
    assert cfgs["no_refresh"].refresh is None and cfgs["periodic_T64"].refresh.T == 64
    assert cfgs["speculative_k8"].refresh.k == 8 and cfgs["probe_kl_M8"].refresh.M == 8
    assert f"periodic_T{L.period_for_rate(512, 8.0)}" in cfgs                # the equal-cost stride at ~8 / 1k
    assert cfgs["entropy_b8"].refresh.tau_bits < cfgs["entropy_b2.5"].refresh.tau_bits
    assert list(info.policy) == list(cfgs)


# --------------------------------------------------------------------------- tables


def _per_run(n=8):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        base = {"tokens": 512, "teacher_ppl": 3 + rng.random(), "kl_forced": 0.5 + rng.random(), "nll_forced": 2.0,
                "tail_logprob": -1.0, "repeat3": 0.1, "distinct2": 0.9}
        rows.append({"policy": "no_refresh", "prompt_idx": i, "refreshes": 0, "teacher_tokens": 0, **base})
        rows.append({"policy": "periodic_T64", "prompt_idx": i, "refreshes": 7, "teacher_tokens": 448,
                     **{**base, "teacher_ppl": base["teacher_ppl"] - 0.5, "kl_forced": base["kl_forced"] - 0.1}})
        rows.append({"policy": "entropy_b8", "prompt_idx": i, "refreshes": 4 if i % 2 else 5, "teacher_tokens": 400,
                     **{**base, "teacher_ppl": base["teacher_ppl"] + (0.3 if i % 2 else -0.3)}})
    return pd.DataFrame(rows)


INFO = pd.DataFrame([{"policy": "no_refresh", "family": "none", "knob": "", "target_per_1k": float("nan")},
                     {"policy": "periodic_T64", "family": "periodic", "knob": "T=64", "target_per_1k": 13.7},
                     {"policy": "entropy_b8", "family": "entropy", "knob": "tau=3 bits", "target_per_1k": 8.0}])


def test_long_table_has_the_named_columns_and_paired_intervals():
    t = L.long_table(_per_run(), INFO).set_index("policy")
    for c in ("tokens", "refreshes_per_1k", "teacher_tokens_forced", "teacher_ppl", "d_teacher_ppl_lo",
              "d_teacher_ppl_hi", "kl_forced", "d_kl_forced_lo", "d_kl_forced_hi", "nll_forced", "tail_logprob",
              "repeat3", "distinct2", "latency_overhead", "n_prompts"):
        assert c in t.columns, c
    assert (t.n_prompts == 8).all() and (t.tokens == 512).all()
    # a constant paired difference: the interval collapses onto it; the reference's own difference is 0
    assert t.loc["periodic_T64", "d_teacher_ppl"] == pytest.approx(-0.5)
    assert t.loc["periodic_T64", "d_teacher_ppl_lo"] == pytest.approx(-0.5)
    assert t.loc["periodic_T64", "d_kl_forced_hi"] == pytest.approx(-0.1)
    assert t.loc["no_refresh", ["d_teacher_ppl", "d_kl_forced_lo", "d_kl_forced_hi"]].abs().max() == 0
    # ±0.3 half the time: a mean-zero difference whose interval straddles 0
    assert t.loc["entropy_b8", "d_teacher_ppl_lo"] < 0 < t.loc["entropy_b8", "d_teacher_ppl_hi"]
    assert t.loc["periodic_T64", "refreshes_per_1k"] == pytest.approx(1000 * 7 / 512)
    assert t.loc["periodic_T64", "teacher_tokens_per_token"] == pytest.approx(448 / 512)
    assert math.isnan(t.loc["periodic_T64", "latency_overhead"])          # no timing given
    assert t.teacher_tokens_forced.isna().all()       # the forced path did not report its teacher tokens


def test_long_table_reads_forced_teacher_tokens_and_overhead_when_given():
    pr = _per_run().assign(teacher_tokens_forced=lambda d: d.teacher_tokens + 1)
    over = pd.DataFrame({"policy": ["no_refresh", "periodic_T64", "entropy_b8"], "overhead_pct": [0.1, 4.0, 2.0]})
    t = L.long_table(pr, INFO, over).set_index("policy")
    assert t.loc["periodic_T64", "teacher_tokens_forced"] == 449 and t.loc["periodic_T64", "latency_overhead"] == 4.0


def test_long_table_needs_the_reference():
    with pytest.raises(ValueError, match="no_refresh"):
        L.long_table(_per_run().query("policy != 'no_refresh'"), INFO)


def test_equal_cost_table_picks_each_family_nearest_the_tier():
    t = L.long_table(_per_run(), INFO)
    e = L.equal_cost_table(t, INFO, tiers=(2.0, 8.0))
    # entropy_b8 refreshes 4.5 / 512 = 8.8 per 1k: tier 8; periodic_T64 (13.7 per 1k) is within 2x of 8 too
    assert set(e[e.tier_per_1k == 8.0].policy) == {"entropy_b8", "periodic_T64"}
    assert e[e.tier_per_1k == 2.0].empty                                 # nothing within a factor 2 of 2 per 1k


# --------------------------------------------------------------------------- the study end to end (tiny models)


def test_refresh_long_end_to_end_on_tiny_models(tiny_teacher, tiny_student, tmp_path, monkeypatch):
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec
    from kvlab.store import RunStore

    monkeypatch.setattr(L, "MIN_TOKENS", 8)
    smp = Sampling(temperature=0.7, top_p=0.9, seed=0)
    spec = RunSpec(prompts=tuple(f"Explain thing {i} simply." for i in range(5)), tokens=24, sampling=smp, batch=5)
    calib = RunSpec(prompts=("calibrate a", "calibrate b"), tokens=24, sampling=smp, batch=5)
    tables = L.refresh_long(tiny_teacher, tiny_student, spec, calib, RunStore(tmp_path / "runs"), timing_repeats=0,
                            progress=False)
    t = tables["refresh_long"].set_index("policy")
    assert {"no_refresh", "periodic_T64", "periodic_T128", "periodic_T256", "speculative_k8"} <= set(t.index)
    assert (t.n_prompts == 5).all() and (t.tokens == 24).all()
    assert t.loc["speculative_k8", "refreshes_per_1k"] == pytest.approx(1000 * 2 / 24)   # after steps 8, 16
    assert t.loc["periodic_T64", "refreshes_per_1k"] == 0                              # T > N: never fires
    assert t.loc["no_refresh", "d_kl_forced"] == 0 and t[["d_kl_forced_lo", "d_teacher_ppl_hi"]].notna().all().all()
    runs = tables["refresh_long_runs"]
    assert len(runs) == 5 * len(t) and runs.tail_logprob.notna().all()
    paths = L.write_long(tables, tmp_path / "out", spec, calib)
    assert (tmp_path / "out" / "refresh_long.csv").is_file() and (tmp_path / "out" / "refresh_equal_cost.md").is_file()
    from kvlab.harness.figures import render
    from kvlab.studies.refresh import plots  # noqa: F401

    assert render("refresh_long", tmp_path / "out").is_file()
    assert len(paths) >= 8


def test_refresh_long_runs_a_subset_without_calibrating(tiny_teacher, tiny_student, tmp_path, monkeypatch):
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec
    from kvlab.store import RunStore

    monkeypatch.setattr(L, "MIN_TOKENS", 8)
    spec = RunSpec(prompts=tuple(f"Explain {i}." for i in range(5)), tokens=20, sampling=Sampling(seed=0), batch=5)
    store = RunStore(tmp_path / "runs")
    tables = L.refresh_long(tiny_teacher, tiny_student, spec, spec, store, timing_repeats=0,
                            policies=["periodic_T64"], progress=False)
    assert list(tables["refresh_long"].policy) == ["no_refresh", "periodic_T64"]
    assert "refresh_long_calibration" not in tables
    with pytest.raises(ValueError, match="--policies"):
        L.refresh_long(tiny_teacher, tiny_student, spec, spec, store, timing_repeats=0, policies=["periodic_T7"],
                       progress=False)


def test_refresh_long_refuses_short_generations(tiny_teacher, tiny_student, tmp_path):
    from kvlab.harness.experiment import RunSpec
    from kvlab.store import RunStore

    spec = RunSpec(prompts=("a",), tokens=64)
    with pytest.raises(ValueError, match="N >= 512"):
        L.refresh_long(tiny_teacher, tiny_student, spec, spec, RunStore(tmp_path), progress=False)


# --------------------------------------------------------------------------- the CLI's flags (before any model loads)


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "128"], "--tokens=128 must be >= 512"),
    (["--prompt-set", "long"], "refresh-long needs long-form answers"),
    (["--timing-repeats", "-1"], "--timing-repeats=-1 must be >= 0"),
    (["--rebuild-student-cache"], "cannot be used with refresh-long"),
    (["--policies", " , "], "--policies=' , ' names no row"),
])
def test_bad_flags_get_clear_errors(argv, needle, capsys):
    from kvlab.cli import main

    assert main(["refresh-long", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_bad_prompts_flag_is_refused_by_the_parser(capsys):
    from kvlab.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["refresh-long", "--prompts", "0"])
    assert "--prompts" in capsys.readouterr().err


def test_main_job_runs_refresh_long_at_n_512(monkeypatch):
    """`kvlab all` runs refresh-long at N = 512 (the issue's floor for make figures) on ALL_PROMPTS prompts, with its
    rows named, under OUT/reduced: the committed table (16 prompts, every row) is not overwritten."""
    from kvlab import cli
    from kvlab.studies.refresh import cli as rcli

    assert "refresh-long" in [n for n, _ in cli.JOBS] and "refresh-long" in cli.NEEDS_SAME_GEOMETRY
    seen = {}
    monkeypatch.setattr(rcli, "cmd_refresh_long", lambda a: seen.update(vars(a)) or [])
    args = cli.build_parser().parse_args(["all"])
    rcli.refresh_long_all(args)
    assert seen["tokens"] == 512 and seen["prompts"] == rcli.ALL_PROMPTS >= 8 and seen["timing_repeats"] == 0
    assert seen["out"] == args.out / "reduced"
    assert set(seen["policies"].split(",")) == {"periodic_T64", "periodic_T128", "periodic_T256"}
