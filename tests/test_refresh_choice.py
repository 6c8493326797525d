"""``python -m kvlab refresh --policy ...``: a policy and its parameters, validated before any model loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.refresh.policies import EntropyGate, MCGate, Periodic, ProbeKL, Speculative
from kvlab.studies.refresh.choice import _build, policy_choice


@pytest.mark.parametrize("policy, kw, expected", [
    ("entropy", {"tau": 6.5}, EntropyGate(6.5)),
    ("periodic", {"T": 32, "W": 16}, Periodic(32, 16)),
    ("speculative", {"k": 8}, Speculative(8)),
    ("probe-kl", {"M": 8, "kappa": 0.5}, ProbeKL(8, 0.5)),
    ("mc", {"threshold": 0.2, "signal": "flip", "passes": 4}, MCGate(0.2, signal="flip", n_passes=4)),
])
def test_choice_builds_the_policy(policy, kw, expected):
    choice = policy_choice(policy, None, **kw)
    assert _build(choice) == expected and choice.refresh_next == "rerun"


def test_choice_label_names_every_parameter():
    assert policy_choice("periodic", "teacher", T=32, W=16).label == "periodic_T32_W16_next-teacher"
    assert policy_choice("entropy", None, tau=6.5).label == "entropy_tau6.5"
    assert policy_choice(None, None) is None          # no --policy: the full table run


@pytest.mark.parametrize("policy, nxt, kw, needle", [
    (None, None, {"tau": 6.5}, "--tau need(s) --policy"),
    (None, "teacher", {}, "--refresh-next need(s) --policy"),
    ("nope", None, {}, "--policy 'nope' must be one of"),
    ("periodic", None, {}, "--policy periodic needs --T"),
    ("periodic", None, {"T": 0}, "--T (T=0) must be a positive int"),
    ("periodic", None, {"T": 8, "tau": 1.0}, "--tau do(es) not apply to --policy periodic"),
    ("entropy", None, {"tau": -1.0}, "--tau (tau_bits=-1.0) must be"),
    ("entropy", None, {"tau": 1.0, "tau_percentile": 95.0}, "give only one of --tau, --tau-percentile"),
    ("entropy", None, {"tau_percentile": 100.0}, "--tau-percentile=100.0 must lie in (0, 100)"),
    ("probe-kl", None, {"M": 8}, "needs --kappa or --kappa-percentile"),
    ("speculative", "sometimes", {"k": 8}, "--refresh-next 'sometimes' must be one of"),
    ("mc", None, {"threshold": 0.1, "signal": "x"}, "--signal (signal='x')"),
    ("mc", None, {"threshold": 0.1, "dropout": 1.0}, "--dropout (p=1.0)"),
    ("mc", None, {"threshold": 0.1, "passes": 1}, "--passes (n_passes=1)"),
])
def test_choice_rejects_bad_input(policy, nxt, kw, needle):
    with pytest.raises(ValueError) as e:
        policy_choice(policy, nxt, **kw)
    assert needle in str(e.value)


@pytest.mark.parametrize("args, needle", [
    (["refresh", "--policy", "entropy"], "--policy entropy needs --tau or --tau-percentile"),
    (["refresh", "--policy", "periodic", "--T", "32", "--W", "0"], "--W (W=0) must be a positive int"),
    (["refresh", "--T", "32"], "--T need(s) --policy"),
    (["refresh", "--policy", "periodic", "--T", "8", "--refresh-next", "nobody"], "--refresh-next 'nobody'"),
    (["refresh", "--timing-repeats", "-1"], "--timing-repeats=-1 must be >= 0"),
    (["refresh", "--rebuild-student-cache"], "--rebuild-student-cache cannot be used with refresh"),
])
def test_refresh_cli_rejects_bad_policy_before_work(args, needle, tmp_path, capsys, monkeypatch):
    from kvlab import cli
    from kvlab.harness import cli_common

    monkeypatch.setattr(cli_common, "pair", lambda a, **kw: pytest.fail("models loaded before validation"))
    assert cli.main([*args, "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]) == 2
    assert needle in capsys.readouterr().err
    assert not any(tmp_path.iterdir())   # nothing written


def test_incompatible_pair_error_names_the_cli_flag():
    from kvlab.core.compat import Compat, IncompatiblePairError, Mismatch

    err = IncompatiblePairError(Compat((Mismatch("num_key_value_heads", 2, 4),)))
    assert "--rebuild-student-cache" in str(err) and "rebuild_student_cache=True" in str(err)


def test_rebuild_flag_reaches_overfill(monkeypatch, tmp_path):
    """--rebuild-student-cache turns on DecodeConfig.rebuild_student_cache for the OverFill baseline."""
    from kvlab.studies.baselines import table as b
    from kvlab import cli
    from kvlab.harness import cli_common

    seen = {}

    def fake_run_policies(teacher, student, spec, policies, store, progress):
        seen.update({k: v.rebuild_student_cache for k, v in policies.items()})
        raise ValueError("stop here")

    monkeypatch.setattr(cli_common, "pair", lambda a, **kw: (None, None))
    # the Student row's model is the OverFill student here: no trained standalone student is loaded (or trained)
    monkeypatch.setattr(cli_common, "alone_student", lambda a, student: student)
    monkeypatch.setattr(b, "run_policies", fake_run_policies)
    assert cli.main(["baselines", "--prompts", "1", "--tokens", "4", "--rebuild-student-cache",
                     "--out", str(tmp_path / "o"), "--runs", str(tmp_path / "r")]) == 2
    assert seen == {"teacher": False, "overfill": True, "student": False}


@pytest.mark.parametrize("policy, kw, nxt", [("entropy", {"tau_percentile": 50.0}, None),
                                             ("periodic", {"T": 4, "W": 2}, "teacher"),
                                             ("mc", {"threshold": 0.0, "probe_every": 4, "refractory": 2,
                                                     "passes": 2}, None)])
def test_single_policy_tables_on_tiny_pair(tiny_teacher, tiny_student, tmp_path, policy, kw, nxt):
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec
    from kvlab.studies.refresh.choice import single_policy_tables
    from kvlab.studies.refresh.tables import write_refresh
    from kvlab.store import RunStore

    samp = Sampling(0.7, 0.9, 0)
    spec = RunSpec(prompts=("hello there", "a b c d"), tokens=12, sampling=samp)
    calib = RunSpec(prompts=("calib one",), tokens=12, sampling=samp)
    choice = policy_choice(policy, nxt, **kw)
    tabs = single_policy_tables(tiny_teacher, tiny_student, spec, RunStore(tmp_path / "runs"), calib, choice,
                                progress=False, timing_prompts=1, timing_repeats=2)
    q = tabs[f"refresh_{choice.label}"].set_index("policy")
    assert list(q.index) == ["none", choice.label]
    assert q.loc[choice.label, "refreshes"] > 0                     # the chosen policy really ran
    assert {"d_kl", "d_kl_lo", "d_kl_hi"} <= set(q.columns)
    if policy == "entropy":
        assert q.loc[choice.label, "tau_bits"] >= 0                # calibrated from the percentile
    t = tabs[f"refresh_{choice.label}_timing"].set_index("policy")
    assert list(t.index) == ["none", choice.label] and (t["pairs"] == 2).all()
    paths = write_refresh(tabs, tmp_path)
    assert (tmp_path / f"refresh_{choice.label}_timing.md").read_text().startswith("Overhead % = median")
    assert all(p.is_file() for p in paths)


def test_all_with_rebuild_flag_skips_the_jobs_that_splice(monkeypatch, capsys):
    """`all --rebuild-student-cache` runs what works with a differing KV geometry and says what it skipped."""
    from kvlab import cli

    ran = []
    jobs = [(name, (lambda n: (lambda args: ran.append(n) or []))(name)) for name, _ in cli.JOBS]
    monkeypatch.setattr(cli, "JOBS", jobs)
    monkeypatch.setattr(cli, "cmd_figures", lambda args: [])
    monkeypatch.setattr(cli, "cmd_docs", lambda args: [])     # the docs step rewrites README.md: not in a test
    args = cli.build_parser().parse_args(["all", "--rebuild-student-cache", "--jobs", "1"])
    cli.cmd_all(args)
    assert "baselines" in ran and not set(ran) & set(cli.NEEDS_SAME_GEOMETRY)
    out = capsys.readouterr().out
    assert all(f"== {n}: skipped (--rebuild-student-cache" in out for n in cli.NEEDS_SAME_GEOMETRY)
    ran.clear()
    cli.cmd_all(cli.build_parser().parse_args(["all", "--jobs", "1", "--short-studies"]))
    assert ran == [n for n, _ in jobs]
    assert ran[0] == "train" and ran[-1] == "train-study"     # the main job trains what is missing, then compares


def test_all_leaves_the_short_studies_to_their_flag(monkeypatch, capsys):
    """`make figures` (`all` without --short-studies) runs every job but the short-context refresh and eviction studies,
    and says which it left (their committed tables stay); --short-studies runs them in their place in the order."""
    from kvlab import cli

    ran = []
    jobs = [(name, (lambda n: (lambda args: ran.append(n) or []))(name)) for name, _ in cli.JOBS]
    monkeypatch.setattr(cli, "JOBS", jobs)
    monkeypatch.setattr(cli, "cmd_figures", lambda args: [])
    monkeypatch.setattr(cli, "cmd_docs", lambda args: [])
    assert set(cli.SHORT_STUDIES) == {"refresh", "evict"} and set(cli.SHORT_STUDIES) <= {n for n, _ in jobs}
    cli.cmd_all(cli.build_parser().parse_args(["all"]))
    assert ran == [n for n, _ in jobs if n not in cli.SHORT_STUDIES]
    out = capsys.readouterr().out
    assert all(f"== {n}: not run (a short-context study" in out and f"python -m kvlab {n}" in out
               for n in cli.SHORT_STUDIES)
    ran.clear()
    cli.cmd_all(cli.build_parser().parse_args(["all", "--short-studies", "--jobs", "1"]))
    assert ran == [n for n, _ in jobs]


def test_all_jobs_side_by_side_in_worker_processes(tmp_path):
    """`all --jobs 2`: jobs run in spawned worker processes (one thread each), each result comes back with its
    paths and seconds, and a failing job's error reaches the caller."""
    from kvlab import cli

    args = cli.build_parser().parse_args(["all", "--out", str(tmp_path), "--jobs", "2"])
    assert args.jobs == 2 and cli.build_parser().parse_args(["all"]).jobs == 1        # default: one after another
    got = list(cli._run_parallel(["mc-sim", "mc-sim"], args, 2, 1))     # the cheap real job, twice
    assert [g[0] for g in got] == ["mc-sim", "mc-sim"]
    assert all(g[2] > 0 and g[1] and all(Path(p).is_file() for p in g[1]) for g in got)
    with pytest.raises(KeyError, match="no-such-job"):
        list(cli._run_parallel(["no-such-job"], args, 2, 1))
    assert cli.JOB_MINUTES.keys() <= {n for n, _ in cli.JOBS}       # the longest-first order names real jobs


def test_all_skips_the_short_passkey_grid_and_times_once_unless_asked():
    """make figures' size: `all` runs the evict job without the 256-1,024-token passkey grid (its committed table
    is `python -m kvlab evict`'s; `--needle` brings it back) and one paired overhead timing per policy; the
    evict and refresh commands keep theirs."""
    from kvlab import cli

    p = cli.build_parser()
    a = p.parse_args(["all"])
    assert a.no_needle is True and a.timing_repeats == 1
    assert p.parse_args(["all", "--needle"]).no_needle is False
    assert p.parse_args(["all", "--no-needle"]).no_needle is True
    assert p.parse_args(["evict"]).no_needle is False and p.parse_args(["refresh"]).timing_repeats == 2
