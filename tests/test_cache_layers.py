"""Per-layer live sets: every layer keeps its own entries, and a ragged cache
computes what an uncached forward computes when each layer sees only its kept tokens."""
from __future__ import annotations

import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from conftest import make_tiny_lm
from kvlab.cache import KVCache, attn_fn
from kvlab.cache.attn_fn import causal_mask
from kvlab.eviction.base import EvictView, Keep, layer_stat

PROMPT = [5 + (11 * i) % 100 for i in range(16)]
# per layer: prompt slots to evict (different counts, so the layers differ in length)
DROPS = [[1, 2, 6, 9], [0, 3], [4, 5, 7, 8, 10, 11]]
REF = "kvlab_test_reference"


@pytest.fixture(scope="module")
def lm3():
    return make_tiny_lm(seed=7, layers=3)


def _reference(model, tokens: list[int], visible: list[torch.Tensor]) -> torch.Tensor:
    """Uncached forward over ``tokens`` (positions 0..N-1) where layer ``l``'s query ``i`` sees key
    ``j`` iff ``visible[l][i, j]``: a hand-written eager attention (scores, -inf, softmax) run through
    transformers' AttentionInterface. Returns logits (N, V)."""
    def attention(module, query, key, value, attention_mask, scaling, **kwargs):
        g = query.shape[1] // key.shape[1]
        k = key.repeat_interleave(g, dim=1)                                       # (1, H, N, D)
        v = value.repeat_interleave(g, dim=1)
        scores = (query @ k.transpose(-1, -2)) * scaling                          # (1, H, N, N)
        scores = scores.masked_fill(~visible[module.layer_idx], float("-inf"))
        out = torch.softmax(scores.float(), dim=-1).to(query.dtype) @ v           # (1, H, N, D)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(REF, attention)
    before = model.config._attn_implementation
    model.set_attn_implementation(REF)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([tokens])).logits[0]
    finally:
        model.set_attn_implementation(before)


def _visible(n_prompt: int, n_new: int, drops: list[list[int]]) -> list[torch.Tensor]:
    """Causal over prompt + new tokens; the new tokens' queries do not see a layer's evicted prompt slots."""
    n = n_prompt + n_new
    out = []
    for d in drops:
        vis = torch.ones(n, n, dtype=torch.bool).tril()
        vis[n_prompt:, d] = False
        out.append(vis)
    return out


def _ragged(model) -> KVCache:
    c, _ = KVCache.prefill(model, PROMPT, writer="teacher")
    c.evict([], layers=DROPS)
    return c


def test_ragged_one_token_step_matches_uncached_reference(lm3):
    c = _ragged(lm3.model)
    assert c.layer_lengths() == [16 - len(d) for d in DROPS] and not c.uniform
    got = c.forward(lm3.model, [42], writer="teacher")
    want = _reference(lm3.model, PROMPT + [42], _visible(16, 1, DROPS))[-1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert lm3.model.config._attn_implementation == attn_fn.NAME


def test_ragged_multi_token_forward_is_causal_bottom_right(lm3):
    c = _ragged(lm3.model)
    got = c.forward(lm3.model, [42, 43, 44], writer="teacher", logits="all")    # (3, V)
    want = _reference(lm3.model, PROMPT + [42, 43, 44], _visible(16, 3, DROPS))[-3:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and decoding goes on over the ragged cache
    nxt = c.forward(lm3.model, [45], writer="teacher")
    want = _reference(lm3.model, PROMPT + [42, 43, 44, 45], _visible(16, 4, DROPS))[-1]
    torch.testing.assert_close(nxt, want, rtol=1e-5, atol=1e-5)
    assert c.layer_lengths() == [16 - len(d) + 4 for d in DROPS]


def test_uniform_lengths_different_entries_match_reference(lm3):
    """Same length on every layer, different entries: transformers' own mask is right, the rows differ."""
    drops = [[1, 2], [5, 9], [0, 15]]
    c, _ = KVCache.prefill(lm3.model, PROMPT, writer="teacher")
    c.evict([], layers=drops)
    assert len(set(c.layer_lengths())) == 1 and not c.uniform
    got = c.forward(lm3.model, [42, 43], writer="teacher", logits="all")
    want = _reference(lm3.model, PROMPT + [42, 43], _visible(16, 2, drops))[-2:]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kvlab_attention_equals_sdpa_on_uniform_caches():
    lm = make_tiny_lm(seed=8, layers=2)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = lm.model(input_ids=ids).logits
        attn_fn.use(lm.model)
        got = lm.model(input_ids=ids).logits
    assert torch.equal(got, want)
    mask = causal_mask(2, 5, "cpu")[0, 0]
    assert mask.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_per_layer_mirror_stats_and_events(lm3):
    c, _ = KVCache.prefill(lm3.model, PROMPT, writer="teacher")
    c.track_attention(0.5, below=True)
    c.forward(lm3.model, [42], writer="teacher", attention=True)
    before = {k: [t.clone() for t in ts] for k, ts in c.layer_attn().items()}
    c.evict([], layers=DROPS)
    for i, d in enumerate(DROPS):
        keep = [s for s in range(17) if s not in d]
        assert c.layer_positions()[i] == tuple(keep)                 # slot s held position s before
        for name in ("acc", "ema", "count", "low"):
            assert torch.equal(c.layer_attn()[name][i], before[name][i][keep])
    ev = c.events.to_frame()
    assert sorted(ev[ev.layer == 1].row.tolist()) == [c.ledger.position.index(p) for p in DROPS[1]]
    assert c.ledger_status()[1] == "live"                            # evicted on layers 0, still live on 1 and 2
    assert c.ledger_status()[4] == "live" and c.ledger_status().count("live") == 17
    with pytest.raises(ValueError, match="per-layer"):
        _ = c.attn                                                   # matrices only for one live set
    # a forward with attention keeps every layer's stats aligned with its own live set
    c.forward(lm3.model, [43], writer="teacher", attention=True)
    assert [t.shape[0] for t in c.layer_attn()["acc"]] == c.layer_lengths()
    assert all(float(t[-1]) > 0 for t in c.layer_attn()["acc"])
    # Scissorhands' low counts: the one measured query adds 1 where it gave less than 1/T_l of its
    # head-mean attention, T_l = that layer's own length
    for i, t in enumerate(c.layer_attn()["low"]):
        assert t.shape[0] == c.layer_lengths()[i]
        grew = t[:-1] - before["low"][i][[s for s in range(17) if s not in DROPS[i]]]
        assert set(grew.tolist()) <= {0.0, 1.0} and 0 < float(grew.sum()) < c.layer_lengths()[i]


def test_check_catches_a_layer_out_of_step(lm3):
    c = _ragged(lm3.model)
    c.check()
    c._mirror.lives[2].append(0)
    with pytest.raises(AssertionError, match="layer 2"):
        c.check()


def test_refresh_splice_and_append_work_per_layer(lm3):
    """A teacher-like source with every entry: a ragged cache takes, per layer, only what it holds."""
    src, _ = KVCache.prefill(lm3.model, PROMPT + [42], writer="teacher")
    c, _ = KVCache.prefill(make_tiny_lm(seed=9, layers=3).model, PROMPT, writer="student")
    c.evict([], layers=DROPS)
    c.splice_positions(src, list(range(16)))
    for i, d in enumerate(DROPS):
        keep = [s for s in range(16) if s not in d]
        k, v = c.kv(i)
        sk, sv = src.kv(i)
        assert torch.equal(k, sk[:, :, keep]) and torch.equal(v, sv[:, :, keep])
        assert {c.ledger.writer[r] for r in c.lives[i]} == {"teacher"}
    assert c.held([0, 1, 4, 99]) == [0, 1, 4]                     # 1 is gone from layer 0 only
    c.append_from(src, 1)
    assert c.layer_lengths() == [16 - len(d) + 1 for d in DROPS]
    assert all(live[-1] == c.live[-1] for live in c.lives)        # one new row, shared by the layers
    with pytest.raises(ValueError, match="no entry at position 99"):
        c.splice_positions(src, [99])


def test_probe_last_on_ragged_cache_reproduces_the_step(lm3):
    c = _ragged(lm3.model)
    step = c.forward(lm3.model, [42], writer="teacher")
    probe = c.probe_last(lm3.model, 3)
    torch.testing.assert_close(probe, step.expand(3, -1), rtol=1e-5, atol=1e-5)


def test_shared_slot_edits_refuse_ragged_caches(lm3):
    c = _ragged(lm3.model)
    with pytest.raises(ValueError, match="per-layer"):
        c.apply([{"action": "delete", "pos": 0}], lm3.model, writer="teacher")
    with pytest.raises(ValueError, match="per layer"):
        c.crop(3)
    with pytest.raises(ValueError, match="same number of entries"):
        c.evict([0], model=lm3.model, rerotate=True)
    c.check()


def test_int8_per_layer_lengths(lm3):
    c = _ragged(lm3.model)
    c.forward(lm3.model, list(range(40, 60)), writer="teacher")
    c.quantize_older(window=4, group=8)
    assert [c._store.int8_len(i) for i in range(3)] == [n - 4 for n in c.layer_lengths()]
    got = c.forward(lm3.model, [61], writer="teacher")
    d = c.copy()
    d.dequantize()
    assert d.layer_lengths() == c.layer_lengths() and d.n_int8 == 0
    torch.testing.assert_close(c.copy().forward(lm3.model, [62], writer="teacher"),
                               d.forward(lm3.model, [62], writer="teacher"), rtol=0, atol=0)
    # the forward materializes each layer's own INT8 prefix in full precision
    per_entry = d.nbytes() // sum(d.layer_lengths())             # FP K/V bytes of one entry of one layer
    assert c.forward_nbytes() == c.nbytes() + sum(c._store.int8_len(i) for i in range(3)) * per_entry


def test_keep_layers_drives_the_cache_generically(lm3):
    """The policy interface: Keep.layers -> per-layer drops -> KVCache.evict(layers=...)."""
    c, _ = KVCache.prefill(lm3.model, PROMPT, writer="teacher")
    c.track_attention(0.9)
    c.forward(lm3.model, [42], writer="teacher", attention=True)
    view = EvictView(step=1, length=len(c), positions=tuple(c.positions), record=None, vocab_size=128,
                     num_layers=3, attn=c.layer_attn(), layer_positions=c.layer_positions())
    assert layer_stat(view, "acc").shape == (3, 17)
    keep = Keep(slots=tuple(range(17)), layers=(tuple(range(10)), tuple(range(17)), tuple(range(5, 17))))
    per_layer = keep.dropped_layers(c.layer_lengths())
    c.evict(keep.dropped(len(c)), layers=per_layer)
    assert c.layer_lengths() == [10, 17, 12]
    view = EvictView(step=1, length=len(c), positions=tuple(c.positions), record=None, vocab_size=128,
                     num_layers=3, attn=c.layer_attn(), layer_positions=c.layer_positions())
    with pytest.raises(ValueError, match="per-layer"):
        layer_stat(view, "acc")


def test_per_layer_rerotation_moves_each_layer_like_a_uniform_one(lm3):
    """Per-layer drops of equal counts (slot 0 kept everywhere) with re-rotation: every layer's
    survivors go to positions 0..n'-1, each layer's keys exactly as a uniform re-rotation with that
    layer's drops gives them; a row moved alike on two layers is one new ledger row."""
    drops = [[2, 3, 9], [4, 5, 6], [2, 3, 9]]
    c, _ = KVCache.prefill(lm3.model, PROMPT, writer="teacher")
    ref = [c.copy() for _ in drops]
    rep = c.evict([], model=lm3.model, rerotate=True, layers=drops)
    assert rep.moved == 16 - 2 - 3 and c.layer_lengths() == [13] * 3 and c.next_position == 13
    assert all(p == tuple(range(13)) for p in c.layer_positions())
    for i, d in enumerate(drops):
        ref[i].evict(d, model=lm3.model, rerotate=True)
        k, v = c.kv(i)
        rk, rv = ref[i].kv(i)
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert c.lives[0] == c.lives[2] != c.lives[1]
    moved_to = c.events.to_frame().query("event == 'moved_to'")
    assert len(moved_to) == len(set(c.lives[0][2:]) | set(c.lives[1][4:]))    # shared rows counted once
    c.check()
    nxt = c.forward(lm3.model, [42], writer="teacher")
    assert torch.isfinite(nxt).all() and c.layer_positions()[0][-1] == 13
    with pytest.raises(ValueError, match="same first position"):
        c.evict([], model=lm3.model, rerotate=True, layers=[[0], [1], [1]])


@pytest.mark.parametrize("removed", [[4], [0], [9], [2, 3, 7], [1, 8], list(range(3, 10))])
def test_buffer_keep_moves_the_smaller_side_and_keeps_order(removed):
    """BufferLayer.keep: same content as an index_select of the kept slots, whichever side moves;
    removing the oldest non-sink entry moves the sinks up instead of the whole tail down."""
    from kvlab.cache.storage import BufferLayer, keep_plan

    n = 10
    k = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).repeat(1, 2, 1, 3)      # (1, H_kv, T, D)
    lay = BufferLayer.of(k, -k)
    idx = torch.tensor([j for j in range(n) if j not in removed])
    down, up = keep_plan(idx, n)
    assert (down, up) == (len([j for j in idx.tolist() if j > min(removed)]),
                          len([j for j in idx.tolist() if j < max(removed)]))
    lay.keep(idx)
    torch.testing.assert_close(lay.keys, k.index_select(2, idx))
    torch.testing.assert_close(lay.values, -k.index_select(2, idx))
    assert lay.get_seq_length() == len(idx) and lay.s == (n - len(idx) if up < down else 0)
    if removed == [4]:
        assert (down, up) == (5, 4)


def test_buffer_appends_after_front_evictions_reuse_the_buffer():
    """A sliding window: evict the oldest entry, append one, many times: the used part walks up the
    buffer and moves back to column 0 when it reaches the end; content stays right, capacity fixed."""
    from kvlab.cache.storage import BufferLayer

    lay = BufferLayer.of(torch.zeros(1, 2, 0, 3), torch.zeros(1, 2, 0, 3))
    want = []
    for t in range(300):
        x = torch.full((1, 2, 1, 3), float(t))
        lay.update(x, -x)
        want.append(t)
        if len(want) > 40:
            idx = torch.tensor([0] + list(range(2, len(want))))      # 1 sink, drop the oldest after it
            lay.keep(idx)
            want = [want[0]] + want[2:]
        assert lay.keys[0, 0, :, 0].tolist() == [float(w) for w in want]
        assert lay.values[0, 1, :, 2].tolist() == [-float(w) for w in want]
    assert lay.capacity == 64
