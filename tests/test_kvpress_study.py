"""The kvpress study (kvlab.studies.kvpress) on the tiny models: the table has its columns, one row per press and
mode (prefill-only presses at prefill only), the sliding-window reference row at d = 0; the head-mean study's two
paths agree, and on a one-KV-head model per-head kept sets are the head-mean's. Skipped without kvpress."""
from __future__ import annotations

import pytest

kvpress = pytest.importorskip("kvpress")

from kvlab.core.tiny import make_tiny_lm  # noqa: E402
from kvlab.decode import Sampling  # noqa: E402
from kvlab.harness.experiment import RunSpec  # noqa: E402
from kvlab.store import RunStore  # noqa: E402
from kvlab.studies.kvpress import heads, table  # noqa: E402
from kvlab.studies.kvpress.presses import PRESSES, policy, study_policies  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog, and then it sleeps. " * 2


def _spec(n=5, tokens=4):
    return RunSpec(prompts=tuple(PROMPT[i:] for i in range(n)), tokens=tokens,
                   sampling=Sampling(temperature=0.7, top_p=0.9, seed=0), batch=4)


def test_the_table_has_its_columns(tiny_teacher, tmp_path):
    store = RunStore(tmp_path)
    presses = ["KnormPress", "TOVAPress", "LeverageScorePress"]
    t, per_run, skipped = table.kvpress_table(tiny_teacher, _spec(), presses, budget=24, store=store, sinks=2)
    need = {"press", "mode", "budget", "mean_len", "kl_forced", "d_kl_forced", "d_kl_forced_lo", "d_kl_forced_hi",
            "d_kl_forced_mde", "n_prompts"}
    assert need <= set(t.columns)
    rows = set(zip(t.press, t["mode"]))
    assert {(p, m) for p in ["sliding", "KnormPress", "TOVAPress"] for m in ("prefill", "decode")} <= rows
    assert ("LeverageScorePress", "prefill") in rows and ("LeverageScorePress", "decode") not in rows
    assert skipped == [{"press": "LeverageScorePress", "mode": "decode", "why": skipped[0]["why"]}]
    assert (t.loc[t.press == "sliding", "d_kl_forced"] == 0).all()
    assert (t.loc[t["mode"] != "none", "n_prompts"] == 5).all()
    dec = t[t["mode"] == "decode"]
    assert (dec.mean_len <= 24).all() and (t.loc[t["mode"] == "prefill", "mean_len"] > 24).all()
    assert float(t.loc[t.press == "full", "kl_forced"].iloc[0]) == 0.0
    again, _, _ = table.kvpress_table(tiny_teacher, _spec(), presses, budget=24, store=store, sinks=2)
    assert again.equals(t)                                    # a rerun is read from the store
    notes = table.table_notes(_spec(), 24, 2, skipped, command="x")
    assert any("LeverageScorePress" in n for n in notes) and notes[-1] == "Command: `x`"
    paths = table.write_kvpress(t, tmp_path / "out", notes)
    assert paths[1].read_text().count("Command") == 1


def test_the_prefill_reference_keeps_what_the_sliding_window_keeps(tiny_teacher):
    import kvlab

    kept = []
    for mode in ("prefill", "decode"):
        d = kvlab.Decoding(tiny_teacher, None, PROMPT, kvlab.DecodeConfig(mode="teacher", max_new_tokens=1,
                                                                          evict=policy("sliding", mode, 20, 2)))
        list(d)
        kept.append([list(p) for p in d.cache.layer_positions()])
    assert kept[0] == kept[1]


def test_study_policies_name_what_they_skip():
    with pytest.raises(ValueError, match="modes"):
        study_policies(["KnormPress"], 24, 2, modes=("both",))
    with pytest.raises(ValueError, match="NotAPress"):
        study_policies(["NotAPress"], 24, 2)
    assert len(PRESSES) >= 10


def test_head_mean_vs_per_head_on_one_kv_head(tmp_path):
    """One KV head: kvpress's per-head top-k is the head-mean top-k, so both paths give the same KL, and the
    HF-cache path with the head-mean set equals kvlab's own cache path."""
    lm = make_tiny_lm(seed=3, num_kv_heads=1)
    t = heads.heads_table(lm, _spec(), ["KnormPress", "SnapKVPress"], budget=24, store=RunStore(tmp_path))
    assert list(t.columns) == heads.COLUMNS and list(t.press) == ["KnormPress", "SnapKVPress"]
    assert (t.check_max_abs < 1e-4).all(), t
    assert (t.d.abs() < 1e-4).all(), t
    assert (t.n_prompts == 5).all()


def test_head_mean_path_agrees_with_kvlab_on_several_heads(tiny_teacher, tmp_path):
    t = heads.heads_table(tiny_teacher, _spec(), ["KnormPress"], budget=24, store=RunStore(tmp_path))
    assert (t.check_max_abs < 1e-4).all(), t


def test_forced_kl_is_the_harness_score_of_the_forced_run(tiny_teacher, tmp_path):
    """forced_kl_runs computes p_full once per prompt; its KL equals what the harness scores for the same
    forced run (kvlab.harness.experiment.scored_runs -> kvlab.core.metrics.score, `kl`)."""
    from kvlab.harness.experiment import scored_runs

    store, spec = RunStore(tmp_path), _spec(n=3)
    refs = table.references(tiny_teacher, spec, store)
    pol = policy(kvpress.KnormPress(), "decode", 20, 2)
    mine = table.forced_kl_runs(tiny_teacher, spec, pol, refs, store)
    theirs = scored_runs(tiny_teacher, None, [(p, table._cfg(spec, i, pol, refs[i])) for i, p in
                                              enumerate(spec.prompts)], store, batch=1)
    for a, b in zip(mine, theirs):         # two code paths, two summation orders: equal within float rounding (on the
        assert a["kl_forced"] == pytest.approx(b["kl"], rel=1e-3, abs=1e-6)   # EPYC's MKL a 5e-6 difference at 6e-3)
        assert a["cache_len"] == list(b["steps"]["cache_len"])


def test_menu_entries_build_and_match_the_study(tiny_teacher):
    """The playground / inspector menu (kvlab.eviction.kvpress.menu): every entry builds a policy, the same press
    settings as the study's (same run keys), and one runs."""
    import kvlab
    from kvlab.decode.keys import policy_dict
    from kvlab.eviction.kvpress import menu
    from kvlab.studies.kvpress.presses import make_press

    entries = menu.menu_entries()
    assert len(entries) >= 10 and all(e.startswith("kvpress:") for e in entries)
    for e in entries:
        pol = menu.menu_policy(e, budget=24)
        name = e[len("kvpress:"):]
        if name in PRESSES:
            from kvlab.eviction.scorer import ScorerPolicy
            assert policy_dict(pol) == policy_dict(ScorerPolicy(make_press(name), budget=24, sinks=4)), e
    with pytest.raises(ValueError, match="NoSuchPress"):
        menu.menu_policy("kvpress:NoSuchPress", budget=24)
    tr = kvlab.run(tiny_teacher, None, PROMPT, kvlab.DecodeConfig(
        mode="teacher", max_new_tokens=2, evict=menu.menu_policy("kvpress:SnapKVPress", budget=24, every_step=True)))
    assert all(r.cache_len == 24 for r in tr.records)


def test_a_batched_run_before_import_kvpress_still_works_after_it():
    """kvpress wraps every registered attention function at import and calls it with `dropout` positionally; a
    batched run registers kvlab's before a press is first built (kvpress imports lazily), so kvlab_attention takes
    `dropout` as a named parameter (every later batched run failed before)."""
    import subprocess
    import sys

    code = ("import kvlab\nfrom kvlab.core.tiny import make_tiny_lm\nfrom kvlab.decode import run_batch\n"
            "lm = make_tiny_lm()\ncfg = kvlab.DecodeConfig(mode='teacher', max_new_tokens=2)\n"
            "run_batch(lm, None, ['hello world ' * 5, 'hi there ' * 6], cfg)\nimport kvpress\n"
            "run_batch(lm, None, ['hello world ' * 5, 'hi there ' * 6], cfg)\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_job_flags_are_checked_before_any_model_loads():
    from kvlab.studies.kvpress import job

    for argv, flag in ((["--budget", "0"], "--budget"), (["--sinks", "200"], "--sinks"), (["--modes", "both"], "modes"),
                       (["--kvpress", "NoSuchPress"], "NoSuchPress"), (["--kvpress", ","], "--kvpress")):
        with pytest.raises(ValueError, match=flag):
            job.check_args(job.parser().parse_args(argv))
    job.check_args(job.parser().parse_args([]))


def test_families_for_the_matched_memory_study():
    from kvlab.studies.kvpress.presses import families

    fam = families(["SnapKVPress", "LeverageScorePress"], sinks=4, modes=("prefill", "decode"))
    assert set(fam) == {"kvpress_SnapKVPress_prefill", "kvpress_SnapKVPress_decode", "kvpress_LeverageScorePress_prefill"}
    make, lo, hi = fam["kvpress_SnapKVPress_decode"]
    pol = make(40)
    assert (pol.budget, pol.sinks, pol.every_step, lo) == (40, 4, True, 5)
    with pytest.raises(ValueError, match="NoSuchPress"):
        families(["NoSuchPress"], sinks=4)


def test_the_cli_module_registers_its_subcommand():
    import argparse

    from kvlab.studies.kvpress import cli

    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["kvpress", "--kvpress", "SnapKVPress", "--modes", "prefill", "--prompts", "4"])
    assert args.fn is cli.cmd_kvpress and args.kvpress == "SnapKVPress" and args.prompts == 4


def test_the_needle_grid_takes_presses_beside_its_families():
    """``evict --kvpress``: each press is a row of the needle grid too, evicting at every step to the sliding
    window's budget with its 4 sinks; the grid's own policies are unchanged."""
    from kvlab.decode.keys import policy_dict
    from kvlab.studies.eviction import needle

    plain = needle.matched_needle_policies(100.0, 23, 128)
    both = needle.matched_needle_policies(100.0, 23, 128, kvpress=("KnormPress", "SnapKVPress"))
    assert {k: policy_dict(v) for k, v in plain.items()} == {k: policy_dict(both[k]) for k in plain}
    for name in ("KnormPress", "SnapKVPress"):
        pol = both[f"kvpress_{name}"]
        assert type(pol.scorer).__name__ == name and pol.every_step
        assert (pol.budget, pol.sinks) == (plain["sliding"].window, plain["sliding"].sinks) == (100, 4)
