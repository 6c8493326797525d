"""Eviction in the decode loop and the ledger == cache invariant under any mix of edits."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_lm
from kvlab.cache import KVCache
from kvlab.decode import DecodeConfig, Decoding, Sampling, run
from kvlab.eviction import (H2O, BlockEvict, ConfKV, FullCache, PyramidKV, RandomEvict, Scissorhands, SlidingWindow,
                            SnapKV)
from kvlab.refresh.policies import Periodic

PROMPT = "the quick brown fox jumps over the lazy dog " * 2


def cfg(**kw):
    base = dict(max_new_tokens=30, chat=False)
    base.update(kw)
    return DecodeConfig(**base)


POLICIES = [SlidingWindow(30, sinks=2), H2O(30, 6), RandomEvict(30, 6), ConfKV(tight=24, loose=36, protect=6),
            ConfKV(tight=24, loose=36, protect=6, int8_window=6, int8_group=8, pyramidal=True),
            BlockEvict(4, 1, 5, 1), BlockEvict(4, 1, 5, 1, rerotate=True, kvcrush=1, score="norm_sum"),
            Scissorhands(30, 6)]


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: type(p).__name__)
@pytest.mark.parametrize("mode", ["teacher", "student", "overfill"])
def test_every_mode_runs_and_records(tiny_teacher, tiny_student, policy, mode):
    d = Decoding(tiny_teacher, tiny_student, PROMPT, cfg(mode=mode, evict=policy))
    recs = []
    for rec in d:
        d.cache.check()
        assert rec.cache_len == len(d.cache) and rec.cache_bytes == d.cache.nbytes()
        recs.append(rec)
    lens = [r.cache_len for r in recs]
    L = len(d.prompt_ids)
    budget = max(getattr(policy, "loose", 0), getattr(policy, "budget", 0), getattr(policy, "window", 0),
                 getattr(policy, "max_after_eviction", 0))
    if getattr(policy, "pyramidal", False):                  # the shallowest layer keeps (2 - ρ)·B
        budget = math.ceil(budget * (2 - policy.pyramid_ratio))
    assert max(lens) <= budget < L + 30                      # eviction happened and the budget held
    assert sum(r.evicted for r in recs) == L + 29 - len(d.cache)     # every written entry is live or evicted
    if getattr(policy, "int8_window", None):
        assert d.cache.n_int8 > 0 and recs[-1].cache_bytes < len(d.cache) * 2 * 2 * 2 * 16 * 4


def test_snapkv_cuts_the_prompt_once_then_appends(tiny_teacher):
    tr = run(tiny_teacher, None, PROMPT, cfg(mode="teacher", max_new_tokens=8, evict=SnapKV(budget=12, window=4)))
    L = len(tr.prompt_ids)
    assert L > 12
    assert tr.records[0].evicted == L - 12 and tr.records[0].cache_len == 12
    assert [r.cache_len for r in tr.records] == list(range(12, 20)) and sum(r.evicted for r in tr.records[1:]) == 0


def test_evicted_counts_add_up(tiny_teacher):
    tr = run(tiny_teacher, None, PROMPT, cfg(mode="teacher", evict=H2O(20, 4)))
    L = len(tr.prompt_ids)
    assert sum(r.evicted for r in tr.records) == L + 29 - tr.records[-1].cache_len
    assert all(r.cache_len <= 20 for r in tr.records)
    assert tr.records[0].evicted == L - 20


def test_confkv_signals_and_sawtooth_through_both_budgets(tiny_teacher):
    """Confidence from the drawn distribution (T = 0.01, top-p 0.9 sharpens the tiny model's flat
    logits: c in ~[0.7, 1]); γ = 0.99 splits the steps, so the run uses BOTH budgets: the cache
    grows on uncertain steps and drops back to ``tight`` on a confident one (the sawtooth)."""
    samp = Sampling(temperature=0.01, top_p=0.9, seed=0)
    pol = ConfKV(gamma=0.99, tight=20, loose=40, protect=4, confidence_from="drawn")
    tr = run(tiny_teacher, None, PROMPT, cfg(mode="teacher", max_new_tokens=40, sampling=samp, evict=pol))
    conf = [r.signals.get("confidence") for r in tr.records]
    budgets = [r.signals.get("budget") for r in tr.records]
    assert all(c is not None for c in conf)
    assert budgets == [20.0 if c >= 0.99 else 40.0 for c in conf]
    assert set(budgets) == {20.0, 40.0}
    assert all(r.cache_len <= b for r, b in zip(tr.records, budgets))
    lens = [r.cache_len for r in tr.records]
    drops = [i for i in range(1, len(lens)) if lens[i - 1] > 20 and budgets[i] == 20.0]
    assert drops and all(lens[i] == 20 and tr.records[i].evicted == lens[i - 1] + 1 - 20 for i in drops)
    # the raw (T = 1) distribution of the tiny model is flat: with confidence_from="raw" every step is uncertain
    raw = run(tiny_teacher, None, PROMPT, cfg(mode="teacher", max_new_tokens=12, sampling=samp,
                                               evict=ConfKV(gamma=0.99, tight=20, loose=40, protect=4)))
    assert {r.signals.get("budget") for r in raw.records} == {40.0}


def test_policy_that_wants_more_than_it_has_changes_nothing(tiny_teacher, tiny_student):
    for mode in ("teacher", "overfill"):
        base = run(tiny_teacher, tiny_student, PROMPT, cfg(mode=mode))
        for pol in (FullCache(), H2O(500, 10), SlidingWindow(500), ConfKV(tight=400, loose=500, protect=8),
                    BlockEvict(4, 2, 100, 2)):
            tr = run(tiny_teacher, tiny_student, PROMPT, cfg(mode=mode, evict=pol))
            assert tr.tokens == base.tokens and sum(r.evicted for r in tr.records) == 0
            assert [r.cache_len for r in tr.records] == [r.cache_len for r in base.records]


def test_eviction_changes_generation_when_it_bites(tiny_teacher):
    base = run(tiny_teacher, None, PROMPT, cfg(mode="teacher"))
    tr = run(tiny_teacher, None, PROMPT, cfg(mode="teacher", evict=SlidingWindow(6, sinks=1)))
    assert tr.tokens != base.tokens


@pytest.mark.parametrize("refresh_next", ["rerun", "student", "teacher"])
def test_refresh_splices_only_live_positions(tiny_teacher, tiny_student, refresh_next):
    d = Decoding(tiny_teacher, tiny_student, PROMPT,
                 cfg(mode="overfill", refresh=Periodic(5), refresh_next=refresh_next, evict=H2O(26, 2)))
    recs = []
    for rec in d:
        recs.append(rec)
        d.cache.check()
        if rec.refreshed:
            assert rec.spliced >= 0
            # every teacher-written live entry of every layer (H2O decides per layer, so each layer holds
            # its own entries) equals the teacher cache's entry at that position
            tc, led = d.teacher_cache, d.cache.ledger
            for layer, rows in enumerate(d.cache.lives):
                mine = {led.position[r]: s for s, r in enumerate(rows) if led.writer[r] == "teacher"}
                theirs = tc.slots_at(list(mine))
                a, b = d.cache.kv(layer)[0], tc.kv(layer)[0]
                for p, s in mine.items():
                    if p in theirs:
                        torch.testing.assert_close(a[:, :, s], b[:, :, theirs[p]])
    assert sum(r.refreshed for r in recs) == 5 and sum(r.evicted for r in recs) > 0


def test_rerotate_with_refresh_is_refused():
    with pytest.raises(ValueError, match="rerotate"):
        DecodeConfig(mode="overfill", refresh=Periodic(4), evict=BlockEvict(rerotate=True))


def test_bad_evict_policy_refused():
    with pytest.raises(ValueError, match="keep"):
        DecodeConfig(evict=object())


def test_to_dict_has_evict_only_when_set():
    assert "evict" not in DecodeConfig().to_dict()
    d = DecodeConfig(evict=H2O(32, 8)).to_dict()
    assert d["evict"] == {"policy": "H2O", "budget": 32, "recent": 8, "ema_decay": 0.9, "per_layer": True, "sinks": 0}


def test_resume_with_eviction(tiny_teacher):
    d = Decoding(tiny_teacher, None, PROMPT, cfg(mode="teacher", max_new_tokens=5))
    list(d)
    r = Decoding.resume(tiny_teacher, d.cache, last_token=d.tokens[-1],
                        max_new_tokens=10, evict=SlidingWindow(12, sinks=2))
    recs = list(r)
    assert all(x.cache_len <= 12 for x in recs) and r.cache is d.cache


# ----------------------------------------------------------------------------- ledger == cache


@pytest.fixture(scope="module")
def one_layer():
    return make_tiny_lm(seed=9, layers=1)


OPS = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(3, 100)),
    st.tuples(st.just("evict"), st.lists(st.integers(0, 200), max_size=6), st.booleans()),
    st.tuples(st.just("refresh"), st.integers(1, 6)),
    st.tuples(st.just("delete"), st.integers(0, 200), st.booleans()),
    st.tuples(st.just("insert"), st.integers(0, 200), st.lists(st.integers(3, 100), min_size=1, max_size=3),
              st.booleans()),
    st.tuples(st.just("int8"), st.integers(1, 6)),
), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_ledger_equals_cache_after_any_mix(one_layer, ops):
    """After any mix of eviction (with/without re-rotation), refresh splices, surgery and INT8
    storage, every live entry's K/V equal those of its ledger row's token at its ledger position
    (one layer: K/V depend on nothing else), every layer has len(live) entries, and the attention
    statistics follow. INT8 entries within their quantization bound."""
    m = one_layer.model
    ids = [5 + (3 * i) % 90 for i in range(14)]
    c = KVCache()
    c.track_attention(0.9)
    c.forward(m, ids, writer="teacher", attention=True)
    teacher = c.copy()                                     # a refresh source at the original positions
    quantized, kmax, vmax = 0, 0.0, 0.0
    for op in ops:
        kind = op[0]
        if kind == "append":
            c.forward(m, [op[1]], writer="student", attention=True)
        elif kind == "evict":
            slots = sorted({s % len(c) for s in op[1]}) if len(c) > 1 else []
            slots = slots[: len(c) - 1]
            c.evict(slots, model=m, rerotate=op[2])
        elif kind == "refresh":
            want = [p for p in range(len(ids) - op[1], len(ids))]
            live = c.slots_at(want)
            ok = [p for p in want if p in live and c.token_ids[live[p]] == ids[p]]
            c.splice_positions(teacher, ok)
        elif kind == "delete" and len(c) > 1:
            c.apply([{"action": "delete", "pos": op[1] % len(c)}], m, writer="teacher", rerotate=op[2])
        elif kind == "insert":
            c.apply([{"action": "insert", "pos": op[1] % (len(c) + 1), "token_ids": op[2]}], m, writer="teacher",
                    rerotate=op[3])
        elif kind == "int8":
            c.quantize_older(op[1], group=2)
        c.check()
        assert c.attn["acc"].shape == (1, len(c)) and c.attn["count"].shape == (len(c),)
        # recompute each entry alone at its position (one layer: K/V depend on nothing else)
        k, v = c.kv(0)
        refs = []
        for tok, pos in zip(c.token_ids, c.positions):
            one = KVCache()
            one.forward(m, [tok], writer="x", positions=[pos])
            refs.append(one.kv(0))
        if not refs:
            continue
        rk = torch.cat([r[0] for r in refs], dim=2)                 # (1, H, T, D)
        rv = torch.cat([r[1] for r in refs], dim=2)
        quantized += kind == "int8"
        # exact unless an entry was ever INT8: then within the quantization bound (absmax / 254 per
        # (group, head, channel) <= absmax of every entry seen / 254; x1.5 for a later rotation of that error)
        kmax, vmax = max(kmax, float(rk.abs().max())), max(vmax, float(rv.abs().max()))   # over every entry seen
        # each quantization after a dequantizing edit (surgery, re-rotation) can add its own error
        tk = quantized * 1.5 * kmax / 254 + 1e-5
        tv = quantized * 1.5 * vmax / 254 + 1e-5
        assert float((k - rk).abs().max()) <= tk
        assert float((v - rv).abs().max()) <= tv


@pytest.fixture(scope="module")
def tiny3():
    return make_tiny_lm(seed=5, layers=3)


def test_block_eviction_picks_blocks_per_layer_on_a_tiny_model(tiny3):
    """OpenVINO's per-layer block choice through the loop: the layers' own scores differ, so they
    keep different entries, the same number of them, and each step's choice is each layer's own."""
    pol = BlockEvict(4, 1, 5, 1, kvcrush=1)
    d = Decoding(tiny3, None, PROMPT, cfg(mode="teacher", evict=pol, max_new_tokens=20))
    for rec in d:
        d.cache.check()
        assert len(set(d.cache.layer_lengths())) == 1 and rec.cache_len <= pol.max_after_eviction
    lp = d.cache.layer_positions()
    assert len(set(lp)) > 1                                   # the layers hold different entries
    assert all(p[:4] == lp[0][:4] and p[-4:] == lp[0][-4:] for p in lp)   # start and recent areas on every layer


def test_pyramidal_confkv_keeps_fewer_in_deeper_layers_and_saves_memory(tiny3):
    """Conf-KV-L: layer l keeps ≈ B·m_l entries with mean m_l = 1, so the K/V bytes EQUAL uniform
    Conf-KV's under the same schedule (γ = 0: every step confident, budget = tight)."""
    kw = dict(gamma=0.0, tight=24, loose=40, protect=4)
    uni = Decoding(tiny3, None, PROMPT, cfg(mode="teacher", evict=ConfKV(**kw), max_new_tokens=12))
    pyr = Decoding(tiny3, None, PROMPT, cfg(mode="teacher", evict=ConfKV(**kw, pyramidal=True, pyramid_ratio=0.5),
                                             max_new_tokens=12))
    ru, rp = list(uni), list(pyr)
    assert uni.cache.layer_lengths() == [24, 24, 24] and pyr.cache.layer_lengths() == [36, 24, 12]
    assert [r.cache_len for r in ru] == [24] * 12
    per_entry = ru[-1].cache_bytes / (3 * 24)                  # K/V bytes of one entry of one layer
    assert rp[-1].cache_bytes == (36 + 24 + 12) * per_entry == ru[-1].cache_bytes      # equal memory


def test_pyramidkv_cuts_the_prompt_per_layer_then_appends(tiny3):
    pol = PyramidKV(budget=12, window=2, beta=4)
    d = Decoding(tiny3, None, PROMPT, cfg(mode="teacher", evict=pol, max_new_tokens=6))
    recs = list(d)
    L = len(d.prompt_ids)
    budgets = pol.layer_budgets(L, 3)
    assert L >= 2 * (12 - 2) and budgets[0] > budgets[1] > budgets[2]
    assert d.cache.layer_lengths() == [b + 5 for b in budgets]          # cut once, then 5 appended entries
    assert recs[0].evicted == L - budgets[0] and sum(r.evicted for r in recs[1:]) == 0
    full = list(Decoding(tiny3, None, PROMPT, cfg(mode="teacher", max_new_tokens=6)))
    per_entry = full[0].cache_bytes / (3 * L)
    assert recs[0].cache_bytes == sum(budgets) * per_entry              # the bytes of what each layer kept


@pytest.mark.parametrize("cls", [SnapKV, PyramidKV])
def test_one_cut_policies_measure_attention_only_until_their_cut(tiny_teacher, cls):
    """SnapKV and PyramidKV read attention only at their first-step cut (``attention_steps = "first"``): later
    forwards run unmeasured, which changes no token and no kept entry against the same policy measuring every step,
    and the entries appended after the cut carry no measured mass."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Always(cls):
        attention_steps = "all"

    def go(pol):
        d = Decoding(tiny_teacher, None, PROMPT, cfg(mode="teacher", max_new_tokens=10, evict=pol))
        recs = list(d)
        return d, recs

    lazy, eager = go(cls(budget=12, window=4)), go(Always(budget=12, window=4))
    assert [r.token_id for r in lazy[1]] == [r.token_id for r in eager[1]]
    assert [r.evicted for r in lazy[1]] == [r.evicted for r in eager[1]]
    assert lazy[0].cache.layer_positions() == eager[0].cache.layer_positions()
    late = lambda d: float(d.cache.layer_attn()["acc"][0][-5:].abs().sum())   # noqa: E731 entries after the cut
    assert late(lazy[0]) == 0.0 and late(eager[0]) > 0.0
