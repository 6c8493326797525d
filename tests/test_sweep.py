"""Sweeps: grid specs, the results table, resume/faults, engines (local, processes, Ray), tables
from results. Everything runs on tiny random models (``[models] kind = "tiny"``)."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest

from kvlab.store.results import CodeVersionMismatch, Store, load
from kvlab.sweep import SpecError, load_spec, parse_spec, run_sweep
from kvlab.sweep.task import execute

QUALITY = ["tokens", "teacher_ppl", "kl", "repeat3", "tail_logprob", "refreshes", "teacher_tokens", "spliced",
           "text", "max_delta"]


def grid(**over) -> dict:
    g = {"name": "t", "prompts": {"count": 2}, "run": {"modes": ["teacher", "student", "overfill"], "tokens": 6},
         "models": {"kind": "tiny"}, "refresh": {"periodic": {"T": [2, 4]}}}
    for k, v in over.items():
        g[k] = {**g[k], **v} if isinstance(v, dict) and isinstance(g.get(k), dict) else v
    return g


def quality(df: pd.DataFrame) -> pd.DataFrame:
    return df.sort_values("run_key").reset_index(drop=True)[["run_key", "policy", "seed", *QUALITY]]


# Rows made by different engines agree exactly on what is discrete (tokens, text, counts) and within float
# noise on what is reduced: an in-process run and a 1-CPU worker use different thread counts, so torch sums
# the same fp32 terms in a different order (measured: kl 1.7e-8 vs -9.0e-8 on an AMD EPYC). 1e-5 relative /
# 1e-6 absolute is ~100x that noise and far below any difference a policy makes.
FLOAT_RTOL, FLOAT_ATOL = 1e-5, 1e-6


def assert_same_rows(a: pd.DataFrame, b: pd.DataFrame) -> None:
    qa, qb = quality(a), quality(b)
    floats = [c for c in qa.columns if pd.api.types.is_float_dtype(qa[c])]
    pd.testing.assert_frame_equal(qa.drop(columns=floats), qb.drop(columns=floats))       # exact
    pd.testing.assert_frame_equal(qa[floats], qb[floats], check_exact=False, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


# --------------------------------------------------------------------------- spec


def test_spec_expands_families_ranges_and_pairs_seeds():
    s = parse_spec(grid(refresh={"periodic": {"T": [2, 4]}, "entropy": {"tau_bits": {"start": 4, "stop": 5, "step": 0.5}},
                                 "speculative": {"k": {"start": 2, "stop": 8, "num": 3}}},
                        run={"refresh_next": ["rerun", "teacher"], "repeats": 2}))
    pols = [c.policy for c in s.configs()]
    assert pols[:3] == ["teacher", "student", "overfill"]
    assert "periodic_T2" in pols and "periodic_T4_teacher" in pols and "entropy_tau_bits4.5" in pols
    assert {p for p in pols if p.startswith("speculative")} == {"speculative_k2", "speculative_k5", "speculative_k8",
                                                                "speculative_k2_teacher", "speculative_k5_teacher",
                                                                "speculative_k8_teacher"}
    assert len(pols) == 3 + 2 * (2 + 3 + 3) == len(set(pols))
    tasks = s.tasks()
    assert len(tasks) == len(pols) * 2 * 2 == len({t.task_id for t in tasks})
    # paired seeds: prompt i / repeat r gets the same seed under every config, and r=0 matches RunSpec
    seeds = {(t.prompt_idx, t.repeat): set() for t in tasks}
    for t in tasks:
        seeds[(t.prompt_idx, t.repeat)].add(t.decode.sampling.seed)
    assert seeds == {(0, 0): {0}, (1, 0): {1}, (0, 1): {10000}, (1, 1): {10001}}
    # ids are stable across parses and change with what a run means
    assert [t.task_id for t in parse_spec(grid()).tasks()] == [t.task_id for t in parse_spec(grid()).tasks()]
    assert not {t.task_id for t in parse_spec(grid()).tasks()} & {t.task_id for t in parse_spec(grid(run={"tokens": 7})).tasks()}


@pytest.mark.parametrize("over, key", [
    ({"bogus": 1}, "'bogus'"),
    ({"run": {"mode": ["overfill"]}}, "'run.mode'"),
    ({"run": {"modes": ["overfil"]}}, "'run.modes'"),
    ({"run": {"modes": []}}, "'run.modes'"),
    ({"run": {"tokens": 0}}, "'run.tokens'"),
    ({"run": {"modes": ["teacher"]}}, "'refresh'"),           # refresh families without overfill
    ({"refresh": {"periodc": {"T": 4}}}, "'refresh.periodc'"),
    ({"refresh": {"periodic": {"T": 4, "X": 1}}}, "'refresh.periodic.X'"),
    ({"refresh": {"periodic": {"W": 4}}}, "needs T"),
    ({"refresh": {"periodic": {"T": [4, 0]}}}, "T=0"),
    ({"refresh": {"entropy": {"tau_bits": {"start": 4, "stop": 2, "step": 1}}}}, "'refresh.entropy.tau_bits.step'"),
    ({"sampling": {"top_p": 0}}, "'sampling.top_p'"),
    ({"models": {"kind": "huge"}}, "'models.kind'"),
    ({"prompts": {"count": 10_000}}, "'prompts.count'"),
])
def test_bad_specs_name_the_key(over, key):
    with pytest.raises(SpecError) as e:
        parse_spec(grid(**over))
    assert key in str(e.value)


def test_prompt_file_without_prompt_field(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"text": "no prompt"}) + "\n")
    spec = tmp_path / "g.toml"
    spec.write_text('[prompts]\nfile = "p.jsonl"\ncount = 1\n[run]\nmodes = ["student"]\n[models]\nkind = "tiny"\n')
    with pytest.raises(SpecError, match="prompts.file.*prompt"):
        load_spec(spec)
    f.write_text(json.dumps({"prompt": "hello there"}) + "\n")      # relative to the spec file
    assert load_spec(spec).prompts == ("hello there",)


def test_cli_flags_build_the_same_grid():
    from kvlab.cli import build_parser
    from kvlab.sweep.command import spec_from_args

    args = build_parser().parse_args(["sweep", "--modes", "teacher", "student", "overfill", "--tokens", "6",
                                      "--prompts", "2", "--models", "tiny", "--refresh", "periodic T=2,4"])
    assert [t.task_id for t in spec_from_args(args).tasks()] == [t.task_id for t in parse_spec(grid()).tasks()]
    args = build_parser().parse_args(["sweep", "--modes", "overfill", "--models", "tiny", "--prompts", "1",
                                      "--refresh", "entropy tau_bits=4..6:0.5"])
    assert [c.policy for c in spec_from_args(args).configs()] == [
        "overfill", "entropy_tau_bits4", "entropy_tau_bits4.5", "entropy_tau_bits5", "entropy_tau_bits5.5",
        "entropy_tau_bits6"]


# --------------------------------------------------------------------------- the student axis


def test_student_axis_defaults_old_key_and_flags():
    from kvlab.cli import build_parser
    from kvlab.core.models import DEFAULT_SHAPE, DEFAULT_VARIANT
    from kvlab.sweep.command import spec_from_args
    from kvlab.sweep.students import StudentChoice

    emb = {"prompts": {"count": 1}, "run": {"modes": ["overfill"], "tokens": 6}}
    assert parse_spec(emb).students == (StudentChoice(DEFAULT_VARIANT, DEFAULT_SHAPE.replace("-", ",")),)   # trained
    assert parse_spec(grid()).students == (StudentChoice("pruned", "i0.30"),)       # tiny: the untrained one
    s = parse_spec({**emb, "run": {**emb["run"], "student": ["pruned", "overfill"], "prune": ["h0.2,i0.5", "i0.3"]}})
    assert [c.label for c in s.students] == ["pruned h0.20,i0.50", "pruned i0.30", "overfill h0.20,i0.50",
                                             "overfill i0.30"]
    assert len(s.configs()) == 4 and len({t.task_id for t in s.tasks()}) == 4     # one task per student
    cols = s.configs()[2].columns()
    assert (cols["student"], cols["prune"], cols["student_ratio"]) == ("overfill", "h0.20,i0.50", 0.5)
    # an old spec's student_ratio still means the untrained student at that MLP ratio (same runs as before)
    old = parse_spec({**emb, "run": {**emb["run"], "student_ratio": [0.3, 0.5]}})
    assert old.students == (StudentChoice("pruned", "i0.30"), StudentChoice("pruned", "i0.50"))
    args = build_parser().parse_args(["sweep", "--modes", "overfill", "--tokens", "6", "--prompts", "1",
                                      "--student", "pruned", "overfill", "--prune", "h0.2,i0.5", "i0.3"])
    assert [t.task_id for t in spec_from_args(args).tasks()] == [t.task_id for t in s.tasks()]
    args = build_parser().parse_args(["sweep", "--modes", "overfill", "--tokens", "6", "--prompts", "1",
                                      "--student-ratio", "0.3", "0.5"])
    assert [t.task_id for t in spec_from_args(args).tasks()] == [t.task_id for t in old.tasks()]


@pytest.mark.parametrize("run, models, key, says", [
    ({"student": "overfil"}, {}, "'run.student'", "refresh-aware"),
    ({"prune": "h0.2;i9"}, {}, "'run.prune'", "h0.45,i0.45"),
    ({"student_ratio": 0.3, "prune": "i0.3"}, {}, "'run.student_ratio'", "give only run.prune"),
    ({"student_ratio": 0.3, "student": "overfill"}, {}, "'run.student_ratio'", "--prune"),
    ({"student_ratio": 1.2}, {}, "'run.student_ratio'", "--student pruned --prune"),
    ({"student": "overfill"}, {"kind": "tiny"}, "'run.student'", "only 'pruned'"),
    ({"prune": "h0.2,i0.3"}, {"kind": "tiny"}, "'run.prune'", "MLP only"),
    ({"prune": "i0.3"}, {"student": "org/model"}, "'run.prune'", "models.student"),
])
def test_bad_student_axis_names_the_key(run, models, key, says):
    with pytest.raises(SpecError) as e:
        parse_spec({"prompts": {"count": 1}, "run": {"modes": ["overfill"], **run}, "models": models})
    assert key in str(e.value) and says in str(e.value)


def test_a_missing_trained_student_fails_before_any_worker(tmp_path, monkeypatch, capsys):
    """A sweep never trains: a trained student the model cache lacks stops it before an engine starts,
    naming the train-student command (the CLI too, dry run included)."""
    from kvlab import cli
    from kvlab.sweep import runner

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))          # an empty model cache
    started = []
    monkeypatch.setattr(runner, "make_engine", lambda *a, **k: started.append(a) or pytest.fail("engine started"))
    spec = parse_spec({"prompts": {"count": 1}, "run": {"modes": ["overfill"], "tokens": 6,
                                                       "student": ["pruned", "refresh-aware"], "prune": "h0.2,i0.5"}})
    with pytest.raises(FileNotFoundError) as e:
        run_sweep(spec, engine="ray", store=tmp_path / "runs", progress=False)
    msg = str(e.value)
    assert "python -m kvlab train-student --student refresh-aware --prune h0.20,i0.50" in msg
    assert "'pruned'" in msg and not started and not (tmp_path / "runs").exists()
    assert not (tmp_path / "cache").exists()                             # nothing was built or trained
    for extra in ([], ["--dry-run"]):
        rc = cli.main(["sweep", "--modes", "overfill", "--prompts", "1", "--student", "overfill", "--engine", "ray",
                       "--runs", str(tmp_path / "runs"), "--no-progress", *extra])
        assert rc == 2 and not started and not (tmp_path / "runs").exists()
        assert "python -m kvlab train-student --student overfill --prune" in capsys.readouterr().err


def _poisoned_loader(models, student):
    from kvlab.sweep.task import load_models

    if student.shape == "i0.50":
        raise OSError("poisoned weights for i0.50")
    return load_models(models, student)


def test_a_pair_that_fails_to_load_fails_only_its_tasks(tmp_path):
    """Two students; one does not load: its tasks become error rows naming the failure, the other's run.
    Once it loads, its error rows are gone and its runs are stored. Rows say which student made them."""
    from kvlab.sweep.engines import LocalEngine
    from kvlab.sweep.tables import config_summary
    from kvlab.sweep.task import PairCache

    spec = parse_spec(grid(run={"modes": ["overfill"], "prune": ["i0.3", "i0.5"]}))
    n = len(spec.tasks())
    rep = run_sweep(spec, store=tmp_path, progress=False, engine_obj=LocalEngine(pairs=PairCache(_poisoned_loader)))
    assert (rep.done, rep.errors) == (n, n // 2)
    df = load(tmp_path)
    assert len(df) == n and set(df.sweeps) == {("t",)}
    bad, ok = df[df.status == "error"], df[df.status == "ok"]
    assert set(bad.prune) == {"i0.50"} and set(ok.prune) == {"i0.30"} and set(df.student) == {"pruned"}
    assert bad.error.str.contains("OSError: poisoned weights for i0.50").all() and (ok.tokens == 6).all()
    assert bad.traceback.str.contains("_poisoned_loader").all()
    Store(tmp_path).compact()                      # the error rows now live in a compacted part
    rep = run_sweep(spec, store=tmp_path, progress=False, engine_obj=LocalEngine(pairs=PairCache()))
    assert (rep.skipped, rep.done, rep.errors) == (n // 2, n // 2, 0)
    df = load(tmp_path)
    assert len(df) == n and (df.status == "ok").all() and set(df.prune) == {"i0.30", "i0.50"}
    s = config_summary(df)
    assert len(s) == len(spec.configs()) and set(s.prune) == {"i0.30", "i0.50"}        # students kept apart
    assert s.groupby("prune").kl.mean().nunique() == 2


def test_rows_name_the_embedded_student_from_its_fingerprint():
    from kvlab.store.rows import config_columns
    from kvlab.train.config import TRAINED_VARIANTS
    from kvlab.train.weights import trained_name

    for v in TRAINED_VARIANTS:
        row = config_columns({"kind": "decode", "teacher": "t@1", "student": trained_name(v, "h0.2,i0.5") + "@ab12",
                              "prompt": "p", "decode": {"mode": "overfill"}})
        assert (row["student"], row["prune"], row["student_ratio"]) == (v, "h0.20,i0.50", 0.5)
    row = config_columns({"kind": "decode", "teacher": "t@1", "student": "tiny-1-67@ab", "prompt": "p",
                          "decode": {"mode": "overfill"}})
    assert row["student"] is None and row["prune"] is None


# --------------------------------------------------------------------------- the store: concurrency, layout


def _fake_run(i, **extra):
    return {"kind": "fake", "i": i, **extra}, {"v": float(i), "steps": {"token_id": [1, 2]}}


def test_store_concurrent_writers_never_duplicate_or_corrupt(tmp_path):
    store = Store(tmp_path)
    errors = []

    def writer(w):
        try:
            for i in range(40):
                store.put(*_fake_run(i % 25), tags=[f"s{w}"], extra={"writer": w})
                if w == 0 and i % 10 == 0:
                    store.compact()          # compaction beside running writers
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    df = load(tmp_path)
    keys = sorted(store.key(_fake_run(i)[0]) for i in range(25))
    assert sorted(df.run_key) == keys                             # every run once
    assert all(t == ("s0", "s1", "s2") for t in df.sweeps)         # every writer's tag kept
    assert len(load(tmp_path, sweep="s1")) == 25 and not len(load(tmp_path, sweep="nope"))
    assert not list(tmp_path.rglob("*.tmp"))
    store.compact()
    assert sorted(load(tmp_path, compact=False).run_key) == keys and not list((tmp_path / "rows").glob("*.parquet"))
    assert store.trace(keys[3])["token_id"].tolist() == [1, 2]
    assert store.get(_fake_run(3)[0]) == _fake_run(3)[1]
    with pytest.raises(FileNotFoundError, match="run_key='nope'"):
        store.trace("nope")


def test_compaction_survives_columns_of_mixed_kinds(tmp_path):
    store = Store(tmp_path)
    store.put(*_fake_run(0, x=None, y=None))
    store.put(*_fake_run(1, x=8, y="sum"))
    store.put(*_fake_run(2, x=4.5, y=3))
    store.compact()
    df = load(tmp_path).set_index("i")
    assert df.loc[1, "x"] == 8 and df.loc[2, "x"] == 4.5 and df.loc[1, "y"] == "sum" and df.loc[2, "y"] == "3"


def test_old_json_runs_migrate_into_the_store(tmp_path):
    from kvlab.store import provenance

    old = tmp_path / "old"
    old.mkdir()
    cfg, res = _fake_run(7)
    meta = provenance.stamp()
    (old / "a.e1.json").write_text(json.dumps({"config": cfg, "result": res, "meta": meta}))
    (old / "b.json").write_text(json.dumps({"config": _fake_run(8)[0], "result": res}))     # no meta: other code
    (old / "c.json").write_text("{torn")
    store = Store(tmp_path / "runs")
    assert store.import_json(old) == 1 and store.import_json(old) == 0
    assert store.get(cfg) == res and len(load(tmp_path / "runs")) == 1


# --------------------------------------------------------------------------- resume and faults


def _fail_periodic(task, pairs, engine, worker, calls):
    calls.append(task.task_id)
    if task.config.policy == "periodic_T2":
        raise RuntimeError("boom in a policy")
    return execute(task, pairs, engine, worker)


def _raise_inside(task, pairs, engine, worker, calls):
    calls.append(task.task_id)

    class Boom:
        def __getattr__(self, k):
            raise RuntimeError("boom in a policy")

    if task.config.policy == "periodic_T2":
        pairs = Boom()
    return execute(task, pairs, engine, worker)


def test_task_error_is_recorded_and_retried_on_rerun(tmp_path):
    spec = parse_spec(grid())
    n = len(spec.tasks())
    calls = []
    rep = run_sweep(spec, store=tmp_path, progress=False, batch=1, execute_fn=functools.partial(_raise_inside, calls=calls))
    assert rep.done == n and rep.errors == 2 and len(calls) == n
    df = load(tmp_path)
    err = df[df.status == "error"]
    assert len(df) == n and set(err.policy) == {"periodic_T2"} and err.error.str.contains("boom in a policy").all()
    assert all(t == ("t",) for t in df.sweeps)
    calls.clear()
    rep = run_sweep(spec, store=tmp_path, progress=False, batch=1, execute_fn=functools.partial(_fail_periodic, calls=calls))
    assert rep.skipped == n - 2 and rep.done == 2 == rep.errors == len(calls)   # only the error rows again
    assert len(load(tmp_path)) == n
    rep = run_sweep(spec, store=tmp_path, progress=False)
    assert (rep.skipped, rep.done) == (n - 2, 2)
    df = load(tmp_path)
    assert len(df) == n and (df.status == "ok").all() and df.run_key.is_unique
    assert run_sweep(spec, store=tmp_path, progress=False).done == 0


def _killed_after(task, pairs, engine, worker, seen, k):
    if len(seen) == k:
        raise KeyboardInterrupt        # the sweep is killed while this task is in flight
    seen.append(task.task_id)
    return execute(task, pairs, engine, worker)


def test_killed_sweep_loses_only_the_run_in_flight(tmp_path):
    spec = parse_spec(grid())
    seen = []
    with pytest.raises(KeyboardInterrupt):
        run_sweep(spec, store=tmp_path, progress=False, batch=1, execute_fn=functools.partial(_killed_after, seen=seen, k=5))
    assert len(load(tmp_path)) == 5
    rep = run_sweep(spec, store=tmp_path, progress=False)
    assert rep.skipped == 5 and rep.done == len(spec.tasks()) - 5
    assert load(tmp_path).run_key.is_unique


def _other_code(task, pairs, engine, worker):
    out = execute(task, pairs, engine, worker)
    if task.config.policy == "periodic_T4":
        out["meta"] = {**out["meta"], "code_version": "1999-01-01.old"}     # a worker running other code
    return out


def test_rows_of_another_code_version_are_refused(tmp_path):
    from kvlab.sweep.engines import LocalEngine

    spec = parse_spec(grid())
    rep = run_sweep(spec, store=tmp_path, progress=False, batch=1, execute_fn=_other_code)
    assert rep.errors == 2
    df = load(tmp_path)
    bad = df[df.policy == "periodic_T4"]
    assert (bad.status == "error").all() and bad.error.str.contains("refused a run computed by kvlab code version "
                                                                      "'1999-01-01.old'").all()
    assert not set(bad.run_key) & Store(tmp_path).ok_keys()               # nothing of it stored as a run

    class StaleWorkers(LocalEngine):
        def probe(self, models, ratio):
            return {**super().probe(models, ratio), "code_version": "1999-01-01.old"}

    calls = []
    with pytest.raises(CodeVersionMismatch, match="1999-01-01.old"):
        run_sweep(spec, store=tmp_path / "b", progress=False,
                  engine_obj=StaleWorkers(functools.partial(_fail_periodic, calls=calls)))
    assert not calls and not (tmp_path / "b").exists()                    # refused before any task ran


# --------------------------------------------------------------------------- one store for every consumer


def test_a_run_of_the_tables_is_the_sweeps_and_the_playgrounds(tmp_path):
    """A run made by a table, then asked for by a sweep and by the playground: computed once,
    one row, tagged with the sweep."""
    from kvlab.harness.experiment import RunSpec, run_policies, stored_config
    from kvlab.playground import Playground, Settings, decode_config
    from kvlab.playground.settings import sampling_of
    from kvlab.sweep.task import tiny_pair

    prompt = "the quick brown fox"
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
    s = Settings(prompt=prompt, N=6, policy="periodic", T=2, seed=5)
    samp = sampling_of(s)
    teacher, student = tiny_pair(0.3)
    store = Store(tmp_path / "runs")
    table = run_policies(teacher, student, RunSpec(prompts=(prompt,), tokens=6, sampling=samp),
                         {"periodic_T2": decode_config(s)}, store, progress=False)
    assert (store.stats.computed, store.stats.reused) == (1, 0)
    key = store.key(stored_config(teacher, student, prompt, decode_config(s)))
    spec = parse_spec(grid(prompts={"file": str(tmp_path / "p.jsonl"), "count": 1}, run={"modes": ["overfill"],
                           "tokens": 6, "baseline": False}, sampling={"temperature": samp.temperature,
                           "top_p": samp.top_p, "seed": 5}, refresh={"periodic": {"T": 2}}))
    rep = run_sweep(spec, store=store, progress=False,
                    batch=1, execute_fn=functools.partial(_fail_periodic, calls=(calls := [])))
    assert (rep.total, rep.skipped, rep.done) == (1, 1, 0) and not calls
    pg = Playground(teacher, students={0.3: student}, store=store, prompts=[prompt], calib_prompts=[prompt],
                    calib_tokens=6, settings=s, background=False)
    assert pg.key(s) == key
    pg.start()
    pg.wait(60)
    assert pg.shown.key == key and pg.shown.source == "disk" and pg.shown.result["kl"] == table.kl[0]
    rows = store.load()
    assert (rows.run_key == key).sum() == 1
    row = rows.set_index("run_key").loc[key]
    assert row.sweeps == ("t",) and row.engine == "inline" and row.policy == "periodic_T2"
    assert len(store.load(sweep="t")) == 1
    assert store.get(stored_config(teacher, student, prompt, decode_config(s))) is not None


def test_a_cpu_run_is_not_reused_for_a_gpu_request(tmp_path, monkeypatch):
    import torch

    from kvlab.harness.experiment import stored_config
    from kvlab.core.models import LM
    from kvlab.sweep.runner import key_tasks, pending

    spec = parse_spec(grid(run={"modes": ["overfill"]}, refresh={}))
    run_sweep(spec, store=tmp_path, progress=False)
    store = Store(tmp_path)
    cpu_tasks, _ = key_tasks(spec, __import__("kvlab.sweep.engines", fromlist=["x"]).LocalEngine())
    assert pending(cpu_tasks, store)[0] == []                        # on CPU: everything is stored
    monkeypatch.setattr(LM, "device", property(lambda self: torch.device("cuda")))
    monkeypatch.setattr(LM, "dtype", property(lambda self: torch.bfloat16))
    from kvlab.sweep.engines import LocalEngine
    from kvlab.sweep.task import PairCache

    gpu_tasks, probes = key_tasks(spec, LocalEngine(pairs=PairCache()))
    assert all("cuda" in p["device"] for p in probes.values())
    todo, stored = pending(gpu_tasks, store)
    assert len(todo) == len(gpu_tasks) and not stored                # a GPU request recomputes every run
    assert not {t.run_key for t in gpu_tasks} & {t.run_key for t in cpu_tasks}
    t = gpu_tasks[0]
    from kvlab.sweep.task import tiny_pair

    teacher, student = tiny_pair(0.3)
    assert store.get(stored_config(teacher, student, t.prompt, t.decode)) is None


def test_cli_end_to_end(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    base = [sys.executable, "-m", "kvlab"]
    r = subprocess.run(base + ["sweep", "--models", "tiny", "--modes", "overfill", "--refresh", "periodic T=2",
                               "--evict", "sliding window=4 sinks=1", "--prompts", "1", "--tokens", "6",
                               "--runs", str(tmp_path / "runs"), "--no-progress"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "4 tasks, 0 already stored, 4 run (0 errors)" in r.stdout
    r = subprocess.run(base + ["figures", "--from-results", "--runs", str(tmp_path / "runs"), "--out",
                               str(tmp_path / "out")], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "refresh_periodic.csv").is_file() and (tmp_path / "out" / "baselines.csv").is_file()
    configs = pd.read_csv(tmp_path / "out" / "sweep_configs.csv")
    assert set(configs.policy) == {"overfill", "periodic_T2", "sliding_window4_sinks1",      # eviction included
                                   "periodic_T2+sliding_window4_sinks1"}
    assert configs.set_index("policy").loc["sliding_window4_sinks1", "family"] == "sliding"
    bad = tmp_path / "bad.toml"
    bad.write_text('[run]\nmodes = ["overfill"]\n[refresh.periodic]\nT = 4\nZ = 1\n')
    r = subprocess.run(base + ["sweep", str(bad), "--runs", str(tmp_path / "res2")], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 2 and "refresh.periodic.Z" in r.stderr and not (tmp_path / "res2").exists()


def test_tables_from_store_rows_match_the_tables(tmp_path):
    from kvlab.studies.baselines.table import baselines
    from kvlab.harness.experiment import RunSpec
    from kvlab.sweep.tables import write_from_results
    from kvlab.sweep.task import tiny_pair

    spec = parse_spec(grid())
    run_sweep(spec, store=tmp_path / "runs", progress=False)
    store = Store(tmp_path / "runs")
    n = len(load(tmp_path / "runs"))
    teacher, student = tiny_pair(0.3)
    run_spec = RunSpec(prompts=spec.prompts, tokens=6, sampling=spec.tasks()[0].decode.sampling)
    table, _ = baselines(teacher, student, run_spec, store, progress=False, forced=False)
    assert store.stats.computed == 0 and len(load(tmp_path / "runs")) == n      # the table reused the sweep's runs
    write_from_results(load(tmp_path / "runs"), tmp_path / "out")
    from_rows = pd.read_csv(tmp_path / "out" / "baselines.csv")
    assert from_rows.policy.tolist() == ["teacher", "overfill", "student"]
    pd.testing.assert_series_equal(from_rows.teacher_ppl, table.teacher_ppl.reset_index(drop=True), check_exact=False,
                                   rtol=1e-9)
    periodic = pd.read_csv(tmp_path / "out" / "refresh_periodic.csv")
    assert periodic.policy.tolist() == ["none", "periodic_T2", "periodic_T4"] and (periodic.n_prompts == 2).all()
    assert periodic.refreshes.tolist() == [0, 2, 1]                       # N=6: T=2 fires at 2, 4; T=4 at 4
    assert (tmp_path / "out" / "baselines.png").is_file()
    assert not (tmp_path / "out" / "refresh_pareto.png").exists()       # overhead needs side-by-side timing


# --------------------------------------------------------------------------- engines


def crash_once(task, pairs, engine, worker, marker):
    """Kill the worker process the first time the second prompt of overfill runs."""
    if task.config.policy == "overfill" and task.prompt_idx == 1 and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(17)
    return execute(task, pairs, engine, worker)


def crash_always(task, pairs, engine, worker):
    """A poisoned task: kills its worker every time it runs."""
    if task.config.policy == "periodic_T2" and task.prompt_idx == 0:
        os._exit(17)
    return execute(task, pairs, engine, worker)


def test_processes_give_the_same_rows_and_survive_a_dying_worker(tmp_path):
    spec = parse_spec(grid(run={"modes": ["overfill"]}))
    run_sweep(spec, store=tmp_path / "local", progress=False)
    rep = run_sweep(spec, engine="local", workers=2, store=tmp_path / "proc", progress=False,
                    batch=1, execute_fn=functools.partial(crash_once, marker=str(tmp_path / "crashed")))
    assert (tmp_path / "crashed").exists() and rep.errors == 0
    a, b = load(tmp_path / "local"), load(tmp_path / "proc")
    assert len(b) == len(spec.tasks()) and b.run_key.is_unique and set(b.engine) == {"processes"}
    assert_same_rows(a, b)


def test_a_task_that_always_kills_its_worker_fails_alone(tmp_path):
    spec = parse_spec(grid(run={"modes": ["overfill"]}))
    rep = run_sweep(spec, engine="local", workers=2, store=tmp_path, progress=False, batch=1, execute_fn=crash_always)
    n = len(spec.tasks())
    assert (rep.done, rep.errors) == (n, 1)
    df = load(tmp_path)
    bad = df[df.status == "error"]
    assert len(df) == n and len(bad) == 1 and bad.policy.iloc[0] == "periodic_T2" and bad.seed.iloc[0] == 0
    assert "worker died 3 times running this task" in bad.error.iloc[0]
    assert (df[df.status == "ok"].tokens == 6).all() and (df.status == "ok").sum() == n - 1


def test_ray_same_rows_retried_worker_and_bad_address(tmp_path):
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from kvlab.sweep.engines import RayAddressError, RayEngine

    with pytest.raises(RayAddressError, match="127.0.0.1:9"):
        run_sweep(parse_spec(grid()), engine="ray", address="127.0.0.1:9", store=tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()

    spec = parse_spec(grid())
    run_sweep(spec, store=tmp_path / "local", progress=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = RayEngine(workers=2, num_cpus=2, execute_fn=functools.partial(crash_once, marker=str(tmp_path / "crashed")))
    try:
        rep = run_sweep(spec, store=tmp_path / "ray", progress=False, engine_obj=engine, batch=1)
    finally:
        engine.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert not ray.is_initialized()
    assert (tmp_path / "crashed").exists() and rep.errors == 0    # the dead actor's task was retried
    a, b = load(tmp_path / "local"), load(tmp_path / "ray")
    assert len(b) == len(spec.tasks()) and b.run_key.is_unique and set(b.engine) == {"ray"}
    assert b.worker.nunique() >= 2
    assert_same_rows(a, b)
    # the job carries the shipped kvlab package (a local instance's workers also see the driver's cwd)
    assert any(str(u).startswith("gcs://") for u in engine.probes[0]["py_modules"])


def test_pareto_summary(tmp_path):
    from kvlab.sweep.tables import config_summary, pareto_mask

    assert pareto_mask([0, 1, 2, 1], [3, 1, 0.5, 2]).tolist() == [True, True, True, False]
    spec = parse_spec(grid())
    run_sweep(spec, store=tmp_path, progress=False)
    s = config_summary(load(tmp_path)).set_index("policy")
    assert list(s.index) == [c.policy for c in spec.configs()] and (s.n_runs == 2).all()
    assert "overhead_pct" not in s.columns       # no latency ratio across separately timed rows (it would measure the machine)
    assert s.loc["overfill", "teacher_pct"] == 0 and s.loc["periodic_T2", "teacher_pct"] > 0 and s.loc["teacher", "teacher_tokens_per_token"] == 5 / 6
    # N=6: T=2 refreshes after steps 2, 4 (Δ = 2 + 2 teacher tokens), T=4 after step 4 (Δ = 4)
    assert (s.loc["periodic_T2", "refreshes"], s.loc["periodic_T4", "refreshes"]) == (2, 1)
    assert s.loc["periodic_T2", "teacher_tokens_per_token"] == s.loc["periodic_T4", "teacher_tokens_per_token"] == 4 / 6
    assert s.loc["student", "teacher_tokens_per_token"] == s.loc["overfill", "teacher_tokens_per_token"] == 0
    assert s.loc["periodic_T2", "family"] == "periodic" and s.loc["student", "family"] == "student"


def test_eviction_families_come_from_the_registry_and_are_summarised(tmp_path):
    from kvlab.eviction import EVICTION_POLICIES
    from kvlab.sweep.tables import config_summary

    with pytest.raises(SpecError, match="'evict.h2" ) as e:
        parse_spec(grid(evict={"h2": {"budget": 8}}))
    assert all(name in str(e.value) for name in EVICTION_POLICIES)
    with pytest.raises(SpecError, match="rerotate"):          # a combination the decode loop refuses
        parse_spec(grid(evict={"block": {"block_size": 2, "start_blocks": 1, "evictable_blocks": 1,
                                         "recent_blocks": 1, "rerotate": True}}))
    spec = parse_spec(grid(run={"modes": ["student", "overfill"], "tokens": 12}, refresh={"periodic": {"T": 4}},
                           evict={"sliding": {"window": [6, 8], "sinks": 2}}))
    pols = [c.policy for c in spec.configs()]
    assert pols == ["student", "student+sliding_window6_sinks2", "student+sliding_window8_sinks2", "overfill",
                    "sliding_window6_sinks2", "sliding_window8_sinks2", "periodic_T4", "periodic_T4+sliding_window6_sinks2",
                    "periodic_T4+sliding_window8_sinks2"]
    run_sweep(spec, store=tmp_path, progress=False)
    rows = load(tmp_path)
    df = rows.assign(prompt_idx=rows.prompt.map({p: i for i, p in enumerate(spec.prompts)}))
    df = df.set_index(["policy", "prompt_idx"]).sort_index()
    assert (df.status == "ok").all() and set(df.index.get_level_values(0)) == set(pols)
    assert df.loc[("student+sliding_window6_sinks2", 0), "evict_window"] == 6
    full, cut = df.loc[("student", 0)], df.loc[("student+sliding_window6_sinks2", 0)]
    assert cut.cache_len_max < full.cache_len_max and cut.evicted > 0 == full.evicted
    s = config_summary(rows).set_index("policy")
    assert set(s.index) == set(pols) and (s.n_runs == 2).all()                     # every family summarised
    assert s.loc["periodic_T4+sliding_window6_sinks2", "family"] == "periodic+sliding"
    assert s.loc["sliding_window6_sinks2", "family"] == "sliding" and s.loc["sliding_window6_sinks2", "evicted"] > 0
    assert s.loc["sliding_window6_sinks2", "cache_len_max"] < s.loc["overfill", "cache_len_max"]


# --------------------------------------------------------------------------- a real (local) Ray cluster


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _pids_with(needles) -> set[int]:
    """Processes whose command line mentions any of ``needles`` (this cluster's temp dir / GCS port)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in needles):
            out.add(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"     # zombies are gone
    except OSError:
        return False


def _stop(pids: set[int], timeout: float = 30.0) -> set[int]:
    """SIGTERM, then SIGKILL what is left; returns the pids still alive."""
    import signal
    import time

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        t0 = time.time()
        while time.time() - t0 < timeout and any(_alive(p) for p in pids):
            time.sleep(0.2)
    return {p for p in pids if _alive(p)}


@pytest.mark.skipif(sys.platform != "linux", reason="finds the cluster's processes in /proc")
def test_ray_cluster_with_a_separate_driver(tmp_path):
    """``ray start --head`` on 127.0.0.1 (2 CPUs, free ports), a separate driver process joining it with
    ``--address``: the tiny grid's rows match the in-process engine's; the cluster is stopped by pid."""
    import tempfile

    pytest.importorskip("ray")
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.is_file():
        pytest.skip("no `ray` executable beside this Python")
    temp = tempfile.mkdtemp(prefix="kvray", dir="/tmp")          # short: Ray's unix sockets live under it
    gcs, node, obj, agent_l, agent_g, metrics, renv = _free_ports(7)
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}  # loopback only
    env.pop("RAY_ADDRESS", None)
    needles = [temp, f"127.0.0.1:{gcs}"]
    started: set[int] = set()
    try:
        for attempt in range(3):       # Ray gives its raylet a fixed 30 s to register: a loaded machine can miss it
            r = subprocess.run([str(ray_bin), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={gcs}",
                                "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp}", "--include-dashboard=false",
                                "--disable-usage-stats", f"--node-manager-port={node}", f"--object-manager-port={obj}",
                                f"--dashboard-agent-listen-port={agent_l}",
                                f"--dashboard-agent-grpc-port={agent_g}", f"--metrics-export-port={metrics}",
                                f"--runtime-env-agent-port={renv}", "--object-store-memory=100000000"],
                               capture_output=True, text=True, timeout=240, env=env)
            started |= _pids_with(needles)
            if r.returncode == 0 or "timed out during startup" not in r.stdout + r.stderr or attempt == 2:
                break
            assert not _stop(started)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        # the driver: another process, the CLI, joining the cluster by address
        drv_env = {**env, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        d = subprocess.run([sys.executable, "-m", "kvlab", "sweep", "--engine", "ray", "--address", f"127.0.0.1:{gcs}",
                            "--models", "tiny", "--modes", "teacher", "student", "overfill", "--tokens", "6",
                            "--prompts", "2", "--refresh", "periodic T=2,4", "--name", "t", "--runs", str(tmp_path / "ray"),
                            "--no-progress"], capture_output=True, text=True, timeout=400, env=drv_env)
        started |= _pids_with(needles)
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
        assert "[ray]: 10 tasks, 0 already stored, 10 run (0 errors)" in d.stdout
    finally:
        started |= _pids_with(needles)
        left = _stop(started)
        import shutil

        shutil.rmtree(temp, ignore_errors=True)
    assert started and not left and not _pids_with(needles)                # every process we started is gone
    spec = parse_spec(grid())
    run_sweep(spec, store=tmp_path / "local", progress=False)
    a, b = load(tmp_path / "local"), load(tmp_path / "ray")
    assert len(b) == len(spec.tasks()) and set(b.engine) == {"ray"} and b.run_key.is_unique
    assert set(a.run_key) == set(b.run_key)                               # same keys: same runs
    assert_same_rows(a, b)
