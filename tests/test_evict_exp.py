"""Eviction experiments: matched-budget solver, needle task, tables, figures, CLI."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from kvlab.studies.eviction.tables import (capped_mean, invert_capped, matched_table, paired_ci, run_memory, sawtooth_frame,
                                solve_budget)
from kvlab.studies.eviction.needle import (FILLER, INTRO, NEEDLE, QUESTION, build_case, check_grid, digits_correct, is_correct,
                          make_cases, parse_key)

# --------------------------------------------------------------------------- solver


def test_invert_capped_is_the_closest_cap():
    trajs = [list(range(40, 200)), list(range(60, 220))]
    for target in (50.0, 77.3, 101.0, 150.5):
        k = invert_capped(trajs, target, 1, 400)
        brute = min(range(1, 401), key=lambda c: (abs(capped_mean(trajs, c) - target), c))
        assert abs(capped_mean(trajs, k) - target) == pytest.approx(abs(capped_mean(trajs, brute) - target))


def test_solver_hits_reachable_target_and_counts_probes():
    trajs = [list(range(30, 230))]
    calls = []

    def measure(k):
        calls.append(k)
        return capped_mean(trajs, k) * 0.01          # "MiB": a monotone function of the budget

    target = capped_mean(trajs, 97) * 0.01
    sol = solve_budget(measure, target, 1, 1000, guess=500, tol=1e-9, max_probes=20)
    assert sol.knob == 97 and sol.achieved == pytest.approx(target)
    assert len(calls) == len(set(calls)) == len(sol.probes) <= 20   # no probe measured twice
    # a good guess is accepted with one probe
    calls.clear()
    assert solve_budget(measure, target, 1, 1000, guess=97, tol=0.01).knob == 97 and calls == [97]


def test_solver_picks_the_closest_when_target_falls_between_steps():
    measure = lambda k: 10.0 * (k // 8)              # block-granular memory: steps of 10
    sol = solve_budget(measure, 34.0, 1, 200, guess=1, tol=0.001)
    assert sol.achieved == 30.0 and sol.rel_err == pytest.approx(4 / 34)
    with pytest.raises(ValueError, match="target"):
        solve_budget(measure, 0.0, 1, 10)
    with pytest.raises(ValueError, match="lo="):
        solve_budget(measure, 1.0, 5, 2)


def test_run_memory_needs_bytes_and_reports_peak_and_mean():
    steps = {"cache_len": [10, 12, 8, 9], "cache_bytes": [2 ** 20 * x for x in (1, 1.2, 0.8, 0.9)],
             "evicted": [0, 0, 4, 0]}
    m = run_memory(steps)
    assert m["peak_len"] == 12 and m["mean_len"] == pytest.approx(9.75)
    assert m["peak_mb"] == pytest.approx(1.2) and m["mean_mb"] == pytest.approx(0.975)
    assert m["evicted"] == 4 and m["evict_events"] == 1
    with pytest.raises(ValueError, match="cache_bytes"):
        run_memory({"cache_len": [1], "evicted": [0]})


def _per_run():
    rng = np.random.default_rng(0)
    rows = []
    for p, shift in (("full", 0.0), ("confkv", 0.5), ("sliding", 2.0)):
        for i in range(6):
            rows.append({"policy": p, "prompt_idx": i, "teacher_ppl": 3 + shift + 0.01 * i, "kl": shift / 10 + 0.001 * i,
                         "repeat3": 0.1, "tps": 30 + rng.normal(), "total_s": 4.0, "tokens": 64,
                         "mean_len": 100 - 20 * (p != "full"), "peak_len": 150, "mean_mb": 2.0 - 0.5 * (p != "full"),
                         "peak_mb": 3.0, "evicted": 0, "evict_events": 0, "meta_mb": 0.1 * (p != "sliding"),
                         "peak_fwd_mb": 3.5})
    return pd.DataFrame(rows)


def test_paired_ci_and_matched_table():
    per_run = _per_run()
    ci = paired_ci(per_run, "full").set_index("policy")
    assert ci.loc["sliding", "d_teacher_ppl_vs_full"] == pytest.approx(2.0)
    assert ci.loc["sliding", "d_teacher_ppl_vs_full_lo"] == pytest.approx(2.0)   # constant difference
    assert ci.loc["full", "d_kl_vs_full"] == 0.0
    info = pd.DataFrame([{"policy": p, "matched_by": m, "params": ""} for p, m in
                         (("full", "reference"), ("confkv", "target"), ("sliding", "solved budget"))])
    info["target_mb"] = 1.5
    info["entry16_mb"] = 0.005
    t = matched_table(per_run, info).set_index("policy")
    assert t.loc["sliding", "mean_mb_16bit"] == pytest.approx(80 * 0.005)
    assert t.loc["sliding", "mem_vs_16bit"] == pytest.approx(1.5 / 0.4)
    assert t.loc["sliding", "meta_mb"] == 0.0 and t.loc["confkv", "meta_mb"] == pytest.approx(0.1)
    assert t.loc["sliding", "peak_fwd_mb"] == 3.5
    assert t.loc["sliding", "d_kl_vs_confkv_ci"].startswith("[")
    assert t.loc["sliding", "mem_vs_target"] == pytest.approx(1.0)
    assert t.loc["full", "mem_vs_target"] == pytest.approx(2.0 / 1.5)
    assert t.loc["sliding", "d_kl_vs_confkv"] == pytest.approx(0.15)
    assert t.loc["confkv", "n_prompts"] == 6


def test_intervals_refused_below_five_pairs():
    from kvlab.harness.experiment import ci_text, paired_bootstrap

    per_run = _per_run()
    few = per_run[per_run.prompt_idx < 4]
    ci = paired_bootstrap(few, "full", ("kl",)).set_index("policy")
    assert np.isnan(ci.loc["sliding", "d_kl_lo"]) and np.isnan(ci.loc["sliding", "d_kl_hi"])
    assert ci.loc["sliding", "d_kl"] == pytest.approx(0.2)            # the mean difference is still reported
    assert ci.loc["sliding", "d_kl_ci"] == "n too small (n=4)"
    five = paired_bootstrap(per_run[per_run.prompt_idx < 5], "full", ("kl",)).set_index("policy")
    assert five.loc["sliding", "d_kl_lo"] == pytest.approx(0.2) and five.loc["sliding", "d_kl_ci"] == "[+0.200, +0.200]"
    assert ci_text(0.1, 0.2, 3) == "n too small (n=3)"


# --------------------------------------------------------------------------- needle task


@pytest.mark.parametrize("text, key, ok", [
    (" 71432. The", "71432", True),
    ("71432", "71432", True),
    (" 714320.", "71432", False),           # a longer number is wrong
    (" 7143.", "71432", False),
    (" a key that is used", "71432", False),
    ("The pass key is 71432", "71432", True),
    ("", "71432", False),
])
def test_parse_and_score_answers(text, key, ok):
    assert is_correct(text, key) is ok
    assert (parse_key(text) == key) is ok


def test_digits_correct_is_graded():
    assert digits_correct(" 71432.", "71432") == 1.0
    assert digits_correct(" 71499.", "71432") == pytest.approx(0.6)
    assert digits_correct(" no digits", "71432") == 0.0


class _CharTok:
    def __call__(self, text):
        return {"input_ids": list(range(len(text)))}


def test_build_case_depth_and_length():
    tok = _CharTok()
    first = build_case(tok, 2000, 0.0, "12345")
    assert first.prompt.startswith(INTRO + NEEDLE.format(key="12345"))
    last = build_case(tok, 2000, 1.0, "12345")
    assert last.prompt.endswith(NEEDLE.format(key="12345") + QUESTION)
    mid = build_case(tok, 2000, 0.5, "12345")
    i = mid.prompt.index("12345")
    assert 0.35 < i / len(mid.prompt) < 0.65
    for c in (first, mid, last):                      # within one filler unit of the target
        assert abs(len(c.prompt) - 2000) <= len(FILLER)
    with pytest.raises(ValueError, match="depth"):
        build_case(tok, 2000, 1.5, "12345")
    with pytest.raises(ValueError, match="key"):
        build_case(tok, 2000, 0.5, "123")


def test_make_cases_is_seeded_grid():
    tok = _CharTok()
    a = make_cases(tok, (500, 900), (0.0, 1.0), reps=2, seed=3)
    b = make_cases(tok, (500, 900), (0.0, 1.0), reps=2, seed=3)
    assert [c.key for c in a] == [c.key for c in b] and len(a) == 8
    assert len({c.key for c in a}) > 1
    assert {(c.length, c.depth) for c in a} == {(500, 0.0), (500, 1.0), (900, 0.0), (900, 1.0)}


@pytest.mark.parametrize("kw, msg", [
    ({"lengths": ()}, "lengths"), ({"lengths": (0,)}, "lengths"), ({"depths": (1.2,)}, "depths"),
    ({"reps": 0}, "reps"), ({"budget": 8}, "budget"), ({"budget": 256}, "smaller than the shortest"),
])
def test_check_grid_names_the_parameter(kw, msg):
    args = {"lengths": (256, 512), "depths": (0.0, 1.0), "reps": 1, "budget": 128, **kw}
    with pytest.raises(ValueError, match=msg):
        check_grid(**args)


# --------------------------------------------------------------------------- stored runs and figures


def test_sawtooth_figure_renders_from_stored_csv(tmp_path):
    from kvlab.viz.figures import render

    mb = 2 ** 20
    fake = {}
    for name, lens in (("full", list(range(50, 80))), ("confkv", [50, 51, 52, 40, 41, 42, 43, 40] * 3 + [40] * 6)):
        ev = [0] + [max(0, a + 1 - b) for a, b in zip(lens, lens[1:])]
        fake[name] = {"steps": {"cache_len": lens, "cache_bytes": [n * 1000 for n in lens], "evicted": ev,
                                "refreshed": [False] * len(lens),
                                "signals": [{"confidence": 0.8, "budget": 40.0} if name == "confkv" else {}] * len(lens)}}
    df = sawtooth_frame(fake, gamma=0.7)
    assert set(df.policy) == {"full", "confkv"} and df.cache_mb.iloc[0] == pytest.approx(50 * 1000 / mb)
    assert df[df.policy == "confkv"].evicted.sum() > 0
    df.to_csv(tmp_path / "evict_sawtooth.csv", index=False)
    from kvlab.studies.eviction import plots as evict_plots  # noqa: F401  (registers)

    png = render("evict_sawtooth", tmp_path)
    assert png is not None and png.stat().st_size > 10_000
    fig = evict_plots.evict_sawtooth_figure({"evict_sawtooth": pd.read_csv(tmp_path / "evict_sawtooth.csv")})
    assert len(fig.axes) >= 3                              # length, bytes, confidence (+ budget twin)
    assert [l.get_label() for l in fig.axes[0].get_lines()] == ["full", "confkv"]


def test_needle_figure_and_markdown_from_table(tmp_path):
    from kvlab.studies.eviction import plots as evict_plots
    from kvlab.studies.eviction.needle import needle_markdown, needle_table

    rows = [{"policy": p, "length": n, "depth": d, "rep": 0, "key": "11111", "prompt_tokens": n,
             "answer": "", "correct": float(p == "full" or d == 1.0), "digits": 1.0, "answer_cache_len": 10.0,
             "evicted": 0, "total_s": 0.1}
            for p in ("full", "sliding") for n in (256, 512) for d in (0.0, 1.0)]
    t = needle_table(pd.DataFrame(rows), order=["full", "sliding"])
    assert t[t.policy == "sliding"].accuracy.tolist() == [0.0, 1.0, 0.0, 1.0]
    md = needle_markdown(t)
    assert "| full | 1.00 | 1.00 | 1.00 |" in md and "| sliding | 0.50 | 0.50 | 0.50 |" in md
    fig = evict_plots.evict_needle_figure({"evict_needle": t})
    assert len(fig.axes) == 3                                # two policies + colour bar


# --------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("args, needle", [
    (["evict", "--gamma", "1.5"], "gamma"),
    (["evict", "--needle-depths", "0.5", "1.2"], "depths"),
    (["evict", "--needle-lengths", "256", "--needle-budget", "512"], "smaller than the shortest"),
    (["evict", "--prompts", "0"], "--prompts must be a positive integer"),
    (["all", "--evict-prompts", "0"], "--evict-prompts must be a positive integer"),
])
def test_evict_cli_rejects_bad_input_before_work(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlab", *args, "--out", str(tmp_path / "o"), "--runs", str(tmp_path / "r")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


# --------------------------------------------------------------------------- the job on tiny models


def test_evict_tables_on_tiny_models(tiny_teacher, tiny_student, tmp_path):
    """The whole job end to end: matched budgets really match (within tol or one knob step),
    runs are reused from the store on a rerun, every CSV renders into its figure."""
    from kvlab.decode import Sampling
    from kvlab.studies.eviction.tables import EvictStudy, NeedleGrid, evict_tables, write_evict
    from kvlab.harness.experiment import RunSpec
    from kvlab.studies.eviction import plots as evict_plots  # noqa: F401  (registers)
    from kvlab.viz.figures import render
    from kvlab.refresh.policies import Periodic
    from kvlab.store import RunStore

    spec = RunSpec(prompts=("the quick brown fox jumps over the lazy dog " * 2, "hello world, how are you today? " * 2),
                   tokens=40, sampling=Sampling(temperature=0.8, top_p=0.95, seed=1))
    study = EvictStudy(gamma=0.5, tight=16, loose=20, protect=4, sinks=2, block_size=2, tol=0.03, gammas=(0.3,),
                       run_families=("confkv_fixed", "sliding", "h2o", "random", "block", "block_kvcrush",
                                     "block_rerotate"))
    grid = NeedleGrid(lengths=(300,), depths=(0.0, 1.0), reps=1, budget=64)
    store = RunStore(tmp_path / "runs")
    tables = evict_tables(tiny_teacher, tiny_student, spec, store, study, grid, refresh=Periodic(8), progress=False)
    m = tables["evict_matched"].set_index("policy")
    assert {"full", "confkv", "confkv_recency", "sliding", "h2o", "random", "random_rate",
            "block", "confkv_fixed", "confkv_l", "confkv_nosinks", "block_kvcrush", "block_rerotate",
            "confkv_g0.3", "confkv_g0.5"} <= set(m.index)
    # the confidence-off control matches Conf-KV's mean memory within the solver's tolerance (or one entry)
    assert abs(m.loc["confkv_fixed", "mean_mb"] - m.loc["confkv", "target_mb"]) <= max(
        study.tol * m.loc["confkv", "target_mb"], m.loc["full", "mean_mb"] / m.loc["full", "mean_len"])
    assert 0 < m.loc["confkv", "frac_loose"] <= 1 and np.isnan(m.loc["h2o", "frac_loose"])
    assert m.loc["confkv", "sinks"] == "2" and m.loc["confkv_nosinks", "sinks"] == "0"
    assert m.loc["confkv_l", "mean_mb16"] < m.loc["confkv_pyramidal", "mean_mb16"]      # INT8 storage
    assert m.loc["confkv", "mean_mb16"] == pytest.approx(m.loc["confkv", "mean_mb"] / 2)   # fp32 -> 16-bit
    assert m.loc["confkv_fixed", "kl_forced"] >= 0 and np.isnan(m.loc["confkv_drawn", "kl_forced"])
    target = m.loc["confkv", "target_mb"]
    assert m.loc["confkv", "mean_mb"] == pytest.approx(target)
    per_entry = m.loc["full", "mean_mb"] / m.loc["full", "mean_len"]
    for fam, step in (("sliding", 1), ("h2o", 1), ("random", 1), ("block", study.block_size)):
        # within tol, or within one knob step of the target (integer budgets)
        assert abs(m.loc[fam, "mean_mb"] - target) <= max(study.tol * target, step * per_entry), fam
    assert m.loc["full", "mean_mb"] > 1.5 * target                      # eviction really saved memory
    assert m.loc["full", "kl"] == pytest.approx(0.0, abs=1e-4)          # KL to the full cache
    assert (m.drop(index="full")["kl"] > 0).all()
    saw = tables["evict_sawtooth"]
    assert {"full", "confkv", "confkv+overfill+refresh"} <= set(saw.policy)
    assert saw[saw.policy == "confkv"].confidence.notna().all()
    assert saw[saw.policy == "confkv+overfill+refresh"].refreshed.sum() > 0
    assert saw[saw.policy == "confkv"].evicted.sum() > 0
    nd = tables["evict_needle"]
    assert set(nd.policy) == {"full", "sliding", "h2o", "confkv", "block", "snapkv"} and len(nd) == 24
    assert set(nd.setting) == {"streamed", "prefill"}
    runs = tables["evict_needle_runs"]
    assert (runs[runs.setting == "streamed"].question_steps > 5).all() and (runs[runs.setting == "prefill"]
                                                                            .question_steps == 0).all()
    assert set(tables["evict_gamma"].policy) >= {"confkv_g0.3", "confkv_g0.5", "confkv_fixed"}
    assert set(tables["evict_int8"].tensor) == {"K", "V"}
    paths = write_evict(tables, tmp_path / "out")
    assert (tmp_path / "out" / "evict_matched.csv").is_file() and paths
    for name in ("evict_sawtooth", "evict_needle", "evict_gamma"):
        assert render(name, tmp_path / "out") is not None
    n_runs = len(store)
    again = evict_tables(tiny_teacher, tiny_student, spec, store, study, grid, refresh=Periodic(8), progress=False)
    assert len(store) == n_runs                                          # every run reused
    pd.testing.assert_frame_equal(again["evict_matched"], tables["evict_matched"])


def test_eviction_rate_counts_only_over_budget_steps():
    from kvlab.studies.eviction.tables import eviction_rate

    steps = {"cache_len": [40, 48, 49, 50, 48, 47], "evicted": [0, 3, 0, 0, 2, 0]}
    # pre-evict lengths 40, 51, 49, 50, 50, 47: over 48 at steps 2-5 (4 steps), evictions at 2 and 5
    assert eviction_rate([steps], 48) == pytest.approx(0.5)
    assert eviction_rate([{"cache_len": [10], "evicted": [0]}], 48) == 0.0


@pytest.mark.parametrize("budget", [64, 128, 200])
def test_needle_policies_share_one_peak_budget(budget):
    from kvlab.studies.eviction.needle import needle_policies

    pols = needle_policies(budget)
    assert pols["full"] is None
    assert pols["sliding"].window == budget and pols["h2o"].budget == budget and pols["confkv"].loose == budget
    b = pols["block"]
    assert b.max_after_eviction <= budget                      # OpenVINO's peak: max + block - 1
    from kvlab.studies.eviction.needle import ANSWER_TOKENS
    assert pols["snapkv"].budget + ANSWER_TOKENS <= budget
    assert pols["pyramidkv"].budget == pols["snapkv"].budget          # same mean entries per layer


# --------------------------------------------------------------------------- the committed tables let each mechanism act

FIG = __import__("pathlib").Path(__file__).resolve().parents[1] / "figures"


def _committed(name):
    path = FIG / f"{name}.csv"
    if not path.is_file():
        pytest.skip(f"{path} not generated (python -m kvlab evict --out figures)")
    return pd.read_csv(path)


def test_committed_study_loose_budget_is_reached_and_control_matched():
    """In the study configuration the loose budget binds (the cache stands at it on some steps), the
    confidence-off control and block eviction match Conf-KV's mean memory within the solver's tolerance,
    and the rows say whether sinks were on."""
    from kvlab.studies.eviction.tables import EvictStudy

    t = _committed("evict_matched").set_index("policy")
    study = EvictStudy()
    ck = t.loc["confkv"]
    assert ck.peak_len >= study.loose and ck.frac_at_loose > 0 and 0 < ck.frac_loose < 1
    for row in ("confkv_fixed", "block", "block_kvcrush", "block_rerotate"):
        assert abs(t.loc[row, "mem_vs_target"] - 1) <= study.tol, row
    assert abs(t.loc["confkv_pyramidal", "mem_vs_target"] - 1) <= study.tol   # the pyramid at equal memory
    assert t.loc["confkv_l", "mean_mb16"] < t.loc["confkv_pyramidal", "mean_mb16"]   # + INT8 storage
    assert str(t.loc["confkv", "sinks"]) == str(study.sinks) and str(t.loc["confkv_nosinks", "sinks"]) == "0"
    assert t.loc["confkv_fixed", "kl_forced"] > 0 and not np.isnan(t.loc["h2o", "d_kl_forced_vs_confkv"])


def test_committed_needle_has_both_settings():
    t = _committed("evict_needle")
    assert set(t.setting) == {"streamed", "prefill"}
    runs = _committed("evict_needle_runs")
    assert (runs[runs.setting == "streamed"].question_steps > 0).all()
    assert (runs[runs.setting == "prefill"].question_steps == 0).all()


def test_needle_batch_equals_one_at_a_time(tiny_teacher, tmp_path):
    """needle_results decodes missing completions in batches; each equals needle_run alone (greedy, same store key),
    in both settings, with an evicting and a full-cache policy, prompts of different lengths in one batch."""
    from kvlab.eviction import H2O
    from kvlab.studies.eviction.needle import make_cases, needle_results, needle_run
    from kvlab.store import RunStore

    cases = make_cases(tiny_teacher.tokenizer, (64, 96), (0.0, 1.0), 1, 0)
    pols = [None, H2O(budget=40, recent=4, sinks=2)]
    for setting in ("streamed", "prefill"):
        jobs = [(c, p) for c in cases for p in pols]
        batched = RunStore(tmp_path / f"b-{setting}")
        got = needle_results(tiny_teacher, jobs, batched, setting, batch=3)
        alone = RunStore(tmp_path / f"a-{setting}")
        want = [needle_run(tiny_teacher, c, p, alone, setting) for c, p in jobs]
        assert batched.ok_keys() == alone.ok_keys() and len(batched.ok_keys()) == len(jobs)
        for g, w in zip(got, want):
            for k in ("text", "prompt_tokens", "question_steps", "cache_len", "evicted_steps", "evicted"):
                assert g[k] == w[k], k
        assert needle_results(tiny_teacher, jobs, batched, setting, batch=3) == got      # reused, not recomputed
        assert len(batched.ok_keys()) == len(jobs)


def test_evict_prompts_below_the_committed_size_writes_under_reduced(monkeypatch, tmp_path):
    """`kvlab all --evict-prompts N` runs the eviction study on fewer prompts than its committed tables: it writes under
    OUT/reduced and leaves OUT's tables alone; without the option it writes to OUT itself."""
    from kvlab import cli
    from kvlab.harness import cli_common
    from kvlab.studies.eviction import cli as evict_cli
    from kvlab.studies.eviction import tables as evict_tables_mod

    seen = []
    monkeypatch.setattr(cli_common, "pair", lambda a: (None, None))
    monkeypatch.setattr(evict_tables_mod, "evict_tables", lambda t, s, spec, *a, **k: seen.append(len(spec.prompts)) or {})
    monkeypatch.setattr(evict_tables_mod, "write_evict", lambda tables, out: seen.append(out) or [])
    for extra, where in ((["--evict-prompts", "5"], tmp_path / "o" / "reduced"), ([], tmp_path / "o")):
        args = cli.build_parser().parse_args(["all", "--prompts", "8", "--out", str(tmp_path / "o"), *extra])
        evict_cli.cmd_evict(args)
        assert seen[-2:] == [5 if extra else 8, where]
    assert not (tmp_path / "o").exists()                   # nothing was written (the writers were stubbed)
