"""``Every``: any eviction policy asked only at the first step and every N-th step after it (kvpress's
DecodingPress compression interval). The loop builds no view and edits nothing in between; at an asked step the
wrapped policy decides as it always does; every=1 is the wrapped policy itself; batched rows equal single runs."""
from __future__ import annotations

import pytest

from kvlab.decode import BatchDecoding, DecodeConfig, Decoding
from kvlab.decode.keys import policy_dict
from kvlab.decode.protocols import evict_attr, evict_due, validate_evict
from kvlab.eviction import H2O, ConfKV, Every, SlidingWindow, SnapKV
from kvlab.studies.bench.evict_batch import with_every
from test_batch_decode import assert_rows_equal, batch_and_singles

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words"


def cfg(evict, n=20):
    return DecodeConfig(max_new_tokens=n, chat=False, mode="teacher", evict=evict)


def records(lm, evict, n=20):
    d = Decoding(lm, lm, PROMPT, cfg(evict, n))
    return d, list(d)


def test_every_one_is_the_wrapped_policy(tiny_teacher):
    for pol in (H2O(budget=8, recent=2), SlidingWindow(window=8, sinks=2)):
        d1, r1 = records(tiny_teacher, pol)
        d2, r2 = records(tiny_teacher, Every(pol, every=1))
        assert [r.token_id for r in r1] == [r.token_id for r in r2]
        assert [r.cache_len for r in r1] == [r.cache_len for r in r2]
        assert d1.cache.layer_positions() == d2.cache.layer_positions()


@pytest.mark.parametrize("every", [3, 5])
def test_asked_only_every_nth_step(tiny_teacher, every):
    pol = H2O(budget=8, recent=2)
    d, recs = records(tiny_teacher, Every(pol, every=every))
    first = recs[0].step
    for r in recs:
        asked = (r.step - first) % every == 0
        if not asked:
            assert r.evicted == 0, f"step {r.step}: evicted while not asked"
        else:
            assert r.cache_len <= 8, f"step {r.step}: an asked step cuts to the budget"
        assert r.cache_len <= 8 + every - 1                        # grows at most every - 1 past the budget
    assert any(r.evicted > 1 for r in recs[1:])                    # a later cut takes several entries at once
    assert max(r.cache_len for r in recs) == 8 + every - 1
    d.cache.check()


def test_decisions_are_applied_only_at_asked_steps(tiny_teacher):
    """The loop's evict phase runs at the first step and every 4th after it, and at no other step."""
    pol = SlidingWindow(window=8, sinks=2)
    d = Decoding(tiny_teacher, tiny_teacher, PROMPT, cfg(Every(pol, every=4), 12))
    seen = []
    orig = d._apply_evict

    def spy(rec, decision):
        seen.append(rec.step)
        return orig(rec, decision)

    d._apply_evict = spy
    recs = list(d)
    first = recs[0].step
    assert seen == [r.step for r in recs if (r.step - first) % 4 == 0]


@pytest.mark.parametrize("pol", [H2O(budget=8, recent=2), SlidingWindow(window=8, sinks=2), SnapKV(budget=8, window=2),
                                 ConfKV(tight=6, loose=10, protect=2)])
def test_batched_rows_equal_single_runs(tiny_teacher, tiny_student, pol):
    prompts = ["the quick brown fox", "sky", "jumps over the lazy dog and then some more words"]
    config = DecodeConfig(max_new_tokens=16, chat=False, keep_dists=True, mode="teacher", evict=Every(pol, every=4))
    assert_rows_equal(*batch_and_singles(tiny_teacher, tiny_student, prompts, config))


def test_attributes_are_the_wrapped_policys():
    inner = H2O(budget=8, recent=2)
    w = Every(inner, every=4)
    for name in ("needs_attention", "ema_decay", "attention_window", "attention_below", "score_stat"):
        assert evict_attr(w, name) == evict_attr(inner, name)
    assert evict_attr(w, "needs_attention") is True and (w.budget, w.recent) == (8, 2)
    assert evict_attr(w, "every") == 4 and evict_attr(inner, "every") == 1
    assert [evict_due(w, s) for s in range(1, 10)] == [True, False, False, False, True, False, False, False, True]
    assert [evict_due(w, s, first_step=3) for s in range(3, 8)] == [True, False, False, False, True]
    assert policy_dict(w) != policy_dict(Every(inner, every=8))


def test_run_key_names_the_wrapped_policy():
    d = policy_dict(Every(H2O(budget=8, recent=2), every=4))
    assert d["policy"] == "Every" and d["every"] == 4
    assert d["inner"] == policy_dict(H2O(budget=8, recent=2))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_every_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="every="):
        Every(H2O(budget=8, recent=2), every=bad)


def test_bad_policy_and_nesting_are_refused():
    with pytest.raises(ValueError, match="inner="):
        Every(object(), every=4)
    with pytest.raises(ValueError, match="nesting"):
        Every(Every(H2O(budget=8, recent=2), every=2), every=4)


def test_validate_evict_checks_a_policys_own_every():
    class Odd(SlidingWindow):
        every = 0

    with pytest.raises(ValueError, match="evict.every"):
        validate_evict(Odd(window=8))


def test_bench_labels():
    pols = {"full": object(), "h2o": H2O(budget=8, recent=2)}
    got = with_every(pols, [1, 16])
    assert list(got) == ["full", "h2o", "h2o/every16"]
    assert got["h2o/every16"][:2] == ("h2o", 16) and got["h2o/every16"][2].every == 16
    with pytest.raises(ValueError, match="every="):
        with_every(pols, [0])


def test_bench_rows_name_the_interval(tiny_teacher):
    from kvlab.studies.bench.evict_batch import bench_evict_batch

    rows = bench_evict_batch(tiny_teacher, [2], cache_len=64, steps=8, repeats=1, every=[1, 4])
    got = {(r["policy"], r["every"]) for r in rows}
    assert ("h2o", 1) in got and ("h2o", 4) in got and ("full", 1) in got and ("full", 4) not in got
    assert {(r["policy"], r["every"]) for r in rows if r["resident"]} == {(p, 1) for p in ("sliding", "h2o",
                                                                                         "scissorhands", "block", "confkv")}
    for r in rows:
        assert r["plain_ms"] > 0 and r["step_ms"] > 0 and r["asked_ms"] > 0 and r["final_len"] >= 1
    with pytest.raises(ValueError, match=r"--tokens.*at least 8"):
        bench_evict_batch(tiny_teacher, [2], cache_len=64, steps=6, repeats=1, every=[1, 4])


def test_period_times_spread_the_asked_step():
    """A policy asked every 4 steps is timed over whole periods that start at an asked step (1, 5, 9, ...): the
    asked step's cost counts once per period; a per-step median would leave it out."""
    from kvlab.studies.bench.timing import period_times

    times = [1.0 if (s - 1) % 4 else 9.0 for s in range(2, 14)]        # steps 2..13; asked steps 5 and 9 cost 9
    assert period_times(times, 4) == [3.0, 3.0]                         # periods 5-8 and 9-12; 13 is no whole one
    assert sorted(times)[len(times) // 2] == 1.0                        # the per-step median hides them
    assert period_times(times, 1) == times
    assert period_times(times[:3], 4) == []


def test_bench_records_compute_the_step_signals_when_read():
    """The batched bench's records (what Conf-KV's confidence reads): nothing computed until a policy reads a
    signal, then every row's at once, the same numbers as the decode loop's token_stats_rows."""
    import torch

    from kvlab.decode.sampling import token_stats_rows
    from kvlab.studies.bench.evict_batch import _Signals

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    s = _Signals(logits)
    recs = [s.row(7, b) for b in range(3)]
    assert s.got is None and recs[1].step == 7
    want = token_stats_rows(logits)
    assert [(r.entropy_bits, r.top1_prob, r.margin) for r in recs] == [w[1:4] for w in want]
