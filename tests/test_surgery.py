"""Cache surgery (seed 004 "Step 4"): coupled delete/insert/replace_pair/add ticks on KVCache.

The pure-Python reference below is the seed's sequential algorithm written out literally (sort
descending, list.pop / slice-insert, appends last) on a list of (token, position) pairs; the
cache's batched one-concat-per-layer tick must agree with it on every example.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_lm
from kvlab.cache import KVCache, SurgeryError, plan_actions
from kvlab.decode import Decoding, Sampling
from kvlab.decode import continue_from

VOCAB = 64
MAX_LEN = 12


@pytest.fixture(scope="module")
def lm1():
    """One layer, tiny: the property tests' model."""
    return make_tiny_lm(seed=5, layers=1, vocab=VOCAB)


@pytest.fixture(scope="module")
def lm2():
    return make_tiny_lm(seed=6, layers=2, vocab=VOCAB)


@pytest.fixture(scope="module")
def bases(lm1):
    """Prefilled caches of length 0..MAX_LEN (copied per example)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (MAX_LEN,), generator=g).tolist()
    out = {0: KVCache()}
    for n in range(1, MAX_LEN + 1):
        out[n] = KVCache.prefill(lm1.model, ids[:n], writer="base")[0]
    return out


# ---------------------------------------------------------------------------- reference + strategies


def reference(seq, next_pos, actions):
    """The seed's Step 4 on a list of (token, position): descending order, appends last.

    Positions follow kvlab's no-shift rule: survivors keep theirs; a block inserted at slot s
    starts after its left neighbour (0 at slot 0), or at ``next_pos`` when s is the pre-tick end.
    """
    seq, L0 = list(seq), len(seq)
    new_pos = []

    def ins(s, ids):
        start = next_pos if s == L0 else (seq[s - 1][1] + 1 if s > 0 else 0)
        block = [(t, start + k) for k, t in enumerate(ids)]
        new_pos.extend(p for _, p in block)
        seq[s:s] = block

    def key(a):
        if a["action"] == "delete":
            return (a["pos"], 1)
        if a["action"] == "replace_pair":
            return (a["original_pos1"], 1)
        return (a["pos"], 0)

    for a in sorted((a for a in actions if a["action"] != "add"), key=key, reverse=True):
        if a["action"] == "delete":
            seq.pop(a["pos"])
        elif a["action"] == "replace_pair":
            seq.pop(a["original_pos2"])
            seq.pop(a["original_pos1"])
            ins(a["original_pos1"], a["new_token_ids"])
        else:
            ins(a["pos"], a["token_ids"])
    if new_pos:
        next_pos = max(next_pos, max(new_pos) + 1)
    for a in actions:
        if a["action"] == "add":
            seq.append((a["token_id"], next_pos))
            next_pos += 1
    return seq, next_pos


@st.composite
def action_lists(draw, length: int):
    """A valid action list for a cache of ``length`` slots, in random order."""
    toks = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)
    acts, s = [], 0
    while s <= length:
        if draw(st.integers(0, 3)) == 3:
            acts.append({"action": "insert", "pos": s, "token_ids": draw(toks)})
        if s == length:
            break
        r = draw(st.integers(0, 4))
        if r == 1:
            acts.append({"action": "delete", "pos": s})
            s += 1
        elif r == 2 and s + 1 < length:
            p2 = draw(st.integers(s + 1, min(length - 1, s + 3)))
            acts.append({"action": "replace_pair", "original_pos1": s, "original_pos2": p2,
                         "new_token_ids": draw(toks)})
            s = p2 + 1
        else:
            s += 1
    acts += [{"action": "add", "token_id": t} for t in draw(st.lists(st.integers(0, VOCAB - 1), max_size=3))]
    return draw(st.permutations(acts))


def _ledger_snapshot(c):
    led = c.ledger
    return list(led.token_id), list(led.position), list(led.writer), list(led.step)


def _kept_kv_equal(before, after):
    """Entries that survive a tick (same ledger row) hold bit-identical K/V at their new slot."""
    old_slot = {r: s for s, r in enumerate(before.live)}
    pairs = [(old_slot[r], s) for s, r in enumerate(after.live) if r in old_slot]
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs])
    dst = torch.tensor([p[1] for p in pairs])
    for i in range(after.num_layers):
        kb, vb = before.kv(i)
        ka, va = after.kv(i)
        assert torch.equal(kb[:, :, src], ka[:, :, dst]) and torch.equal(vb[:, :, src], va[:, :, dst])


def _check_tick(c, lm, actions):
    seq = list(zip(c.token_ids, c.positions))
    ref_seq, ref_next = reference(seq, c.next_position, actions)
    before = c.copy()
    snap = _ledger_snapshot(c)
    report = c.apply(actions, lm.model, writer="surgeon", step=7)
    # cache length == live-map length on every layer
    assert c.layer_lengths() == [len(c.live)] * c.num_layers or (not c.num_layers and not c.live)
    c.check()
    # the live map's tokens and positions == the pure-Python model
    assert list(zip(c.token_ids, c.positions)) == ref_seq
    assert c.next_position == ref_next
    # ledger rows never rewritten or reordered: the old ledger is a prefix of the new one
    now = _ledger_snapshot(c)
    assert all(new[:len(old)] == old for new, old in zip(now, snap))
    assert len(c.ledger) == len(snap[0]) + report.inserted + report.added
    assert len(set(c.live)) == len(c.live)
    _kept_kv_equal(before, c)
    assert report.length == len(c) == len(ref_seq)


def _property(bases, lm1, data):
    n = data.draw(st.integers(0, MAX_LEN), label="length")
    c = bases[n].copy()
    for _ in range(2):   # two ticks: the second one sees gaps in positions and surgery-written rows
        actions = data.draw(action_lists(len(c)), label="actions")
        _check_tick(c, lm1, actions)


_FAST = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=False)


@settings(max_examples=1000, **_FAST)
@given(data=st.data())
def test_random_ticks_match_reference(bases, lm1, data):
    _property(bases, lm1, data)


@pytest.mark.long
@settings(max_examples=10_000, **_FAST)
@given(data=st.data())
def test_random_ticks_match_reference_long(bases, lm1, data):
    _property(bases, lm1, data)


@settings(max_examples=150, **_FAST)
@given(data=st.data())
def test_gather_equals_per_row(bases, lm1, data):
    """The one-concat-per-layer splice and the seed's per-row torch.cat sequence give identical caches."""
    n = data.draw(st.integers(0, MAX_LEN))
    a, b = bases[n].copy(), bases[n].copy()
    actions = data.draw(action_lists(n))
    ra = a.apply(actions, lm1.model, writer="s")
    rb = b.apply(actions, lm1.model, writer="s", splice="per_row")
    assert a.live == b.live and _ledger_snapshot(a) == _ledger_snapshot(b)
    for i in range(a.num_layers):
        assert all(torch.equal(x, y) for x, y in zip(a.kv(i), b.kv(i)))
    assert ra.splice_bytes <= rb.splice_bytes


# ---------------------------------------------------------------------------- RoPE / K/V correctness


def _kv_close(a, b, slots_a, slots_b, atol=1e-5):
    for i in range(a.num_layers):
        for x, y in zip(a.kv(i), b.kv(i)):
            torch.testing.assert_close(x[:, :, slots_a], y[:, :, slots_b], atol=atol, rtol=1e-5)


def test_insert_at_end_equals_decoding(lm2):
    ids = [5, 9, 13, 21, 34, 8]
    a, _ = KVCache.prefill(lm2.model, ids, writer="t")
    a.delete(2, lm2.model, writer="t")                       # a gap in positions: 0 1 _ 3 4 5
    b = a.copy()
    a.insert(len(a), [40, 41], lm2.model, writer="t")
    logits = b.forward(lm2.model, [40, 41], writer="t")      # what decoding those tokens writes
    assert a.positions == b.positions == [0, 1, 3, 4, 5, 6, 7]
    assert a.next_position == b.next_position == 8
    _kv_close(a, b, slice(None), slice(None))
    r = a.copy().apply([{"action": "add", "token_id": 50}], lm2.model, writer="t")
    torch.testing.assert_close(r.logits, b.copy().forward(lm2.model, [50], writer="t"))
    assert logits.shape == (VOCAB,)


def test_insert_uses_left_context_and_final_positions(lm2):
    """On a contiguous cache, an interior insert's K/V equal a prefill of (left context + new tokens)."""
    ids = [5, 9, 13, 21, 34, 8, 17]
    c, _ = KVCache.prefill(lm2.model, ids, writer="t")
    c.insert(3, [44, 45], lm2.model, writer="t")
    ref, _ = KVCache.prefill(lm2.model, ids[:3] + [44, 45], writer="t")
    assert c.token_ids == ids[:3] + [44, 45] + ids[3:]
    assert c.positions == [0, 1, 2, 3, 4, 3, 4, 5, 6]          # no-shift: the right side keeps its positions
    _kv_close(c, ref, slice(0, 5), slice(0, 5))
    assert c.next_position == 7


def test_replace_pair_block(lm2):
    ids = [5, 9, 13, 21, 34, 8, 17, 3]
    c, _ = KVCache.prefill(lm2.model, ids, writer="t")
    c.apply([{"action": "replace_pair", "original_pos1": 2, "original_pos2": 4, "new_token_ids": [60]}],
            lm2.model, writer="t")
    ref, _ = KVCache.prefill(lm2.model, ids[:2] + [60], writer="t")
    assert c.token_ids == [5, 9, 60, 21, 8, 17, 3] and c.positions == [0, 1, 2, 3, 5, 6, 7]
    _kv_close(c, ref, slice(2, 3), slice(2, 3))
    assert c.ledger_status()[:8] == ["live", "live", "replaced", "live", "replaced", "live", "live", "live"]
    frame = c.ledger_frame()
    assert frame.loc[8, "origin"] == "replacement" and frame.loc[8, "status"] == "live"


def test_insert_into_empty_cache_is_prefill(lm2):
    c = KVCache()
    c.insert(0, [5, 6, 7], lm2.model, writer="t")
    ref, _ = KVCache.prefill(lm2.model, [5, 6, 7], writer="t")
    assert c.positions == [0, 1, 2] and c.next_position == 3
    _kv_close(c, ref, slice(None), slice(None))


def test_delete_everything(lm2):
    c, _ = KVCache.prefill(lm2.model, [5, 6, 7], writer="t")
    c.apply([{"action": "delete", "pos": s} for s in range(3)], lm2.model, writer="t")
    assert len(c) == 0 and c.layer_lengths() == [0, 0] and c.next_position == 3
    c.append(9, lm2.model, writer="t")
    assert c.positions == [3]


def test_one_concat_per_layer_bytes(lm2):
    """The gathered splice writes each layer once; the per-row version writes it once per row op."""
    c, _ = KVCache.prefill(lm2.model, list(range(3, 23)), writer="t")
    acts = [{"action": "replace_pair", "original_pos1": p, "original_pos2": p + 1, "new_token_ids": [7]}
            for p in (2, 6, 10, 14)]
    a = c.copy().apply(acts, lm2.model, writer="t")
    b = c.copy().apply(acts, lm2.model, writer="t", splice="per_row")
    row_bytes = c.nbytes() // len(c)
    assert a.splice_bytes == (20 - 4) * row_bytes
    assert b.splice_bytes == sum(n * row_bytes for n in (19, 18, 19, 18, 17, 18, 17, 16, 17, 16, 15, 16))


# ---------------------------------------------------------------------------- failure: rebuild from the map


STAGES = ["compute:0", "compute:1", "splice:0", "splice:1", "map", "add"]


@pytest.mark.parametrize("stage", STAGES)
def test_fault_mid_tick_rebuilds_from_map(lm2, stage):
    ids = [5, 9, 13, 21, 34, 8, 17, 3, 11]
    c, _ = KVCache.prefill(lm2.model, ids, writer="t")
    c.delete(4, lm2.model, writer="t")             # positions now have a gap: a rebuild must keep it
    tokens, positions, nxt = c.token_ids, c.positions, c.next_position
    snap = _ledger_snapshot(c)
    seen = []

    def hook(s):
        seen.append(s)
        if s == stage:
            raise RuntimeError("injected")

    acts = [{"action": "replace_pair", "original_pos1": 1, "original_pos2": 2, "new_token_ids": [60, 61]},
            {"action": "insert", "pos": 6, "token_ids": [62]}, {"action": "add", "token_id": 63}]
    with pytest.raises(SurgeryError, match="rebuilt from the live map"):
        c.apply(acts, lm2.model, writer="t", fault_hook=hook)
    assert seen[-1] == stage
    c.check()
    assert c.layer_lengths() == [len(c)] * 2
    assert c.token_ids == tokens and c.positions == positions and c.next_position == nxt
    assert all(new[:len(old)] == old for new, old in zip(_ledger_snapshot(c), snap))
    ref = KVCache()
    ref.forward(lm2.model, tokens, writer="t", positions=positions)    # a fresh prefill of the map's tokens
    _kv_close(c, ref, slice(None), slice(None), atol=1e-6)
    assert set(c.ledger_frame().set_index("row").loc[c.live, "origin"]) == {"rebuilt"}
    c.apply(acts, lm2.model, writer="t")           # and surgery works again afterwards
    c.check()


def test_rebuild_equals_prefill_contiguous(lm2):
    ids = [5, 9, 13, 21, 34]
    c, _ = KVCache.prefill(lm2.model, ids, writer="t")

    def boom(stage):
        if stage == "splice:1":
            raise MemoryError("simulated OOM after layer 0 was spliced")

    with pytest.raises(SurgeryError):
        c.apply([{"action": "delete", "pos": 1}], lm2.model, writer="t", fault_hook=boom)
    ref, _ = KVCache.prefill(lm2.model, ids, writer="t")
    assert c.token_ids == ids and c.positions == ref.positions
    _kv_close(c, ref, slice(None), slice(None), atol=1e-6)


# ---------------------------------------------------------------------------- validation


BAD = [
    ([{"action": "delete", "pos": 6}], r"outside the cache slots \[0, 6\)"),
    ([{"action": "delete", "pos": -1}], r"outside the cache slots"),
    ([{"action": "delete", "pos": True}], r"must be an int"),
    ([{"action": "delete", "pos": 1.0}], r"must be an int"),
    ([{"action": "insert", "pos": 7, "token_ids": [3]}], r"must be in \[0, 6\]"),
    ([{"action": "insert", "pos": 2, "token_ids": []}], r"is empty"),
    ([{"action": "insert", "pos": 2, "token_ids": [VOCAB]}], r"outside the vocabulary"),
    ([{"action": "insert", "pos": 2, "token_ids": 5}], r"must be a list of token ids"),
    ([{"action": "add", "token_id": -1}], r"outside the vocabulary"),
    ([{"action": "replace_pair", "original_pos1": 3, "original_pos2": 3, "new_token_ids": [1]}],
     r"original_pos1 < original_pos2"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 2, "new_token_ids": [1]}],
     r"original_pos1 < original_pos2"),
    ([{"action": "replace_pair", "original_pos1": 4, "original_pos2": 6, "new_token_ids": [1]}],
     r"original_pos1 < original_pos2 < 6"),
    ([{"action": "replace_pair", "original_pos1": 1, "original_pos2": 3, "new_token_ids": [1]},
      {"action": "replace_pair", "original_pos1": 3, "original_pos2": 4, "new_token_ids": [1]}], r"overlap at slot 3"),
    ([{"action": "replace_pair", "original_pos1": 1, "original_pos2": 4, "new_token_ids": [1]},
      {"action": "replace_pair", "original_pos1": 2, "original_pos2": 5, "new_token_ids": [1]}], r"overlap at slot 2"),
    ([{"action": "replace_pair", "original_pos1": 1, "original_pos2": 4, "new_token_ids": [1]},
      {"action": "delete", "pos": 2}], r"overlap at slot 2"),
    ([{"action": "replace_pair", "original_pos1": 1, "original_pos2": 4, "new_token_ids": [1]},
      {"action": "insert", "pos": 3, "token_ids": [1]}], r"inside actions\[0\]'s pair"),
    ([{"action": "delete", "pos": 2}, {"action": "delete", "pos": 2}], r"overlap at slot 2"),
    ([{"action": "insert", "pos": 2, "token_ids": [1]}, {"action": "insert", "pos": 2, "token_ids": [2]}],
     r"merge them into one insert"),
    ([{"action": "swap", "pos": 1}], r"must be one of"),
    ([{"action": "delete"}], r"missing \['pos'\]"),
    ([{"action": "delete", "pos": 1, "score": 0.5}], r"unknown \['score'\]"),
    ([{"action": "replace_pair", "orginal_pos1": 1, "original_pos2": 2, "new_token_ids": [1]}], r"missing"),
    (["delete 3"], r"must be a dict"),
    ({"action": "delete", "pos": 1}, r"actions must be a list"),
    # a valid action before an invalid one must not be applied either
    ([{"action": "add", "token_id": 5}, {"action": "delete", "pos": 1}, {"action": "delete", "pos": 9}],
     r"outside the cache slots"),
]


@pytest.mark.parametrize("actions,match", BAD, ids=[str(i) for i in range(len(BAD))])
def test_invalid_lists_rejected_without_change(lm2, actions, match):
    c, _ = KVCache.prefill(lm2.model, [5, 9, 13, 21, 34, 8], writer="t")
    before = c.copy()
    with pytest.raises(ValueError, match=match):
        c.apply(actions, lm2.model, writer="t")
    assert c.live == before.live and c.next_position == before.next_position and c.ticks == before.ticks
    assert _ledger_snapshot(c) == _ledger_snapshot(before) and len(c.events) == len(before.events)
    for i in range(c.num_layers):
        assert all(torch.equal(x, y) for x, y in zip(c.kv(i), before.kv(i)))


def test_bad_arguments(lm2):
    c, _ = KVCache.prefill(lm2.model, [5, 9, 13], writer="t")
    with pytest.raises(ValueError, match="splice="):
        c.apply([], lm2.model, writer="t", splice="fast")
    with pytest.raises(ValueError, match="writer="):
        c.apply([], lm2.model, writer="")
    c.live.append(0)                                  # corrupt the map by hand: the tick refuses to start
    with pytest.raises(ValueError, match="disagree before the tick"):
        c.apply([{"action": "delete", "pos": 0}], lm2.model, writer="t")


def test_plan_layout_is_pure():
    plan = plan_actions([{"action": "delete", "pos": 1}, {"action": "insert", "pos": 1, "token_ids": [9]},
                         {"action": "replace_pair", "original_pos1": 3, "original_pos2": 5, "new_token_ids": [7, 8]},
                         {"action": "insert", "pos": 3, "token_ids": [6]}, {"action": "add", "token_id": 4}], 6, 10)
    assert plan.apply_to_list(list("abcdef"), [["X"], ["I"], ["R1", "R2"]]) == ["a", "X", "c", "I", "R1", "R2", "e"]
    assert plan.steps[:3] == (("delete", 5, -1), ("delete", 3, -1), ("insert", 3, 2))
    assert plan.new_length == 8


# ---------------------------------------------------------------------------- decoding continues


def test_continue_from_matches_uninterrupted_decoding(lm2):
    full = Decoding(lm2, None, "hello there", mode="teacher", max_new_tokens=8, chat=False)
    full_recs = list(full)
    want = [r.token_id for r in full_recs]
    part = Decoding(lm2, None, "hello there", mode="teacher", max_new_tokens=5, chat=False)
    recs = list(part)
    more = list(continue_from(part.cache, lm2, part.tokens[-1], max_new_tokens=3, first_step=6))
    assert [r.token_id for r in recs + more] == want
    assert [(r.step, r.position) for r in more] == [(r.step, r.position) for r in full_recs[5:]]
    assert part.cache.positions == full.cache.positions


def test_continue_after_surgery_uses_mirror_positions(lm2):
    d = Decoding(lm2, None, "hello there", mode="teacher", max_new_tokens=4, chat=False)
    list(d)
    c, last = d.cache, d.tokens[-1]
    c.apply([{"action": "delete", "pos": 2}, {"action": "delete", "pos": 3}], lm2.model, writer="teacher")
    n_before, next_pos = len(c), c.next_position
    assert next_pos == n_before + 2                    # positions, not length, say where we are
    a = c.copy()
    recs = list(continue_from(c, lm2, last, max_new_tokens=3, sampling=Sampling(temperature=0.8, seed=1)))
    assert c.positions[n_before:] == [next_pos, next_pos + 1, next_pos + 2]
    assert [r.position for r in recs] == [next_pos + 1, next_pos + 2, next_pos + 3]
    # the same continuation through a tick whose 'add' writes the pending token, then logits=
    r = a.apply([{"action": "add", "token_id": last}], lm2.model, writer="teacher")
    recs2 = list(continue_from(a, lm2, logits=r.logits, max_new_tokens=3, sampling=Sampling(temperature=0.8, seed=1)))
    assert [x.token_id for x in recs2] == [x.token_id for x in recs]
    assert a.token_ids == c.token_ids and a.positions == c.positions


def test_continue_from_validates(lm2):
    c, logits = KVCache.prefill(lm2.model, [5, 6], writer="t")
    with pytest.raises(ValueError, match="exactly one"):
        continue_from(c, lm2)
    with pytest.raises(ValueError, match="exactly one"):
        continue_from(c, lm2, 3, logits=logits)
    with pytest.raises(ValueError, match="last_token"):
        continue_from(c, lm2, VOCAB)
    with pytest.raises(ValueError, match="max_new_tokens"):
        continue_from(c, lm2, 3, max_new_tokens=0)


# ---------------------------------------------------------------------------- real model


@pytest.mark.integration
def test_real_model_surgery(real_pair):
    teacher, _ = real_pair
    m = teacher.model
    ids = teacher.encode_prompt("Name three colours.")
    c, _ = KVCache.prefill(m, ids, writer="teacher")
    b = c.copy()
    c.insert(len(c), [42, 43], m, writer="teacher")
    b.forward(m, [42, 43], writer="teacher")
    _kv_close(c, b, slice(None), slice(None), atol=1e-4)
    n = len(c)
    acts = [{"action": "replace_pair", "original_pos1": 3, "original_pos2": 4, "new_token_ids": [100]},
            {"action": "delete", "pos": n - 3}, {"action": "add", "token_id": 7}]
    with pytest.raises(SurgeryError):
        c.apply(acts, m, writer="teacher", fault_hook=lambda s: (_ for _ in ()).throw(RuntimeError("x"))
                if s == "splice:15" else None)
    ref = KVCache()
    ref.forward(m, c.token_ids, writer="teacher", positions=c.positions)
    _kv_close(c, ref, slice(None), slice(None), atol=1e-4)
    r = c.apply(acts, m, writer="teacher")
    assert len(c) == n - 3 + 1 + 1 and r.splice_bytes > 0
    recs = list(continue_from(c, teacher, logits=r.logits, max_new_tokens=3))
    assert [x.position for x in recs] == [c.next_position - 2, c.next_position - 1, c.next_position]


# ---------------------------------------------------------------------------- figure, bench, CLI


def test_live_map_figure(lm2):
    from kvlab.viz.livemap import live_map_figure

    c, _ = KVCache.prefill(lm2.model, [5, 9, 13, 21], writer="t")
    before = list(c.live)
    c.apply([{"action": "delete", "pos": 1}, {"action": "insert", "pos": 3, "token_ids": [7]},
             {"action": "add", "token_id": 8}], lm2.model, writer="t")
    fig = live_map_figure(c.ledger_frame(), {"before": before, "after": c.live}, labels=str)
    assert len(fig.axes) == 3
    assert [len(col.get_offsets()) for col in fig.axes[1].collections][0] == len(c)


def test_bench_surgery_tiny(lm2):
    from kvlab.studies.bench.bench import bench_surgery

    out = bench_surgery(lm2, cache_len=64, pairs=4, repeats=1)
    assert out["identical"] is True
    assert out["gather"]["splice_mb"] < out["per_row"]["splice_mb"]
    with pytest.raises(ValueError, match="pairs="):
        bench_surgery(lm2, cache_len=6, pairs=4)


def test_cli_lists_surgery_bench():
    from kvlab.cli import build_parser
    from kvlab.studies.bench.cli import BENCHES

    assert "surgery" in BENCHES
    args = build_parser().parse_args(["bench", "surgery", "--cache-len", "128", "--pairs", "3"])
    assert (args.what, args.cache_len, args.pairs) == ("surgery", 128, 3)


def test_model_must_match_cache(lm2, lm1):
    c, _ = KVCache.prefill(lm2.model, [5, 9, 13], writer="t")
    with pytest.raises(ValueError, match="model has 1 layers, the cache 2"):
        c.apply([{"action": "delete", "pos": 0}], lm1.model, writer="t")
    assert len(c) == 3


def test_interrupt_mid_tick_still_rebuilds(lm2):
    c, _ = KVCache.prefill(lm2.model, [5, 9, 13, 21], writer="t")

    def hook(stage):
        if stage == "splice:1":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        c.apply([{"action": "delete", "pos": 0}], lm2.model, writer="t", fault_hook=hook)
    c.check()
    assert c.token_ids == [5, 9, 13, 21]
