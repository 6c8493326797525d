"""Metrics on hand-made numbers equal hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from kvlab.decode import Sampling, Trace, DecodeConfig, token_stats
from kvlab.metrics import kl_rows, repeat_at_n, score


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


def test_score_hand_computed():
    V = 4
    t_logp = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    s_logp = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    toks = [0, 1, 0, 1, 0]
    tr = Trace(records=[type("R", (), {"token_id": t})() for t in toks], prompt="p", prompt_ids=[3, 3],
               config=DecodeConfig(), ttft_s=0.5, total_s=2.5, text="abcde", dists=s_logp.expand(5, V))
    out = score(tr, _FixedTeacher(t_logp))
    mean_lp = (3 * math.log(0.4) + 2 * math.log(0.3)) / 5
    assert out["teacher_ppl"] == pytest.approx(math.exp(-mean_lp))
    assert out["tail_logprob"] == pytest.approx(mean_lp)
    kl = sum(p * math.log(p / 0.25) for p in [0.4, 0.3, 0.2, 0.1])
    assert out["kl"] == pytest.approx(kl, rel=1e-5)
    assert out["tps"] == pytest.approx(4 / 2.0) and out["e2e_tps"] == pytest.approx(5 / 2.5)
    assert out["repeat3"] == pytest.approx(1 - 2 / 3) and out["chars"] == 5 and out["tokens"] == 5


def test_teacher_mode_kl_is_zero(tiny_teacher):
    from kvlab import run

    tr = run(tiny_teacher, None, "hello world", mode="teacher", max_new_tokens=8, keep_dists=True,
             sampling=Sampling(0.8, 1.0, 1))
    out = score(tr, tiny_teacher)
    assert abs(out["kl"]) < 1e-5


def test_token_stats_with_masked_logits():
    logits = torch.tensor([0.0, 0.0, float("-inf"), float("-inf")])
    _, ent, top1, margin = token_stats(logits)
    assert ent == pytest.approx(1.0) and top1 == pytest.approx(0.5) and margin == pytest.approx(0.0)
