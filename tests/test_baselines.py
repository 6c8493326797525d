"""The baselines table: teacher / overfill / student / standalone rows, kl_forced with paired intervals
and the minimum detectable difference; the regimes table side by side."""
from __future__ import annotations

import pandas as pd
import pytest

from kvlab.core.tiny import make_tiny_lm
from kvlab.decode import Sampling
from kvlab.store import RunStore
from kvlab.studies.baselines.table import COLUMNS, baselines, regimes_table, write_baselines
from kvlab.harness.experiment import RunSpec

PROMPTS = ("abc", "hello there", "x y z", "one two", "the cat sat")


def test_baselines_has_both_baselines_and_forced_scores(tiny_teacher, tiny_student, tmp_path):
    alone = make_tiny_lm(seed=7, intermediate_size=48)
    spec = RunSpec(prompts=PROMPTS, tokens=6, sampling=Sampling(temperature=0.8, top_p=0.9, seed=0))
    store = RunStore(tmp_path / "runs")
    table, per = baselines(tiny_teacher, tiny_student, spec, store, progress=False, alone=alone)
    assert table.policy.tolist() == ["teacher", "overfill", "student", "standalone"]
    t = table.set_index("policy")
    assert t.loc["teacher", "kl_forced"] < 1e-6 and (t.loc[["overfill", "student", "standalone"], "kl_forced"] > 0).all()
    assert t.loc["overfill", "d_kl_forced"] == 0.0 and pd.isna(t.loc["overfill", "d_kl_forced_mde"])
    # the student row is the OverFill decoder alone: its forced KL per prompt is the tiny student's, not `alone`'s
    p = per.set_index(["policy", "prompt_idx"])
    d = [p.loc[("student", i), "kl_forced"] - p.loc[("overfill", i), "kl_forced"] for i in range(5)]
    assert abs(t.loc["student", "d_kl_forced"] - sum(d) / 5) < 1e-9
    assert t.loc["student", "d_kl_forced_lo"] <= t.loc["student", "d_kl_forced"] <= t.loc["student", "d_kl_forced_hi"]
    assert t.loc["standalone", "d_kl_forced_mde"] > 0 and 0 < t.loc["student", "distinct2"] <= 1
    assert p.loc[("standalone", 0), "kl_forced"] != p.loc[("student", 0), "kl_forced"]
    paths = write_baselines(table, per, tmp_path / "out", name="baselines_long")
    md = (tmp_path / "out" / "baselines_long.md").read_text()
    assert "`kl_forced`" in md and "MDE = 2.8 × SD" in md and "equal-budget baseline" in md
    assert list(pd.read_csv(tmp_path / "out" / "baselines_long.csv").columns) == COLUMNS and len(paths) == 6
    # without a separate student the standalone row is left out
    table2, _ = baselines(tiny_teacher, tiny_student, spec, store, progress=False)
    assert table2.policy.tolist() == ["teacher", "overfill", "student"]
    reg = regimes_table({"short": table, "long": table2})
    assert reg[["regime", "baseline"]].values.tolist() == [["short", "student"], ["short", "standalone"],
                                                           ["long", "student"]]
    assert reg.d_kl_forced.iloc[0] == t.loc["student", "d_kl_forced"]
    assert reg.kl_forced_step1_OF.iloc[0] == 0.0 and reg.kl_forced_step1_base.iloc[0] == t.loc["student", "kl_forced_step1"]


def test_every_row_of_the_baselines_table_is_scored_on_the_same_steps(tiny_teacher, tiny_student, tmp_path):
    """Issue 37: OverFill's step 1 is the teacher's (KL 0), the student rows' their own; every row's kl_forced
    averages steps 2..N all the same, and step 1 is its own column (0 for OverFill, > 0 for the students)."""
    from dataclasses import replace

    from kvlab.harness.forced import forced_scores, reference_tokens
    from kvlab.studies.baselines.table import POLICIES

    spec = RunSpec(prompts=PROMPTS[:2], tokens=6, sampling=Sampling(temperature=0.8, top_p=0.9, seed=0))
    store = RunStore(tmp_path / "runs")
    table, per = baselines(tiny_teacher, tiny_student, spec, store, progress=False)
    t = table.set_index("policy")
    assert t.loc["overfill", "kl_forced_step1"] == 0.0 and t.loc["student", "kl_forced_step1"] > 0
    assert t.loc["teacher", "kl_forced_step1"] == 0.0
    for i, prompt in enumerate(spec.prompts):
        ref = reference_tokens(tiny_teacher, prompt, 6, spec.sampling_for(i), store)
        for name in ("overfill", "student"):
            cfg = replace(POLICIES[name], max_new_tokens=6)
            one = forced_scores(tiny_teacher, tiny_student, prompt, cfg, ref)
            assert one["forced_steps"] == 5                                  # steps 2..6 in both rows
            row = per[(per.policy == name) & (per.prompt_idx == i)].iloc[0]
            assert row.kl_forced == pytest.approx(one["kl_forced"], abs=1e-6)
            assert row.kl_forced == pytest.approx(sum(one["kl_forced_steps"][1:]) / 5, abs=1e-6)


def test_train_study_table_reads_both_baselines_and_kl_forced(tiny_teacher, tiny_student, tmp_path):
    from kvlab.studies.training.study import study_runs, study_table

    students = {"pruned": tiny_student, "standalone": make_tiny_lm(seed=7, intermediate_size=48),
                "overfill": make_tiny_lm(seed=8, intermediate_size=48)}
    spec = RunSpec(prompts=PROMPTS, tokens=6, sampling=Sampling(temperature=0.8, top_p=0.9, seed=0))
    per = study_runs(tiny_teacher, students, spec, RunStore(tmp_path), T=2, progress=False)
    assert set(per.policy) == {f"{v}:{m}" for v in students for m in ("overfill", "refresh", "student")}
    t = study_table(per, students, T=2).set_index("variant")
    assert t.loc["overfill", "student_alone"] == "standalone" and t.loc["pruned", "student_alone"] == "pruned"
    p = per.set_index(["policy", "prompt_idx"]).kl_forced
    d = [p[("overfill:overfill", i)] - p[("overfill:student", i)] for i in range(5)]
    assert abs(t.loc["overfill", "dklf_OF_vs_own"] - sum(d) / 5) < 1e-9
    assert t.loc["overfill", "klf_S"] == per[per.policy == "standalone:student"].kl_forced.mean()
    assert t.loc["overfill", "dklf_refresh_mde"] > 0
