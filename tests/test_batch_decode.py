"""Batched decoding: a batch of B prompts gives, row for row, what B single runs give.

Tolerance: the batched forward runs other matmul shapes and a padded, masked attention, so logits
differ from a single run's by float rounding (~1e-7 on the tiny models). We assert EXACT equality
of everything discrete (tokens, refresh/probe steps, evicted counts, cache lengths, live positions
and writers per layer) and |Δ| <= 1e-4 on log-probs, entropies and cached K/V.
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_lm
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.decode import BatchDecoding, BatchError, DecodeConfig, Decoding, Sampling, run, run_batch
from kvlab.eviction import (EVICTION_POLICIES, H2O, BlockEvict, ConfKV, FullCache, Knorm, PyramidKV, RandomEvict,
                            Scissorhands, SlidingWindow, SnapKV, SnapKVScorer, StreamingLLM)
from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative
from kvlab.uncertainty.mc import MCGate

TOL = 1e-4
PROMPTS = ["the quick brown fox", "sky", "jumps over the lazy dog and then some more words", "a b c d e f"]


def cfg(**kw):
    base = dict(max_new_tokens=24, chat=False, keep_dists=True)
    base.update(kw)
    return DecodeConfig(**base)


def batch_and_singles(teacher, student, prompts, config):
    configs = config if isinstance(config, list) else [config] * len(prompts)
    bd = BatchDecoding(teacher, student, prompts, configs)
    recs = [[] for _ in prompts]
    for b, r in bd:
        recs[b].append(r)
    assert not bd.errors, bd.errors
    singles = []
    for p, c in zip(prompts, configs):
        d = Decoding(teacher, student, p, c)
        singles.append((d, list(d)))
    return bd, recs, singles


def assert_rows_equal(bd, recs, singles):
    for b, (d, srecs) in enumerate(singles):
        brecs, row = recs[b], bd.rows[b]
        assert [r.token_id for r in brecs] == [r.token_id for r in srecs], f"row {b} tokens"
        for f in ("step", "position", "refreshed", "probed", "evicted", "cache_len", "spliced", "teacher_tokens",
                  "source", "since_refresh", "probe_tokens"):
            assert [getattr(r, f) for r in brecs] == [getattr(r, f) for r in srecs], f"row {b} {f}"
        for f in ("logprob", "entropy_bits"):
            assert [getattr(r, f) for r in brecs] == pytest.approx([getattr(r, f) for r in srecs], abs=TOL)
        for rb, rs in zip(brecs, srecs):
            assert dict(rb.signals).keys() == dict(rs.signals).keys()
            for k, v in rs.signals:
                assert rb.signals[k] == pytest.approx(v, abs=1e-3, rel=1e-3), f"row {b} signal {k}"
        assert len(row.dists) == len(d.dists)
        for x, y in zip(row.dists, d.dists):
            assert float((x - y).abs().max()) <= TOL
        bc, sc = row.cache, d.cache
        bc.check()
        assert bc.layer_positions() == sc.layer_positions(), f"row {b} live positions"
        assert bc.writers == sc.writers and bc.next_position == sc.next_position
        assert bc.n_int8 == sc.n_int8
        for i in range(sc.num_layers):
            (kb, vb), (ks, vs) = bc.kv(i), sc.kv(i)
            assert kb.shape == ks.shape
            for xb, xs in ((kb, ks), (vb, vs)):     # rounding scales with the entries (the real teacher's keys reach
                assert float((xb - xs).abs().max()) <= TOL * max(1.0, float(xs.abs().max()))   # tens: 1.1e-4 seen)


@pytest.mark.parametrize("mode", ["teacher", "student", "overfill"])
def test_plain_batch_equals_single_runs(tiny_teacher, tiny_student, mode):
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, PROMPTS, cfg(mode=mode)))


def test_sampled_rows_keep_their_own_rng_streams(tiny_teacher, tiny_student):
    """Each row's RNG is seeded from its own (prompt, seed); the same prompt with two seeds in one batch."""
    configs = [cfg(mode="overfill", sampling=Sampling(temperature=0.9, top_p=0.95, seed=s)) for s in (0, 1, 2, 0)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, prompts, configs)
    assert_rows_equal(bd, recs, singles)
    assert [r.token_id for r in recs[0]] != [r.token_id for r in recs[1]]      # seeds differ -> streams differ


REFRESH = [Periodic(5), Periodic(4, W=2), EntropyGate(6.9, min_gap=2), ProbeKL(3, 0.02), Speculative(4),
           MCGate(threshold=0.0, probe_every=4, refractory=3, n_passes=4)]


@pytest.mark.parametrize("policy", REFRESH, ids=lambda p: type(p).__name__ + str(getattr(p, "W", "")))
def test_refresh_policies_batched_equal_single(tiny_teacher, tiny_student, policy):
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, PROMPTS, cfg(refresh=policy))
    assert_rows_equal(bd, recs, singles)
    assert any(r.refreshed or r.probed for rr in recs for r in rr)


@pytest.mark.parametrize("nxt", ["student", "teacher"])
def test_refresh_next_variants_batched_equal_single(tiny_teacher, tiny_student, nxt):
    """``teacher`` leaves pending logits (the row skips the batched forward that step)."""
    configs = [cfg(refresh=Periodic(3 + b), refresh_next=nxt) for b in range(len(PROMPTS))]
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, PROMPTS, configs))


EVICT = {"full": FullCache(), "sliding": SlidingWindow(14, sinks=2), "h2o": H2O(14, 4), "random": RandomEvict(14, 4),
         "confkv": ConfKV(tight=12, loose=18, protect=4, int8_window=4, int8_group=4, pyramidal=True),
         "block": BlockEvict(4, 1, 3, 1), "snapkv": SnapKV(budget=8, window=3),
         "scissorhands": Scissorhands(14, 4), "pyramidkv": PyramidKV(budget=8, window=2, beta=4),
         "knorm": Knorm(8), "snapkv_scorer": SnapKVScorer(budget=8, window=3),
         "streamingllm": StreamingLLM(14, sinks=2)}
# Key norms tie structurally: at layer 0 a token's pre-RoPE key depends on the token alone and RoPE keeps
# norms, so every repeat of a token ties up to float rounding, and the batched forward's rounding (~1e-7)
# may keep the other copy. Knorm's rows therefore compress prompts of distinct tokens, once (prefill only).
DISTINCT = ["abcdefghijklm", "nopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRS", "0123456789!?"]
TIE_PRONE = {"knorm"}


def test_every_eviction_policy_is_covered():
    assert set(EVICT) == set(EVICTION_POLICIES)


@pytest.mark.parametrize("name", sorted(EVICT))
@pytest.mark.parametrize("mode", ["teacher", "overfill"])
def test_eviction_policies_batched_equal_single(tiny_teacher, tiny_student, name, mode):
    prompts = DISTINCT if name in TIE_PRONE else PROMPTS
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, prompts, cfg(mode=mode, evict=EVICT[name]))
    assert_rows_equal(bd, recs, singles)
    if name != "full":
        assert any(r.evicted for rr in recs for r in rr)


def test_eviction_with_refresh_and_rerotation_batched(tiny_teacher, tiny_student):
    configs = [cfg(evict=H2O(14, 4), refresh=Periodic(5)), cfg(evict=BlockEvict(4, 1, 3, 1, rerotate=True)),
               cfg(evict=SlidingWindow(10, sinks=1), refresh=ProbeKL(3, 0.02)), cfg()]
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, PROMPTS, configs))


def test_rows_stop_early_without_stalling_the_others(tiny_teacher, tiny_student):
    configs = [cfg(max_new_tokens=n) for n in (3, 20, 1, 9)]
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, PROMPTS, configs)
    assert [len(r) for r in recs] == [3, 20, 1, 9]
    assert_rows_equal(bd, recs, singles)


@pytest.mark.parametrize("mode", ["teacher", "overfill"])
def test_finished_rows_leave_the_batched_forward(tiny_teacher, tiny_student, mode, monkeypatch):
    """A row that finished is swapped out of the banks' width (the teacher bank too, in overfill): later
    forwards run over the live rows only, and every row — moved or finished — still equals its single run."""
    import kvlab.cache.batch as cb

    widths = []
    orig = cb.forward_rows

    def spy(bank, model, caches, tokens, **k):
        widths.append((bank is bd.bank, bank.width, sum(c is not None for c in caches)))
        return orig(bank, model, caches, tokens, **k)

    monkeypatch.setattr(cb, "forward_rows", spy)
    refresh = Periodic(4) if mode == "overfill" else None
    configs = [cfg(mode=mode, max_new_tokens=n, refresh=refresh) for n in (3, 20, 1, 9)]
    bd = BatchDecoding(tiny_teacher, tiny_student, PROMPTS, configs)
    recs = [[] for _ in PROMPTS]
    for b, r in bd:
        recs[b].append(r)
    assert [len(r) for r in recs] == [3, 20, 1, 9]
    dec = [w for is_dec, w, _ in widths if is_dec]
    # the decoder's first batched forward is the prefill (teacher) or step 2, after row 2's only step (overfill)
    assert dec[0] == (4 if mode == "teacher" else 3) and dec[-1] == 1 and sorted(dec, reverse=True) == dec
    assert all(w >= n for _, w, n in widths)
    assert sorted(bd.slot) == [0, 1, 2, 3] and bd.slot[1] == 0                      # the longest row moved to slot 0
    singles = [(d, list(d)) for d in (Decoding(tiny_teacher, tiny_student, p, c) for p, c in zip(PROMPTS, configs))]
    assert_rows_equal(bd, recs, singles)
    if mode == "overfill":
        assert bd.teacher_bank.width == bd.bank.width
        for b, d in enumerate(bd.rows):
            assert bd.teacher_bank.owns(bd.slot[b], d.teacher_cache) and bd.bank.owns(bd.slot[b], d.cache)


def test_prompts_prefill_in_one_batched_forward_or_fall_back_per_row(tiny_teacher, tiny_student, monkeypatch):
    """The rows' prompts (different lengths) prefill in ONE batched forward; a row measuring attention mass
    during its prefill (H2O) prefills alone; and when the batched prefill fails, nothing was committed and every
    row prefills on its own — each way, every row equals its single run."""
    import kvlab.cache.batch as cb
    import kvlab.cache.forward as cf

    orig_rows, orig_one = cb.forward_rows, cf.forward
    seen = {"batched": [], "single": 0}

    def rows_spy(bank, model, caches, tokens, **k):
        if all(s == -1 for s in k["steps"]):
            seen["batched"].append(sum(c is not None for c in caches))
            if fail:
                raise RuntimeError("no batched prefill today")
        return orig_rows(bank, model, caches, tokens, **k)

    def one_spy(cache, model, ids, **k):
        seen["single"] += k.get("step", 0) == -1
        return orig_one(cache, model, ids, **k)

    monkeypatch.setattr(cb, "forward_rows", rows_spy)
    monkeypatch.setattr(cf, "forward", one_spy)
    for fail, configs, batched, single in (
            (False, [cfg(mode="teacher")] * 4, [4], 0),
            (False, [cfg(mode="teacher", evict=H2O(14, 4))] + [cfg(mode="teacher")] * 3, [3], 1),
            (True, [cfg(mode="teacher")] * 4, [4], 4)):
        seen.update(batched=[], single=0)
        bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, PROMPTS, configs)
        assert seen["batched"] == batched and seen["single"] == single + len(PROMPTS)   # + the single runs'
        assert len(bd.prefill_errors) == fail
        assert_rows_equal(bd, recs, singles)


def test_bank_swap_moves_rows_with_their_content(tiny_teacher):
    bank = Bank.for_model(tiny_teacher.model, 3, capacity=16)
    caches = [bank.row_cache(b) for b in range(3)]
    ids = [tiny_teacher.encode_prompt(p) for p in PROMPTS[:3]]
    forward_rows(bank, tiny_teacher.model, caches, ids, writer="teacher", steps=[-1] * 3)
    before = [[tuple(t.clone() for t in c.kv(i)) for i in range(c.num_layers)] for c in caches]
    bank.swap(0, 2)
    assert bank.owns(2, caches[0]) and bank.owns(0, caches[2]) and bank.owns(1, caches[1])
    for c, kv in zip(caches, before):
        c.check()
        for i, (k, v) in enumerate(kv):
            assert torch.equal(c.kv(i)[0], k) and torch.equal(c.kv(i)[1], v)
    bank.set_width(2)
    with pytest.raises(ValueError, match="past the bank's width"):
        forward_rows(bank, tiny_teacher.model, caches, [[1], [1], [1]], writer="teacher", steps=[0] * 3)
    with pytest.raises(ValueError, match="width=0"):
        bank.set_width(0)


def test_eos_row_drops_out(tiny_teacher, tiny_student):
    single = run(tiny_teacher, tiny_student, PROMPTS[0], cfg(ignore_eos=False))
    eos = single.tokens[4]                                   # pretend row 0's 5th token is EOS
    bd = BatchDecoding(tiny_teacher, tiny_student, PROMPTS[:3], [cfg(ignore_eos=False), cfg(), cfg()])
    bd.rows[0].eos_ids = {eos}
    recs = [[] for _ in range(3)]
    for b, r in bd:
        recs[b].append(r)
    assert [r.token_id for r in recs[0]] == single.tokens[:single.tokens.index(eos) + 1]
    assert len(recs[1]) == len(recs[2]) == 24


def test_run_batch_traces_match_run(tiny_teacher, tiny_student):
    done = []
    traces = run_batch(tiny_teacher, tiny_student, PROMPTS[:2], cfg(), on_row=lambda b, t: done.append(b))
    assert sorted(done) == [0, 1]
    for p, tr in zip(PROMPTS, traces):
        ref = run(tiny_teacher, tiny_student, p, cfg())
        assert tr.tokens == ref.tokens and tr.live == ref.live and tr.prompt == p
        assert float((tr.model_logprobs - ref.model_logprobs).abs().max()) <= TOL


def test_a_failing_row_does_not_lose_the_others(tiny_teacher, tiny_student):
    class Boom:
        """A refresh policy whose decision raises at step 3 (for row 1 only)."""
        probe = None

        def should_refresh(self, rec):
            if rec.step == 3:
                raise RuntimeError("boom")
            return False

    from dataclasses import replace

    configs = [cfg(), cfg(), cfg()]
    bd = BatchDecoding(tiny_teacher, tiny_student, PROMPTS[:3], configs)
    bd.rows[1].config = replace(bd.rows[1].config, refresh=Boom())   # skip validation: a broken policy
    recs = [[] for _ in range(3)]
    for b, r in bd:
        recs[b].append(r)
    assert list(bd.errors) == [1] and "boom" in str(bd.errors[1])
    assert len(recs[0]) == len(recs[2]) == 24 and len(recs[1]) == 2


@pytest.mark.parametrize("prompts, match", [
    (["ok", ""], "row 1"), (["ok", "   "], "row 1"), ([], "non-empty list"), ("one string", "non-empty list"),
])
def test_bad_prompts_are_refused_naming_the_row(tiny_teacher, tiny_student, prompts, match):
    with pytest.raises(ValueError, match=match):
        BatchDecoding(tiny_teacher, tiny_student, prompts, cfg())


def test_prompt_longer_than_context_refused(tiny_teacher, tiny_student):
    with pytest.raises(ValueError, match=r"row 1: prompt has 600 tokens.*max_position_embeddings"):
        BatchDecoding(tiny_teacher, tiny_student, ["ok", "x" * 600], cfg())


def test_mixed_modes_and_unbatchable_policies_refused(tiny_teacher, tiny_student):
    with pytest.raises(ValueError, match=r"row 1: mode='teacher'"):
        BatchDecoding(tiny_teacher, tiny_student, ["ab", "cd"], [cfg(), cfg(mode="teacher")])

    class Solo(Periodic):
        batchable = False

    with pytest.raises(ValueError, match=r"row 0: refresh=Solo cannot run batched"):
        BatchDecoding(tiny_teacher, tiny_student, ["ab", "cd"], cfg(refresh=Solo(3)))


def test_mixed_devices_refused(tiny_teacher):
    class Fake:
        def __init__(self, lm, dev):
            self._lm, self.device = lm, torch.device(dev)

        def __getattr__(self, k):
            return getattr(self._lm, k)

    other = make_tiny_lm(seed=1, intermediate_size=48)
    with pytest.raises(ValueError, match="different devices"):
        BatchDecoding(tiny_teacher, Fake(other, "meta"), ["ab", "cd"], cfg())


def test_batch_error_keeps_finished_traces(tiny_teacher, tiny_student, monkeypatch):
    calls = []

    def boom(self, *a, **k):
        raise RuntimeError("row prefill failed")

    bd_cls = BatchDecoding
    orig = Decoding._begin

    def flaky(self, *a):
        calls.append(self.prompt)
        if self.prompt == "sky":
            raise RuntimeError("row prefill failed")
        return orig(self, *a)

    monkeypatch.setattr(Decoding, "_begin", flaky)
    got = []
    with pytest.raises(BatchError, match="row 1") as ei:
        run_batch(tiny_teacher, tiny_student, PROMPTS[:3], cfg(max_new_tokens=5), on_row=lambda b, t: got.append(b))
    assert sorted(got) == [0, 2] and ei.value.traces[1] is None and ei.value.traces[0] is not None
    assert bd_cls is BatchDecoding


# ----------------------------------------------------------------------------- the storage itself


def test_forward_rows_matches_single_caches_through_growth(tiny_teacher):
    """Rows of one bank vs standalone caches over 80 steps from capacity 64 (the bank grows)."""
    m = tiny_teacher.model
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    bank = Bank.for_model(m, 3, capacity=8)
    rows, single = [], []
    for b, p in enumerate(prompts):
        c = bank.row_cache(b)
        c.forward(m, p, writer="teacher")
        s = KVCache()
        toks_logits = s.forward(m, p, writer="teacher")
        rows.append(c), single.append(s)
    toks = [int(s.forward(m, [3], writer="teacher").argmax()) for s in single]
    for c in rows:
        c.forward(m, [3], writer="teacher")          # B = 1 forward on a row (the row's own path)
    for step in range(80):
        out = forward_rows(bank, m, rows, toks, writer="teacher", steps=[step] * 3)
        ref = [s.forward(m, [t], writer="teacher", step=step) for s, t in zip(single, toks)]
        assert max(float((out[b] - ref[b]).abs().max()) for b in range(3)) <= TOL
        toks = [int(r.argmax()) for r in ref]
    assert bank.capacity(0) > 64
    for c, s in zip(rows, single):
        c.check()
        assert c.positions == s.positions and c.token_ids == s.token_ids
        for i in range(s.num_layers):
            assert float((c.kv(i)[0] - s.kv(i)[0]).abs().max()) <= TOL


def test_forward_rows_is_all_or_nothing(tiny_teacher):
    m = tiny_teacher.model
    bank = Bank.for_model(m, 2)
    rows = [bank.row_cache(b) for b in range(2)]
    for c in rows:
        c.forward(m, [5, 6, 7], writer="teacher")
    before = [(c.layer_lengths(), list(c.live), len(c.ledger)) for c in rows]
    with pytest.raises(ValueError, match="row 1: its cache is not row 1"):
        forward_rows(bank, m, [rows[0], rows[0]], [4, 4], writer="teacher", steps=[0, 0])
    with pytest.raises(IndexError):
        forward_rows(bank, m, rows, [4, 10_000], writer="teacher", steps=[0, 0])   # token outside the vocab
    assert [(c.layer_lengths(), list(c.live), len(c.ledger)) for c in rows] == before
    for c in rows:
        c.check()


def test_dummy_rows_leave_their_cache_alone(tiny_teacher):
    m = tiny_teacher.model
    bank = Bank.for_model(m, 2)
    rows = [bank.row_cache(b) for b in range(2)]
    for c in rows:
        c.forward(m, [5, 6, 7], writer="teacher")
    k0 = rows[1].kv(0)[0]
    forward_rows(bank, m, [rows[0], None], [4, None], writer="teacher", steps=[0, 0])
    assert len(rows[1]) == 3 and torch.equal(rows[1].kv(0)[0], k0) and len(rows[0]) == 4


def test_no_deprecated_cache_kwarg_warning(tiny_teacher, tiny_student, caplog):
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; no kvlab forward may use the old name."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    from transformers.utils import generic

    generic.logger.warning_once.cache_clear() if hasattr(generic.logger.warning_once, "cache_clear") else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with caplog.at_level(logging.WARNING):
                run(tiny_teacher, tiny_student, "abc", cfg(max_new_tokens=4, refresh=Periodic(2)))
                run(tiny_teacher, tiny_student, "abc", cfg(max_new_tokens=4, refresh=MCGate(0.0, probe_every=1)))
                run_batch(tiny_teacher, tiny_student, ["abc", "de"], cfg(max_new_tokens=4, evict=H2O(4, 2)))
                c = KVCache.prefill(tiny_teacher.model, [5, 6, 7, 8], writer="teacher")[0]
                c.insert(1, [9], tiny_teacher.model, writer="teacher")
    finally:
        hf_logging.disable_propagation()
    assert not [r for r in caplog.records if "deprecated" in r.getMessage()], caplog.text


# ----------------------------------------------------------------------------- the real pair

REAL = ["Why is the sky blue?", "Write a haiku about autumn leaves falling on a quiet pond.", "What is 2 + 2?"]


@pytest.mark.integration
@pytest.mark.parametrize("config", [
    DecodeConfig(mode="overfill", max_new_tokens=12, keep_dists=True, refresh=Periodic(5)),
    DecodeConfig(mode="teacher", max_new_tokens=12, keep_dists=True, evict=H2O(24, 8)),
], ids=["overfill-periodic5", "teacher-h2o"])
def test_real_pair_batch_equals_single(real_pair, config):
    teacher, student = real_pair
    assert_rows_equal(*batch_and_singles(teacher, student, REAL, config))


@pytest.mark.parametrize("policy", [Periodic(5), ProbeKL(3, 0.02), EntropyGate(6.9, min_gap=2)],
                         ids=lambda p: type(p).__name__)
def test_teacher_catch_up_is_one_batched_forward(tiny_teacher, tiny_student, policy, monkeypatch):
    """Rows whose refresh (or teacher-KL probe) is due at a step get their teachers caught up in ONE
    batched forward; the teacher's prefill is one batched forward too, and the teacher runs per row only
    for a probe-triggered refresh's last token."""
    import kvlab.cache.batch as cb
    import kvlab.cache.forward as cf

    calls = {"batched": 0, "single": 0}
    orig_rows, orig_one = cb.forward_rows, cf.forward

    def rows_spy(bank, model, *a, **k):
        calls["batched"] += model is tiny_teacher.model
        return orig_rows(bank, model, *a, **k)

    def one_spy(cache, model, ids, **k):
        calls["single"] += model is tiny_teacher.model and k.get("step", -1) >= 0
        return orig_one(cache, model, ids, **k)

    monkeypatch.setattr(cb, "forward_rows", rows_spy)
    monkeypatch.setattr(cf, "forward", one_spy)
    bd = BatchDecoding(tiny_teacher, tiny_student, PROMPTS, cfg(refresh=policy))
    recs = [[] for _ in PROMPTS]
    for b, r in bd:
        recs[b].append(r)
    counted = dict(calls)
    assert not bd.catch_up_errors and not bd.errors
    refreshes = sum(r.refreshed for rr in recs for r in rr)
    assert counted["batched"] >= 1
    if isinstance(policy, Periodic):
        assert counted["batched"] == 4 + 1 and refreshes == 4 * len(PROMPTS)     # 4 catch-ups + the prefill
    assert counted["single"] <= (refreshes if isinstance(policy, ProbeKL) else 0)
    singles = []
    for p in PROMPTS:
        d = Decoding(tiny_teacher, tiny_student, p, cfg(refresh=policy))
        singles.append((d, list(d)))
    assert_rows_equal(bd, recs, singles)


@pytest.mark.parametrize("evict", [None, "h2o", "sliding", "confkv", "snapkv"])
def test_padded_key_widths_decode_as_the_exact_ones(tiny_teacher, tiny_student, evict, monkeypatch):
    """On CUDA a batched step pads its key widths to a multiple of kvlab.cache.batch.WIDTH_STEP columns (masked).
    Forced onto this CPU, a batched run with eviction (holes, ragged rows, attention mass through the sink) still
    equals the single runs, and the model did see padded widths."""
    import kvlab.cache.batch as cb

    monkeypatch.setattr(cb, "WIDTH_STEP", {"cpu": 8})
    widths = []
    orig = cb._StepLayer.__init__

    def spy(self, bank, i, cols, width, lo=0):
        widths.append((width, bank.capacity(i)))
        assert 0 <= lo and lo + width <= bank.capacity(i)
        orig(self, bank, i, cols, width, lo)

    monkeypatch.setattr(cb._StepLayer, "__init__", spy)
    policy = EVICT[evict] if evict else None
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, PROMPTS, cfg(mode="teacher", evict=policy)))
    assert widths and all(w % 8 == 0 or w == cap for w, cap in widths)
    assert any(w % 8 == 0 and w < cap for w, cap in widths)
