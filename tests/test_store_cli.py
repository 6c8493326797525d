"""Run store reuse and CLI input validation."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvlab.data import load_prompts
from kvlab.store import RunStore


def test_store_reuses_finished_runs(tmp_path):
    store = RunStore(tmp_path)
    calls = []
    cfg = {"a": 1, "b": [1, 2]}
    assert store.get_or_run(cfg, lambda: calls.append(1) or {"x": 3}) == {"x": 3}
    assert store.get_or_run(cfg, lambda: calls.append(1) or {"x": 4}) == {"x": 3}
    assert calls == [1] and len(store) == 1
    store.path(cfg).write_text("{torn")          # a killed write is treated as missing
    assert store.get(cfg) is None


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
])
def test_cli_rejects_bad_input_before_work(args, needle, tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvlab", *args, "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert needle in r.stderr
    assert not any(tmp_path.iterdir())   # nothing written
