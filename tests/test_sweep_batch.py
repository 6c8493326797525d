"""Sweeps decode chunks of tasks as one batch (``--batch``): same rows and keys as one task at a
time, a failing row fails alone, the process engine runs chunks (and survives a worker dying in
one), so do Ray actors; the playground's prompts × seeds spread gives the same numbers batched. Tiny random models."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest

from kvlab.store.results import Store, load
from kvlab.sweep import parse_spec, run_sweep
from kvlab.sweep.task import execute_chunk

# prompts of different lengths (rows prefill per row, no padding)
PROMPTS = ["sky", "the quick brown fox jumps over the lazy dog", "a b c", "once upon a time there was a king"]
EXACT = ["policy", "seed", "tokens", "refreshes", "teacher_tokens", "spliced", "text", "status"]
FLOATS = ["teacher_ppl", "kl", "kl_all", "repeat3", "tail_logprob"]


def spec(tmp_path, modes=("teacher", "student", "overfill"), **over):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    g = {"name": "b", "prompts": {"file": str(f), "count": len(PROMPTS)}, "run": {"modes": list(modes), "tokens": 8},
         "models": {"kind": "tiny"}, "refresh": {"periodic": {"T": [2, 4]}},
         "evict": {"sliding": {"window": 6, "sinks": 1}, "h2o": {"budget": 6, "recent": 2}}, **over}
    return parse_spec(g)


def rows(root) -> pd.DataFrame:
    return load(root).sort_values("run_key").reset_index(drop=True)


def assert_same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    assert a.run_key.tolist() == b.run_key.tolist()                  # same keys: the batch size is not in them
    pd.testing.assert_frame_equal(a[EXACT], b[EXACT])
    pd.testing.assert_frame_equal(a[FLOATS], b[FLOATS], check_exact=False, rtol=1e-4, atol=1e-5)


def test_batched_sweep_gives_the_rows_of_one_task_at_a_time(tmp_path):
    sp = spec(tmp_path)
    n = len(sp.tasks())
    one = run_sweep(sp, store=tmp_path / "one", progress=False, batch=1)
    four = run_sweep(sp, store=tmp_path / "four", progress=False, batch=4)
    assert (one.done, one.errors) == (four.done, four.errors) == (n, 0)
    a, b = rows(tmp_path / "one"), rows(tmp_path / "four")
    assert_same(a, b)
    assert "batch" not in a or a["batch"].isna().all()               # batch=1: today's path
    assert b["batch"].max() == 4 and (b["batch"] >= 1).all()       # the rest were decoded in chunks
    assert set(b.policy) >= {"periodic_T2", "sliding_window6_sinks1", "h2o_budget6_recent2"}
    again = run_sweep(sp, store=tmp_path / "one", progress=False, batch=3)
    assert (again.skipped, again.done) == (n, 0)                    # batch=1 rows are reused by batch=3


def test_a_failing_row_fails_alone_and_its_batch_is_stored(tmp_path, monkeypatch):
    from kvlab.refresh.policies.periodic import Periodic

    should = Periodic.should_refresh

    def boom(self, record):
        if self.T == 2:
            raise RuntimeError("boom in a row")
        return should(self, record)

    monkeypatch.setattr(Periodic, "should_refresh", boom)
    sp = spec(tmp_path, modes=("overfill",), evict={})
    rep = run_sweep(sp, store=tmp_path, progress=False, batch=len(PROMPTS) * 3)   # one chunk: all overfill tasks
    df = load(tmp_path)
    bad = df[df.status == "error"]
    assert (rep.done, rep.errors) == (len(df), len(PROMPTS)) == (len(sp.tasks()), len(PROMPTS))
    assert set(bad.policy) == {"periodic_T2"} and bad.error.str.contains("boom in a row").all()
    ok = df[df.status == "ok"]
    assert set(ok.policy) == {"overfill", "periodic_T4"} and (ok.tokens == 8).all()
    assert (ok["batch"] == len(PROMPTS) * 3).all()                  # stored from the batch, not rerun alone
    assert set(ok.run_key) == Store(tmp_path).ok_keys()
    monkeypatch.setattr(Periodic, "should_refresh", should)
    rep = run_sweep(sp, store=tmp_path, progress=False, batch=4)    # only the failed rows again
    assert (rep.skipped, rep.done, rep.errors) == (len(df) - len(PROMPTS), len(PROMPTS), 0)


def crash_in_a_chunk(tasks, pairs, engine, worker, marker):
    """Kill the worker the first time a chunk holding prompt 1's baseline runs."""
    if any(t.config.policy == "overfill" and t.prompt_idx == 1 for t in tasks) and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(17)
    return execute_chunk(tasks, pairs, engine, worker)


def test_process_workers_run_chunks_and_survive_dying_in_one(tmp_path):
    import functools

    sp = spec(tmp_path, modes=("overfill",), evict={})
    run_sweep(sp, store=tmp_path / "local", progress=False, batch=1)
    rep = run_sweep(sp, engine="local", workers=2, store=tmp_path / "proc", progress=False, batch=4,
                    chunk_fn=functools.partial(crash_in_a_chunk, marker=str(tmp_path / "crashed")))
    assert (tmp_path / "crashed").exists() and rep.errors == 0 and rep.done == len(sp.tasks())
    a, b = rows(tmp_path / "local"), rows(tmp_path / "proc")
    assert_same(a, b)
    assert set(b.engine) == {"processes"} and b["batch"].max() == 4
    assert b["batch"].isna().sum() == 4          # the dead worker's chunk: its 4 tasks retried one at a time


def test_ray_actors_run_chunks_of_several_tasks(tmp_path):
    """A local Ray instance (2 CPUs, 2 actors): chunks of 5 tasks decode as one batch each on an actor and
    store the rows of one task at a time (same keys, tokens and metrics)."""
    ray = pytest.importorskip("ray")

    sp = spec(tmp_path, modes=("overfill",), evict={})           # 12 tasks of one pair and mode: chunks 5, 5, 2
    n = len(sp.tasks())
    run_sweep(sp, store=tmp_path / "one", progress=False, batch=1)
    rep = run_sweep(sp, engine="ray", workers=2, num_cpus=2, store=tmp_path / "ray", progress=False, batch=5)
    assert not ray.is_initialized()                                # the engine shut its own instance down
    assert (rep.engine, rep.done, rep.errors) == ("ray", n, 0) and n == 12
    a, b = rows(tmp_path / "one"), rows(tmp_path / "ray")
    assert_same(a, b)
    assert set(b.engine) == {"ray"} and b.worker.str.startswith("actor").all()
    assert b["batch"].value_counts().to_dict() == {5: 10, 2: 2}    # every row was decoded in a chunk of several
    assert sorted(b.groupby("wall_s").size()) == [2, 5, 5]          # three chunks: a chunk's rows share its wall time


def test_bad_batch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--batch"):
        run_sweep(spec(tmp_path), store=tmp_path / "s", progress=False, batch=0)
    with pytest.raises(ValueError, match="batch=1"):       # a per-task hook would be bypassed by chunks
        run_sweep(spec(tmp_path), store=tmp_path / "s", progress=False, execute_fn=lambda *a: None)
    assert not (tmp_path / "s").exists()


def test_cli_batch_flag(tmp_path):
    from kvlab import cli

    base = ["sweep", "--models", "tiny", "--modes", "overfill", "--refresh", "periodic T=2", "--prompts", "2",
            "--tokens", "4", "--no-progress"]
    assert cli.main(base + ["--batch", "0", "--runs", str(tmp_path / "bad")]) == 2
    cli.main(base + ["--batch", "2", "--runs", str(tmp_path / "two")])
    cli.main(base + ["--batch", "1", "--runs", str(tmp_path / "one")])
    assert_same(rows(tmp_path / "one"), rows(tmp_path / "two"))
    assert rows(tmp_path / "two")["batch"].max() == 2


def test_spread_batched_equals_one_at_a_time(tiny_teacher, tiny_student, tmp_path):
    from kvlab.playground import Playground, Settings

    prompts = PROMPTS[:3]
    got = {}
    for batch in (1, 4):
        pg = Playground(tiny_teacher, students={0.3: tiny_student}, store=Store(tmp_path / f"b{batch}"),
                        background=False, prompts=prompts, calib_prompts=["calibrate me"], calib_tokens=6, batch=batch,
                        settings=Settings(prompt=prompts[0], N=6, policy="periodic", T=2, seed=3))
        pg.start()
        events = []
        pg.subscribe(lambda ev, p: events.append(p) if ev == "spread" and p is not None else None)
        assert pg.set(n_prompts=3, n_seeds=2)
        assert pg.spread.complete and [e.done for e in events] == [1, 2, 3, 4, 5, 6]
        got[batch] = (pg.spread.stats, rows(tmp_path / f"b{batch}"))
    (s1, r1), (s4, r4) = got[1], got[4]
    for m, st in s1.items():
        if m == "teacher_time_pct":                                 # a measured time share, not the run's output
            continue
        for k, v in st.items():
            assert s4[m][k] == pytest.approx(v, rel=1e-4, abs=1e-6, nan_ok=True), (m, k)
    assert r1.run_key.tolist() == r4.run_key.tolist() and r1.text.tolist() == r4.text.tolist()
    assert r4["engine"].str.startswith("inline-batch").any()
    with pytest.raises(ValueError, match="--batch"):
        Playground(tiny_teacher, students={0.3: tiny_student}, store=Store(tmp_path / "x"), background=False,
                   prompts=prompts, batch=0)
