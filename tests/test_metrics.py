"""Metrics on hand-made numbers equal hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from kvlab.decode import Sampling, Trace, DecodeConfig, token_stats
from kvlab.core.metrics import kl_rows, repeat_at_n, score

from conftest import make_tiny_lm


def test_kl_rows_hand_computed():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.05, 0.05]])
    q = torch.tensor([[0.25, 0.25, 0.5], [0.9, 0.05, 0.05]])
    kl = kl_rows(p.log(), q.log())
    assert kl[0].item() == pytest.approx(0.5 * math.log(2) * 2)   # p=0 term contributes 0
    assert kl[1].item() == pytest.approx(0.0, abs=1e-7)


def test_repeat_at_3_hand_computed():
    assert repeat_at_n([1, 2, 3, 1, 2, 3], 3) == pytest.approx(1 - 3 / 4)
    assert repeat_at_n([1, 2, 3, 4], 3) == 0.0
    assert repeat_at_n([7] * 10, 3) == pytest.approx(1 - 1 / 8)
    assert repeat_at_n([1, 2], 3) == 0.0
    with pytest.raises(ValueError, match="n="):
        repeat_at_n([1, 2, 3], 0)


def test_token_stats_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25]))
    logp, ent, top1, margin = token_stats(logits)
    assert ent == pytest.approx(1.5)           # bits
    assert top1 == pytest.approx(0.5) and margin == pytest.approx(0.25)
    assert logp.exp().sum().item() == pytest.approx(1.0)


class _FixedTeacher:
    """A 'model' whose next-token distribution is a fixed table, for exact scoring checks."""

    def __init__(self, table):
        self.table = table  # (V,) log-probs, the same at every position
        self.device = torch.device("cpu")

    @property
    def model(self):
        table = self.table

        class M:
            def __call__(self, input_ids, use_cache, logits_to_keep):
                n = input_ids.shape[1]
                out = table.expand(1, n, -1)[:, -logits_to_keep:]
                return type("O", (), {"logits": out})()
        return M()


def _rec(token_id, source):
    return type("R", (), {"token_id": token_id, "source": source})()


def test_score_hand_computed():
    V = 4
    t_logp = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    s_logp = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    toks = [0, 1, 0, 1, 0]
    tr = Trace(records=[_rec(t, "student") for t in toks], prompt="p", prompt_ids=[3, 3],
               config=DecodeConfig(), ttft_s=0.5, total_s=2.5, text="abcde", model_logprobs=s_logp.expand(5, V))
    out = score(tr, _FixedTeacher(t_logp))
    mean_lp = (3 * math.log(0.4) + 2 * math.log(0.3)) / 5
    assert out["teacher_ppl"] == pytest.approx(math.exp(-mean_lp))
    assert out["tail_logprob"] == pytest.approx(mean_lp)
    kl = sum(p * math.log(p / 0.25) for p in [0.4, 0.3, 0.2, 0.1])
    assert out["kl"] == pytest.approx(kl, rel=1e-5)
    assert out["tps"] == pytest.approx(4 / 2.0) and out["e2e_tps"] == pytest.approx(5 / 2.5)
    assert out["repeat3"] == pytest.approx(1 - 2 / 3) and out["chars"] == 5 and out["tokens"] == 5


def test_kl_excludes_teacher_chosen_steps():
    """kl averages only the student-chosen steps; kl_all every step (hand-computed)."""
    t_logp = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    s_logp = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    sources = ["teacher", "student", "student", "teacher", "student"]
    q = torch.stack([t_logp if s == "teacher" else s_logp for s in sources])     # teacher steps: q = p_T
    tr = Trace(records=[_rec(0, s) for s in sources], prompt="p", prompt_ids=[3], config=DecodeConfig(),
               ttft_s=0.1, total_s=1.0, text="abcde", model_logprobs=q)
    out = score(tr, _FixedTeacher(t_logp))
    kl = sum(p * math.log(p / 0.25) for p in [0.4, 0.3, 0.2, 0.1])
    assert out["kl"] == pytest.approx(kl, rel=1e-5)                  # not diluted by the two KL=0 steps
    assert out["kl_all"] == pytest.approx(3 / 5 * kl, rel=1e-5)
    assert out["kl_student_steps"] == 3


def test_kl_on_refreshed_run_counts_student_steps_only(tiny_teacher, tiny_student):
    """OverFill + refresh_next="teacher": step 1 and every post-refresh step are teacher-chosen."""
    from kvlab import run
    from kvlab.refresh.policies import Periodic

    tr = run(tiny_teacher, tiny_student, "hello world", mode="overfill", max_new_tokens=16, keep_dists=True,
             refresh=Periodic(4), refresh_next="teacher", sampling=Sampling(0.8, 1.0, 3))
    src = [r.source for r in tr.records]
    assert src[0] == "teacher" and src.count("teacher") >= 3 and "student" in src
    out = score(tr, tiny_teacher)
    steps = torch.tensor(out["kl_steps"])
    mine = torch.tensor([s == "student" for s in src])
    assert (steps[~mine] == 0).all()                                # q = p_T on teacher-chosen steps: exactly 0
    assert out["kl"] == pytest.approx(float(steps[mine].mean()), rel=1e-6)
    assert out["kl_all"] == pytest.approx(float(steps.mean()), rel=1e-6)
    assert out["kl"] > out["kl_all"] * 1.05                           # the teacher steps would dilute it
    assert out["kl_student_steps"] == int(mine.sum())


def test_student_mode_kl_is_all_steps(tiny_student):
    from kvlab import run

    tr = run(None, tiny_student, "hello world", mode="student", max_new_tokens=6, keep_dists=True)
    out = score(tr, make_tiny_lm(seed=0))
    assert out["kl_student_steps"] == 6 and out["kl"] == pytest.approx(out["kl_all"])


def test_trace_dists_is_a_deprecated_alias(tiny_teacher):
    from kvlab import run

    tr = run(tiny_teacher, None, "hi", mode="teacher", max_new_tokens=3, keep_dists=True)
    with pytest.warns(DeprecationWarning, match="model_logprobs"):
        assert tr.dists is tr.model_logprobs
    assert tr.model_logprobs.shape[0] == 3


def test_teacher_mode_kl_is_zero(tiny_teacher):
    from kvlab import run

    tr = run(tiny_teacher, None, "hello world", mode="teacher", max_new_tokens=8, keep_dists=True,
             sampling=Sampling(0.8, 1.0, 1))
    out = score(tr, tiny_teacher)
    assert out["kl"] == 0.0 and out["kl_all"] == 0.0 and out["kl_student_steps"] == 0     # 0 by construction


def test_token_stats_with_masked_logits():
    logits = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])
    _, ent, top1, margin = token_stats(logits)
    assert ent == pytest.approx(1.0) and top1 == pytest.approx(0.5) and margin == pytest.approx(0.0)


def test_every_written_table_states_its_kl(tmp_path):
    """Tables with KL columns say which steps they average; the forced table says its own meaning."""
    import pandas as pd

    from kvlab.store import provenance
    from kvlab.studies.refresh.forced import FORCED_NOTE
    from kvlab.core.metrics import KL_ALL_NOTE, KL_NOTE
    from kvlab.studies.refresh.tables import write_refresh

    tables = {"refresh_methods": pd.DataFrame({"policy": ["none"], "kl": [0.5], "kl_all": [0.49]}),
              "refresh_forced": pd.DataFrame({"condition": ["overfill"], "kl": [0.4]}),
              "refresh_calibration": pd.DataFrame({"n_steps": [10]})}
    write_refresh(tables, tmp_path)
    methods = (tmp_path / "refresh_methods.md").read_text()
    forced = (tmp_path / "refresh_forced.md").read_text()
    calib = (tmp_path / "refresh_calibration.md").read_text()
    assert KL_NOTE in methods and KL_ALL_NOTE in methods
    assert FORCED_NOTE in forced and KL_NOTE not in forced
    assert "KL" not in calib
    for md in (methods, forced, calib):
        assert f"kvlab code {provenance.CODE_VERSION}, commit {provenance.source_label()}" in md
    assert list(pd.read_csv(tmp_path / "refresh_methods.csv").columns) == ["policy", "kl", "kl_all"]


def test_mde_is_2p8_sd_over_sqrt_n_and_add_mde_pairs_by_prompt():
    import math

    import pandas as pd

    from kvlab.core.metrics import add_mde, mde

    d = [0.1, -0.2, 0.3, 0.0]
    sd = pd.Series(d).std(ddof=1)
    assert abs(mde(d) - 2.8 * sd / math.sqrt(4)) < 1e-12 and math.isnan(mde([0.1]))
    per = pd.DataFrame({"policy": ["a"] * 4 + ["b"] * 4, "prompt_idx": [0, 1, 2, 3, 3, 2, 1, 0],
                        "kl": [1.0, 1.0, 1.0, 1.0, 1.0, 1.3, 0.8, 1.1]})
    out = add_mde(pd.DataFrame({"policy": ["a", "b"]}), per, "a", ["kl"])
    assert math.isnan(out.d_kl_mde[0]) and abs(out.d_kl_mde[1] - mde([0.1, -0.2, 0.3, 0.0])) < 1e-12
