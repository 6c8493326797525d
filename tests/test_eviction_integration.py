"""Eviction on the real embedded pair (integration): re-rotation against the teacher's own RoPE,
a Conf-KV run with refresh, INT8 effect."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache
from kvlab.decode import DecodeConfig, run
from kvlab.eviction import ConfKV, SlidingWindow
from kvlab.refresh.policies import Periodic

pytestmark = pytest.mark.integration
PROMPT = "ELI5: why do cats purr?"


def test_real_teacher_rerotated_keys_equal_recomputed(real_pair):
    teacher, _ = real_pair
    m = teacher.model
    ids = teacher.encode_prompt(PROMPT)[:24]
    c, _ = KVCache.prefill(m, ids, writer="teacher")
    new = [p + 1000 + 7 * p for p in range(len(ids))]
    c.reposition(m, new)
    ref = KVCache()
    ref.forward(m, ids, writer="teacher", positions=new)
    # layer 0's keys depend only on token and position: the re-rotated keys must match
    k, kr = c.kv(0)[0], ref.kv(0)[0]
    assert float((k - kr).abs().max()) <= 1e-4 * float(kr.abs().max())


def test_real_overfill_confkv_with_refresh(real_pair):
    teacher, student = real_pair
    pol = ConfKV(gamma=0.7, tight=40, loose=56, protect=8, int8_window=16, int8_group=16)
    tr = run(teacher, student, PROMPT, DecodeConfig(mode="overfill", max_new_tokens=24, refresh=Periodic(8), evict=pol))
    assert all(r.cache_len <= 56 for r in tr.records) and sum(r.evicted for r in tr.records) > 0
    assert {r.signals.get("budget") for r in tr.records} == {40.0, 56.0}      # both budgets in force
    assert sum(r.refreshed for r in tr.records) == 2


def test_real_int8_effect_is_small(real_pair):
    from kvlab.studies.bench.bench import int8_effect

    teacher, _ = real_pair
    out = int8_effect(teacher, PROMPT, window=8, group=16, tokens=12)
    assert out["int8_entries"] > 0 and out["bytes_ratio"] < 0.6
    assert out["rel_err_k_mean"] < 0.02 and out["kl_mean"] < 0.05
    sw = run(teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=8, evict=SlidingWindow(16, 4)))
    assert max(r.cache_len for r in sw.records) == 16
