"""The decode loop: parity with HF generate, OverFill semantics, sampling, records, bad input."""
from __future__ import annotations

import math

import pytest
import torch

from kvlab import DecodeConfig, Decoding, IncompatiblePairError, Sampling, kv_compat, run
from conftest import make_tiny_lm

PROMPT = "why is the sky blue"


def _hf_greedy(lm, prompt, n):
    ids = torch.tensor([lm.encode_prompt(prompt)])
    with torch.inference_mode():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def test_teacher_greedy_matches_hf_generate(tiny_teacher):
    n = 24
    tr = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=n)
    # min_new_tokens only suppresses EOS; the tiny model's argmax never is EOS here
    assert 2 not in tr.tokens
    assert tr.tokens == _hf_greedy(tiny_teacher, PROMPT, n)


def test_overfill_with_student_equal_teacher_reproduces_teacher(tiny_teacher):
    a = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=16)
    b = run(tiny_teacher, tiny_teacher, PROMPT, mode="overfill", max_new_tokens=16)
    assert a.tokens == b.tokens
    assert [r.logprob for r in a.records] == pytest.approx([r.logprob for r in b.records], abs=1e-5)


def test_overfill_semantics(tiny_teacher, tiny_student):
    d = Decoding(tiny_teacher, tiny_student, PROMPT, mode="overfill", max_new_tokens=5)
    recs = list(d)
    L = len(d.prompt_ids)
    assert [r.source for r in recs] == ["teacher"] + ["student"] * 4
    # the cache lags the last emitted token by one entry
    assert [r.cache_len for r in recs] == [L + t - 1 for t in range(1, 6)]
    assert len(d.cache) == L + 4
    assert d.cache.writers == ["teacher"] * L + ["student"] * 4
    assert d.cache.positions == list(range(L + 4))
    assert d.cache.token_ids[L:] == d.tokens[:4]
    assert len(d.teacher_cache) == L          # the teacher kept its own C_0
    assert [r.position for r in recs] == list(range(L, L + 5))


def test_records_are_frozen_and_stats_consistent(tiny_teacher):
    d = Decoding(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=3)
    rec = next(iter(d))
    with pytest.raises(Exception):
        rec.step = 7
    assert rec.step == 1 and 0 < rec.top1_prob <= 1 and 0 <= rec.margin <= rec.top1_prob
    assert 0 <= rec.entropy_bits <= math.log2(tiny_teacher.config.vocab_size) + 1e-6
    assert rec.logprob <= 0 and d.ttft_s is not None and rec.wall_s > 0
    frame = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=3).to_frame()
    assert list(frame["step"]) == [1, 2, 3] and "entropy_bits" in frame


def test_seeded_sampling_is_reproducible_and_top_p_tiny_is_greedy(tiny_teacher):
    s = Sampling(temperature=1.0, top_p=1.0, seed=3)
    a = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=20, sampling=s)
    b = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=20, sampling=s)
    c = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=20, sampling=Sampling(1.0, 1.0, 4))
    assert a.tokens == b.tokens and a.tokens != c.tokens
    g = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=20)
    nucleus = run(tiny_teacher, None, PROMPT, mode="teacher", max_new_tokens=20, sampling=Sampling(1.0, 1e-6, 9))
    assert nucleus.tokens == g.tokens


def test_eos_stops_unless_ignored(tiny_teacher):
    # a logit bias on EOS makes the tiny model emit it at once
    lm = make_tiny_lm(seed=0)
    with torch.no_grad():
        lm.model.lm_head.weight[2] += 50 * lm.model.model.norm.weight.sign()
    stop = run(lm, None, PROMPT, mode="teacher", max_new_tokens=10, ignore_eos=False)
    keep = run(lm, None, PROMPT, mode="teacher", max_new_tokens=10, ignore_eos=True)
    assert stop.tokens[-1] == 2 and len(stop.tokens) < 10 and len(keep.tokens) == 10


def test_incompatible_pair_raises_and_can_rebuild(tiny_teacher):
    other = make_tiny_lm(seed=2, num_kv_heads=4, rope_theta=500000.0)
    compat = kv_compat(tiny_teacher, other)
    assert not compat.ok and set(compat.fields) == {"num_key_value_heads", "rope_theta"}
    with pytest.raises(IncompatiblePairError, match="num_key_value_heads"):
        Decoding(tiny_teacher, other, PROMPT, mode="overfill")
    tr = run(tiny_teacher, other, PROMPT, mode="overfill", max_new_tokens=4, rebuild_student_cache=True)
    assert len(tr.tokens) == 4


def test_kv_compat_reports_each_field(tiny_teacher):
    assert kv_compat(tiny_teacher, make_tiny_lm(seed=5, intermediate_size=32)).ok
    bad = kv_compat(tiny_teacher, make_tiny_lm(seed=5, layers=3, head_dim=8, vocab=130))
    assert set(bad.fields) >= {"num_hidden_layers", "head_dim", "vocab_size"}
    assert "num_hidden_layers" in str(bad)


@pytest.mark.parametrize("kwargs, name", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"mode": "beam"}, "mode"),
])
def test_bad_config_raises_naming_parameter(tiny_teacher, kwargs, name):
    with pytest.raises(ValueError, match=name):
        Decoding(tiny_teacher, tiny_teacher, PROMPT, **kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_raises_naming_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        Sampling(**kwargs)


def test_missing_models_raise_before_work(tiny_teacher):
    with pytest.raises(ValueError, match="teacher"):
        Decoding(None, tiny_teacher, PROMPT, mode="overfill")
    with pytest.raises(ValueError, match="prompt"):
        Decoding(tiny_teacher, None, "  ", mode="teacher")


def test_decode_config_roundtrips_to_dict():
    d = DecodeConfig(mode="student", sampling=Sampling(0.5, 0.9, 1)).to_dict()
    assert d["mode"] == "student" and d["sampling"]["top_p"] == 0.9
