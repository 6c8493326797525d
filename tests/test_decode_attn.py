"""The batched one-token step's attention (kvlab.core.decode_attn): the eager form equals SDPA's within fp32 rounding
(bool, additive and no mask; grouped and ungrouped heads); the choice (None: SDPA, forced, timed, a bad value named);
batched rows stepped eagerly equal the single runs as SDPA's do; the bench's flag is put back after a run."""
from __future__ import annotations

import pytest
import torch

from kvlab.core import decode_attn as DA
from kvlab.eviction import H2O

from test_batch_decode import assert_rows_equal, batch_and_singles, cfg, PROMPTS


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("mask", ["bool", "additive", None])
def test_eager_equals_sdpa(heads, mask):
    h, hkv = heads
    g = torch.Generator().manual_seed(0)
    B, T, D = 3, 37, 16
    q = torch.randn(B, h, 1, D, generator=g)
    buf = torch.randn(B, hkv, 50, D, generator=g)                    # keys as a bank's view: a span of a longer buffer
    k, v = buf[:, :, 5:5 + T], torch.randn(B, hkv, 50, D, generator=g)[:, :, 5:5 + T]
    m = torch.rand(B, 1, 1, T, generator=g) > 0.3
    m[:, :, :, 0] = True                                             # every row sees something
    am = {"bool": m, "additive": torch.zeros(B, 1, 1, T).masked_fill_(~m, float("-inf")), None: None}[mask]
    out, probs = DA.eager(q, k, v, am, 0.25)
    ref = DA.sdpa(q, k, v, am, 0.25)
    assert out.shape == ref.shape == (B, 1, h, D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert probs.shape == (B, h, 1, T)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, h, 1))
    if mask is not None:
        assert float(probs.masked_select(~m.expand(B, h, 1, T)).abs().max()) == 0.0


def test_the_choice(monkeypatch):
    q, k = torch.randn(2, 9, 1, 64), torch.randn(2, 3, 100, 64)
    monkeypatch.setattr(DA, "DECODE", None)                          # the default: SDPA, studies unchanged
    assert DA.choice(q, k) == "sdpa" and DA.described() == "sdpa"
    monkeypatch.setattr(DA, "DECODE", "eager")
    assert DA.choice(q, k) == "eager" and DA.described() == "eager"
    monkeypatch.setattr(DA, "DECODE", "auto")
    monkeypatch.setattr(DA, "_CHOSEN", {})
    assert DA.choice() == "sdpa"                                     # nothing to time against: SDPA
    assert DA.described() == "auto"                                  # before any step
    got = DA.choice(q, k)                                            # timed once per head shape on the CPU
    assert got in DA.CHOICES and DA._CHOSEN == {(9, 3, 64, torch.float32): got}
    assert DA.choice(q, k) == got and DA.described() == f"auto: {got}"
    monkeypatch.setattr(DA, "DECODE", "flash")
    with pytest.raises(ValueError, match=r"kvlab.core.decode_attn.DECODE='flash' must be one of \('sdpa', 'eager'\)"):
        DA.choice(q, k)


@pytest.mark.parametrize("policy", [None, H2O(budget=12, recent=4)])
def test_batched_rows_stepped_eagerly_equal_single_runs(tiny_teacher, tiny_student, policy, monkeypatch):
    """The batched loop's one-token steps through the eager form (holes of evicted entries masked) give each row what
    its single run (the model's own forward) gives, as SDPA's steps do."""
    monkeypatch.setattr(DA, "DECODE", "eager")
    calls = []
    real = DA.eager
    monkeypatch.setattr(DA, "eager", lambda *a: calls.append(1) or real(*a))
    config = cfg(mode="teacher", evict=policy) if policy is not None else cfg(mode="teacher")
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, PROMPTS, config))
    assert calls                                                     # the eager form ran


def test_bench_puts_the_choice_back(monkeypatch):
    """``python -m kvlab bench``'s ``--decode-attention`` holds for the run and is put back after it (also on error)."""
    from types import SimpleNamespace

    from kvlab.studies.bench import cli

    seen = []

    def fake(args, *, bench_sweep):
        seen.append(DA.DECODE)
        raise RuntimeError("stop")

    monkeypatch.setattr(cli, "_cmd_bench", fake)
    monkeypatch.setattr(DA, "DECODE", None)
    with pytest.raises(RuntimeError, match="stop"):
        cli.cmd_bench(SimpleNamespace(packed="auto", decode_attention="eager"), bench_sweep=None)
    assert seen == ["eager"] and DA.DECODE is None
