"""A few integration tests on the real embedded pair."""
from __future__ import annotations

import pytest
import torch

from kvlab import run, score

pytestmark = pytest.mark.integration
PROMPT = "ELI5: why do cats purr?"


def test_real_teacher_greedy_matches_generate(real_pair):
    teacher, _ = real_pair
    n = 12
    tr = run(teacher, None, PROMPT, mode="teacher", max_new_tokens=n, ignore_eos=False)
    ids = torch.tensor([teacher.encode_prompt(PROMPT)])
    with torch.inference_mode():
        out = teacher.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    assert tr.tokens == out[0, ids.shape[1]:].tolist()


def test_real_overfill_pipeline(real_pair):
    teacher, student = real_pair
    tr = run(teacher, student, PROMPT, mode="overfill", max_new_tokens=16, keep_dists=True)
    s = score(tr, teacher)
    assert s["tokens"] == 16 and s["teacher_ppl"] > 1 and s["kl"] > 0
    t = score(run(teacher, None, PROMPT, mode="teacher", max_new_tokens=16, keep_dists=True), teacher)
    assert abs(t["kl"]) < 1e-3 < s["kl"]


def test_baselines_cli_end_to_end(tmp_path):
    import subprocess
    import sys

    out, runs = tmp_path / "fig", tmp_path / "runs"
    cmd = [sys.executable, "-m", "kvlab", "baselines", "--prompts", "1", "--tokens", "8", "--out", str(out),
           "--runs", str(runs), "--no-progress", "--device", "cpu",
           "--student", "pruned"]   # the untrained student: a test never trains one (CI may start with no model cache)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    import pandas as pd

    df = pd.read_csv(out / "baselines.csv")
    assert list(df["policy"]) == ["teacher", "overfill", "student"]
    for col in ["policy", "tokens", "teacher_ppl", "kl", "repeat3"]:
        assert col in df
    assert not {"ttft_s", "tps", "total_s", "e2e_tps"} & set(df.columns)     # timings live apart
    timing = pd.read_csv(out / "baselines_timing.csv")
    for col in ["policy", "ttft_s", "tps", "total_s", "e2e_tps"]:
        assert col in timing
    assert (out / "baselines.md").is_file() and (out / "baselines.png").is_file()
    assert (out / "baselines_timing.png").is_file()
    from kvlab.store.results import Store

    n_keys = len(Store(runs).ok_keys())
    # 3 decode runs + the prompt's reference continuation + 3 teacher-forced scores (kl_forced), one key each
    assert n_keys == 7, n_keys
    r2 = subprocess.run(cmd, capture_output=True, text=True, timeout=600)   # reuses stored runs
    assert r2.returncode == 0 and len(Store(runs).ok_keys()) == n_keys, r2.stderr
    assert "7 reused, 0 computed" in r2.stdout, r2.stdout
    assert pd.read_csv(out / "baselines.csv")["teacher_ppl"].tolist() == df["teacher_ppl"].tolist()
