"""Up front: a command that needs trained students not in the model cache says what it will train, roughly
how long and how to skip it; two processes needing the same student train it once (a lock in the model cache)."""
from __future__ import annotations

import threading
import time

import pytest

from kvlab.train.config import DEFAULT_SHAPE, DEFAULT_TRAIN

CFG = DEFAULT_TRAIN.replace(steps=3)       # a recipe nothing ships: these students would be trained


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    import kvlab.train.plan as plan

    monkeypatch.setattr(plan, "_SAID", set())
    return tmp_path / "cache"


def _fake_trained(target):
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")


def test_plan_says_what_how_long_and_how_to_skip(cache):
    from kvlab.train.plan import plan
    from kvlab.train.weights import trained_dir

    p = plan(["overfill", "standalone", "pruned"], DEFAULT_SHAPE, CFG)
    assert p.train == ("overfill", "standalone") and p.need_data and not p.cached
    msg = p.message()
    assert "overfill, standalone" in msg and "h0.20,i0.50" in msg
    assert "424 training prompts" in msg and "min" in msg and f"{p.estimate_s() / 60:.0f} min in all" in msg
    assert "--student pruned" in msg and "python -m kvlab train-student --student overfill standalone" in msg
    assert p.estimate_s() > plan(["overfill"], DEFAULT_SHAPE, CFG).estimate_s() > 0
    _fake_trained(trained_dir("overfill", DEFAULT_SHAPE, CFG))
    q = plan(["overfill", "standalone"], DEFAULT_SHAPE, CFG)
    assert q.cached == ("overfill",) and q.train == ("standalone",)
    _fake_trained(trained_dir("standalone", DEFAULT_SHAPE, CFG))
    assert plan(["overfill", "standalone"], DEFAULT_SHAPE, CFG).message() == ""      # all cached: silent


def test_baselines_announces_every_student_before_loading_anything(cache, monkeypatch, capsys, tmp_path):
    """`baselines` on a fresh cache: the notice names both students it needs (OverFill + the standalone
    baseline) before any model loads or trains."""
    import kvlab.train.pair as pair
    from kvlab.cli import main

    class Loaded(Exception):
        pass

    def refuse(*a, **k):
        raise Loaded

    monkeypatch.setattr(pair, "load_pair", refuse)
    with pytest.raises(Loaded):
        main(["baselines", "--prompts", "2", "--tokens", "12", "--train-steps", "3", "--out", str(tmp_path / "o"),
              "--runs", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err
    assert "overfill, standalone" in err and "--student pruned" in err and "min in all" in err
    assert not (cache / "models").exists()                              # nothing was built or trained
    # --student pruned (the way to skip training): no standalone row, so no standalone student is announced
    with pytest.raises(Loaded):
        main(["baselines", "--student", "pruned", "--prompts", "2", "--tokens", "12", "--out", str(tmp_path / "o"),
              "--runs", str(tmp_path / "r"), "--no-progress"])
    assert "standalone" not in capsys.readouterr().err


def test_two_processes_needing_the_same_student_train_it_once(cache, monkeypatch, capsys):
    """Two callers at once (threads here: each opens the lock file itself, as a process would): one trains,
    the other waits, says who holds the lock and why, and then uses the first one's student."""
    import kvlab.train.weights as weights

    calls = []

    def fake_train(variant, shape, cfg, target, **kw):
        calls.append(variant)
        time.sleep(1.5)
        _fake_trained(target)
        return target

    monkeypatch.setattr(weights, "_train", fake_train)
    out = []
    threads = [threading.Thread(target=lambda: out.append(
        weights.train_student("overfill", DEFAULT_SHAPE, CFG, progress=False))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    assert calls == ["overfill"] and len(out) == 2 and out[0] == out[1]
    err = capsys.readouterr().err
    assert "waiting" in err and "is training the overfill student" in err and "instead of doing the work twice" in err
    # the lock is released: a third caller neither waits nor trains
    assert weights.train_student("overfill", DEFAULT_SHAPE, CFG, progress=False) == out[0]
    assert "waiting" not in capsys.readouterr().err


def test_a_lock_held_by_a_dead_process_does_not_block(cache):
    """flock dies with its holder: a killed trainer leaves no stale lock."""
    import subprocess
    import sys

    from kvlab.core.models import cache_lock

    code = ("from kvlab.core.models import cache_lock\nimport os\n"
            "with cache_lock('x', 'testing'):\n    os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__('os').environ})
    t0 = time.monotonic()
    with cache_lock("x", "testing", say=lambda m: pytest.fail(m)):
        pass
    assert time.monotonic() - t0 < 5
