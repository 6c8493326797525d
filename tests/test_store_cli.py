"""Run store reuse and CLI input validation."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab.store import provenance
from kvlab.core.data import load_prompts
from kvlab.store import RunStore, default_root


def test_store_reuses_finished_runs(tmp_path):
    store = RunStore(tmp_path)
    calls = []
    cfg = {"a": 1, "b": [1, 2]}
    assert store.get_or_run(cfg, lambda: calls.append(1) or {"x": 3}) == {"x": 3}
    assert store.get_or_run(cfg, lambda: calls.append(1) or {"x": 4}) == {"x": 3}
    assert calls == [1] and len(store) == 1
    assert store.stats.reused == 1 and store.stats.computed == 1 and store.stats.replaced == 0
    (tmp_path / "traces" / f"{store.key(cfg)}.parquet").write_text("{torn")     # a killed write: missing
    assert store.get(cfg) is None


def test_stored_runs_carry_code_version_commit_and_machine(tmp_path):
    store = RunStore(tmp_path)
    key = store.put({"a": 1}, {"x": 1})
    meta = store.stored(key).meta
    assert meta["code_version"] == provenance.CODE_VERSION
    assert meta["git_commit"] == provenance.git_commit()
    assert meta["machine"] == provenance.machine() and meta["machine_key"] == provenance.machine_key()
    row = store.load().iloc[0]
    assert row.run_key == key and row.code_version == provenance.CODE_VERSION and row.status == "ok"


def test_code_version_change_makes_runs_stale(tmp_path, monkeypatch):
    store = RunStore(tmp_path)
    cfg = {"a": 1}
    store.get_or_run(cfg, lambda: {"x": "old"})
    old_key = store.key(cfg)
    monkeypatch.setattr(provenance, "CODE_VERSION", provenance.CODE_VERSION + "-next")
    assert store.key(cfg) != old_key                       # the code version is part of the key
    assert store.get(cfg) is None and len(store) == 0
    assert store.get_or_run(cfg, lambda: {"x": "new"}) == {"x": "new"}
    assert store.stats.computed == 2 and store.stats.replaced == 1
    assert len(store) == 1 and len(list(store.records())) == 2   # the old run stays readable
    assert [r.current for r in store.records()].count(True) == 1
    assert list(store) == [(cfg, {"x": "new"})]


def test_a_run_timed_on_another_machine_is_recomputed_in_place(tmp_path, monkeypatch):
    store = RunStore(tmp_path)
    cfg = {"a": 1}
    store.get_or_run(cfg, lambda: {"x": "there"})
    monkeypatch.setattr(provenance, "machine_key", lambda: "other-host")
    assert store.get(cfg) is None and store.get(cfg, any_machine=True) == {"x": "there"}
    assert store.get_or_run(cfg, lambda: {"x": "here"}) == {"x": "here"}
    assert store.stats.replaced == 1 and len(store.load()) == 1 == len(store)     # one key, one row


def test_old_json_files_are_read_never_reused(tmp_path):
    from kvlab.store import read_json_runs

    cfg = {"a": 1}
    (tmp_path / "abc.json").write_text(json.dumps({"config": cfg, "result": {"x": 0}}))
    (rec,) = read_json_runs(tmp_path)
    assert rec == (cfg, {"x": 0}, {})
    store = RunStore(tmp_path)
    assert store.get(cfg) is None and store.import_json() == 0      # no meta: not this code version


def test_default_store_is_the_projects_not_the_cwd(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_RUNS", raising=False)
    monkeypatch.chdir(tmp_path)
    root = provenance.source_root()
    if root is not None:          # running from a checkout (always, for these tests)
        assert default_root() == root / "runs" and RunStore().root == root / "runs"
    monkeypatch.setenv("KVLAB_RUNS", str(tmp_path / "elsewhere"))
    assert RunStore().root == tmp_path / "elsewhere"


def test_prompt_files(tmp_path):
    rows = load_prompts()
    assert len(rows) >= 50 and all(r["prompt"].strip() for r in rows)
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "one"}) + "\n\n" + json.dumps({"prompt": "two", "x": 1}) + "\n")
    assert [r["prompt"] for r in load_prompts(f)] == ["one", "two"]
    with pytest.raises(ValueError, match="n="):
        load_prompts(f, n=3)
    f.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_prompts(f)
    with pytest.raises(FileNotFoundError, match="prompts_file"):
        load_prompts(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("args, needle", [
    (["baselines", "--prompts", "0"], "--prompts must be a positive integer"),
    (["baselines", "--tokens", "-5"], "--tokens must be a positive integer"),
    (["baselines", "--temperature", "-1"], "temperature"),
    (["baselines", "--top-p", "0"], "top_p"),
    (["baselines", "--prompts-file", "/nope.jsonl"], "prompts_file"),
    (["baselines", "--student-ratio", "1.5"], "--student-ratio=1.5 must be in [0, 1)"),
    (["refresh", "--student-ratio", "-0.1"], "--student-ratio"),
    (["baselines", "--device", "tpu9"], "--device/--dtype"),
    (["baselines", "--dtype", "int3"], "--device/--dtype"),
    (["mc-real", "--student", "/nope/model"], "--student: "),
])
def test_cli_rejects_bad_input_before_work(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlab", *args, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert needle in r.stderr
    assert not any(tmp_path.iterdir())   # nothing written


@pytest.mark.parametrize("argv", [
    ["baselines", "--student-ratio", "1.0"],
    ["all", "--student-ratio", "nan"],
    ["refresh", "--student-ratio", "0.5", "--student", "HuggingFaceTB/x"],
    ["baselines", "--teacher", "./no-such-folder"],
])
def test_cli_validates_model_args_before_any_model_loads(argv, tmp_path, monkeypatch, capsys):
    import kvlab.core.models as models
    import kvlab.train.pair as pair
    from kvlab import cli

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were validated")

    for name in ("load_teacher", "load_model"):
        monkeypatch.setattr(models, name, boom)
    for name in ("load_pair", "load_student"):
        monkeypatch.setattr(pair, name, boom)
    assert cli.main([*argv, "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]) == 2
    assert "error: --" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()


def test_cli_reports_reused_and_computed_runs(tmp_path, monkeypatch, capsys, tiny_teacher, tiny_student):
    from kvlab import cli
    from kvlab.harness import cli_common

    monkeypatch.setattr(cli_common, "pair", lambda args, **kw: (tiny_teacher, tiny_student))
    monkeypatch.setattr(cli_common, "alone_student", lambda args, student: student)   # the Student row: the tiny student too
    argv = ["baselines", "--prompts", "2", "--tokens", "4", "--out", str(tmp_path / "out"),
            "--runs", str(tmp_path / "runs"), "--no-progress"]
    assert cli.main(argv) == 0
    # 6 runs + 2 teacher references + 6 teacher-forced scores (kvlab.harness.forced)
    assert f"run store {tmp_path / 'runs'}: 0 reused, 14 computed" in capsys.readouterr().out
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "14 reused, 0 computed" in out
    md = (tmp_path / "out" / "baselines.md").read_text()
    assert "`kl`: mean KL(p_T‖q) in nats over the steps whose token the student chose" in md
    assert "`kl_all`" in md and f"kvlab code {provenance.CODE_VERSION}, commit " in md
