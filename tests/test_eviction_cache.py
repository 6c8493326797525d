"""Eviction as a cache operation: evict, RoPE re-rotation, INT8 storage, attention mass."""
from __future__ import annotations

import pytest
import torch

from kvlab.core.compat import cache_kwarg
from transformers.cache_utils import DynamicCache

from conftest import make_tiny_lm
from kvlab.cache import KVCache, SurgeryError
from kvlab.cache.int8 import Int8Layer, quantize

IDS = [5 + (7 * i) % 100 for i in range(24)]


@pytest.fixture(scope="module")
def lm1():
    """One layer: its K/V depend only on token and position, so a cache rebuilt from surviving
    tokens at their positions must equal the evicted cache exactly."""
    return make_tiny_lm(seed=3, layers=1)


@pytest.fixture(scope="module")
def lm2():
    return make_tiny_lm(seed=4, layers=2)


def _set_impl(model, impl):
    model.config._attn_implementation = impl
    for m in model.modules():
        if hasattr(m, "config"):
            m.config._attn_implementation = impl


def test_ragged_layers_break_transformers_masks():
    """Why a ragged KVCache runs the "kvlab" attention function (kvlab.cache.attn_fn): with layers
    of different lengths transformers' own implementations fail — a multi-token forward under sdpa,
    even a one-token forward under eager — because transformers 5.x sizes one mask by layer 0 for
    all layers. (tests/test_cache_layers.py checks the kvlab function against a reference.)"""
    lm = make_tiny_lm(seed=5, layers=2)
    m = lm.model
    ids = torch.tensor([IDS[:12]])
    with torch.no_grad():
        full = m(input_ids=ids, use_cache=True).past_key_values
    keep = [list(range(12)), list(range(0, 12, 2))]

    def ragged():
        return DynamicCache(ddp_cache_data=[(lay.keys[:, :, k], lay.values[:, :, k]) for lay, k in zip(full.layers, keep)])

    with torch.no_grad():
        _set_impl(m, "sdpa")
        m(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[12]]), **{cache_kwarg(m): ragged()})  # works
        with pytest.raises(RuntimeError):
            m(input_ids=torch.tensor([[7, 8, 9]]), position_ids=torch.tensor([[12, 13, 14]]),
              **{cache_kwarg(m): ragged()})
        _set_impl(m, "eager")
        with pytest.raises(RuntimeError):
            m(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[12]]), **{cache_kwarg(m): ragged()})
        _set_impl(m, "sdpa")


def test_evict_keeps_positions_logits_equal_rebuilt_cache(lm1):
    c, _ = KVCache.prefill(lm1.model, IDS, writer="teacher")
    drop = [0, 3, 4, 10, 17]
    rep = c.evict(drop)
    assert rep.evicted == 5 and len(c) == len(IDS) - 5 and c.layer_lengths() == [len(c)]
    keep = [s for s in range(len(IDS)) if s not in drop]
    assert c.positions == keep and c.token_ids == [IDS[s] for s in keep]
    assert c.next_position == len(IDS)
    got = c.forward(lm1.model, [9], writer="teacher")
    ref = KVCache()
    ref.forward(lm1.model, [IDS[s] for s in keep], writer="teacher", positions=keep)
    want = ref.forward(lm1.model, [9], writer="teacher", positions=[len(IDS)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and the positions matter: the same survivors at consecutive positions give other logits
    shifted = KVCache()
    shifted.forward(lm1.model, [IDS[s] for s in keep], writer="teacher")
    other = shifted.forward(lm1.model, [9], writer="teacher", positions=[len(IDS)])
    assert (other - want).abs().max() > 1e-3


def test_evict_ledger_events_and_status(lm2):
    c, _ = KVCache.prefill(lm2.model, IDS[:10], writer="teacher")
    rows = list(c.live)
    c.evict([1, 2])
    st = c.ledger_status()
    assert st[rows[1]] == st[rows[2]] == "evicted" and st[rows[0]] == "live"
    assert c.events.event[-2:] == ["evicted", "evicted"]
    c.check()


@pytest.mark.parametrize("bad", [[10], [-1], [1, 1], ["a"], [True], [2.0], [3, True]])
def test_evict_validates_before_touching(lm2, bad):
    c, _ = KVCache.prefill(lm2.model, IDS[:10], writer="teacher")
    before = [t.clone() for t in c.kv(0)], list(c.live)
    with pytest.raises(ValueError):
        c.evict(bad)
    assert c.live == before[1] and torch.equal(c.kv(0)[0], before[0][0])


def test_evict_nothing_is_noop(lm2):
    c, _ = KVCache.prefill(lm2.model, IDS[:10], writer="teacher")
    assert c.evict([]).evicted == 0 and len(c) == 10 and not c.events.event


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_reposition_equals_keys_recomputed_at_new_positions(rope):
    m = make_tiny_lm(seed=6, layers=1, rope_theta=500.0).model
    if rope is not None:
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = m.config.to_dict()
        cfg["rope_parameters"] = {"rope_theta": 500.0, **rope}
        cfg.pop("rope_scaling", None)
        torch.manual_seed(6)
        m = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
        assert m.model.rotary_emb.rope_type == rope["rope_type"]
    c, _ = KVCache.prefill(m, IDS[:16], writer="teacher")
    new_pos = [3 * p + 40 for p in range(16)]                  # moves up and apart
    assert c.reposition(m, new_pos) == 16
    ref = KVCache()
    ref.forward(m, IDS[:16], writer="teacher", positions=new_pos)
    torch.testing.assert_close(c.kv(0)[0], ref.kv(0)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.kv(0)[1], ref.kv(0)[1])      # values untouched
    assert c.positions == new_pos and c.next_position == max(new_pos) + 1
    back = [p for p in range(16)]                               # and back down (negative deltas)
    c.reposition(m, back)
    orig, _ = KVCache.prefill(m, IDS[:16], writer="teacher")
    torch.testing.assert_close(c.kv(0)[0], orig.kv(0)[0], rtol=1e-5, atol=1e-5)
    assert set(c.ledger_status()) >= {"moved", "live"}


def test_reposition_refuses_length_dependent_rope():
    from transformers import LlamaConfig, LlamaForCausalLM

    lm = make_tiny_lm(seed=6, layers=1)
    cfg = lm.model.config.to_dict()
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "dynamic", "factor": 2.0}
    m = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    c, _ = KVCache.prefill(m, IDS[:8], writer="teacher")
    with pytest.raises(ValueError, match="rope_type"):
        c.reposition(m, list(range(1, 9)))
    assert c.positions == list(range(8))


def test_evict_rerotate_closes_gaps(lm1):
    c, _ = KVCache.prefill(lm1.model, IDS, writer="teacher")
    rep = c.evict([4, 5, 6, 7], model=lm1.model, rerotate=True)
    assert rep.moved == len(IDS) - 8 and c.positions == list(range(len(IDS) - 4))
    assert c.next_position == len(IDS) - 4
    keep = [t for s, t in enumerate(IDS) if s not in (4, 5, 6, 7)]
    ref, _ = KVCache.prefill(lm1.model, keep, writer="teacher")
    torch.testing.assert_close(c.kv(0)[0], ref.kv(0)[0], rtol=1e-5, atol=1e-5)
    ov, ov_ref = c.copy(), ref.copy()
    got = c.forward(lm1.model, [9], writer="teacher")
    want = ref.forward(lm1.model, [9], writer="teacher")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # kvlab's convention: the next query follows the last survivor (position 20, not 24) ...
    assert c.positions[-1] == len(IDS) - 4
    # ... OpenVINO's: same re-based cache, but the new token keeps its absolute position (24), a gap
    # of 4 behind the last key; reachable with explicit positions, and it is a different distribution
    got_ov = ov.forward(lm1.model, [9], writer="teacher", positions=[len(IDS)])
    want_ov = ov_ref.forward(lm1.model, [9], writer="teacher", positions=[len(IDS)])
    torch.testing.assert_close(got_ov, want_ov, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got_ov, got, atol=1e-4)


def test_surgery_rerotate_insert_gets_final_positions(lm1):
    m = lm1.model
    c, _ = KVCache.prefill(m, IDS[:12], writer="teacher")
    c.apply([{"action": "insert", "pos": 5, "token_ids": [50, 51, 52]}], m, writer="teacher", rerotate=True)
    assert c.positions == list(range(15))                       # no collision with the right neighbours
    assert c.token_ids == IDS[:5] + [50, 51, 52] + IDS[5:12]
    ref, _ = KVCache.prefill(m, c.token_ids, writer="teacher")  # one layer: K/V = f(token, position)
    torch.testing.assert_close(c.kv(0)[0], ref.kv(0)[0], rtol=1e-5, atol=1e-5)
    # default (no-shift) keeps the old collision semantics
    d, _ = KVCache.prefill(m, IDS[:12], writer="teacher")
    d.apply([{"action": "insert", "pos": 5, "token_ids": [50, 51, 52]}], m, writer="teacher")
    assert d.positions == [0, 1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11]


def test_surgery_rerotate_delete_closes_gap_and_failure_rebuilds(lm1):
    m = lm1.model
    c, _ = KVCache.prefill(m, IDS[:12], writer="teacher")
    c.apply([{"action": "delete", "pos": 3}, {"action": "add", "token_id": 9}], m, writer="teacher", rerotate=True)
    assert c.positions == list(range(12))
    e, _ = KVCache.prefill(m, IDS[:12], writer="teacher")

    def fail(stage):
        if stage == "rerotate":
            raise RuntimeError("boom")

    with pytest.raises(SurgeryError):
        e.apply([{"action": "delete", "pos": 3}], m, writer="teacher", rerotate=True, fault_hook=fail)
    assert e.positions == list(range(12)) and e.token_ids == IDS[:12]
    e.check()


# ----------------------------------------------------------------------------- INT8


def test_int8_roundtrip_error_bound():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 40, 8) * torch.linspace(0.1, 10, 8)                 # channels of very different scale
    q, s = quantize(x)
    err = (q.float() * s - x).abs()
    bound = x.abs().amax(dim=2, keepdim=True) / 254                           # per (head, channel)
    assert q.dtype == torch.int8 and s.shape == (1, 3, 1, 8)
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert float(err.mean() / x.abs().mean()) < 0.01


def test_int8_cache_bytes_logits_and_edits(lm2):
    m = lm2.model
    c, _ = KVCache.prefill(m, IDS, writer="teacher")
    ref = c.copy()
    fp_bytes = c.nbytes()
    assert c.quantize_older(window=8, group=32) == 0                          # 16 waiting < group
    assert c.quantize_older(window=8, group=8) == 16 and c.n_int8 == 16
    h, d = c.geometry()["kv_heads"], c.geometry()["head_dim"]
    want = 2 * (16 * 2 * h * d * 1 + 16 * 4 + 2 * h * d * 4) + 2 * (8 * 2 * h * d * 4)  # layers x (int8+gid+scales) + fp
    assert c.nbytes() == want < fp_bytes
    for i in range(2):
        k, v = c.kv(i)
        rk, rv = ref.kv(i)
        assert float((k[:, :, :16] - rk[:, :, :16]).abs().max()) <= float(rk[:, :, :16].abs().amax()) / 254 + 1e-6
        assert torch.equal(k[:, :, 16:], rk[:, :, 16:])
    got = c.forward(m, [9], writer="teacher")
    want_l = ref.forward(m, [9], writer="teacher")
    assert float((got - want_l).abs().max()) < 0.05
    assert c.n_int8 == 16 and len(c) == 25 and c.layer_lengths() == [25, 25]
    c.evict([0, 1, 20])                                                       # int8 and fp slots
    assert c.n_int8 == 14 and len(c) == 22
    c.splice_positions(ref, [5, 22])                                          # one INT8 slot, one FP slot
    c.check()
    c.crop(10)                                                                # below the INT8 region
    assert c.n_int8 == 0 and len(c) == 10
    c.check()


# ----------------------------------------------------------------------------- attention mass


def test_attention_mass_equals_eager_attention_weights(lm2):
    m = lm2.model
    c = KVCache()
    c.track_attention(0.5)
    c.forward(m, IDS[:10], writer="teacher", attention=True)
    c.forward(m, [9], writer="teacher", attention=True)
    _set_impl(m, "eager")
    try:
        with torch.no_grad():
            out = m(input_ids=torch.tensor([IDS[:10] + [9]]), output_attentions=True)
    finally:
        _set_impl(m, "sdpa")
    for layer, att in enumerate(out.attentions):                              # (1, H, 11, 11)
        a = att[0].mean(0)                                                    # (11, 11)
        acc = torch.zeros(11)
        acc[:10] += a[:10, :10].sum(0)                                        # prefill queries
        acc += a[10]                                                          # the decode step
        torch.testing.assert_close(c.attn["acc"][layer], acc, rtol=1e-4, atol=1e-5)
        ema = torch.zeros(11)
        for i in range(10):                                                   # one EMA update per prefill query
            ema[:10] = 0.5 * ema[:10] + 0.5 * a[i, :10]
        ema = 0.5 * ema + 0.5 * a[10]
        torch.testing.assert_close(c.attn["ema"][layer], ema, rtol=1e-4, atol=1e-5)
    # lifetimes in measured queries: the prefill registers 10 … 1, the decode step adds 1 (new entry: 1)
    assert c.attn["count"].tolist() == [float(10 - j + 1) for j in range(10)] + [1.0]


def test_snapkv_window_pooling_and_lifetimes(lm2):
    """track_attention(window=w, pool=p): the prefill's mass is that of its last w queries only,
    max-pooled over the entry and the p-1 after it; counts are min(L - j, w), each step adds 1."""
    from kvlab.cache.stats import lifetime_increment, max_pool_next

    assert lifetime_increment(5, 5, None).tolist() == [5, 4, 3, 2, 1]
    assert lifetime_increment(5, 5, 2).tolist() == [2, 2, 2, 2, 1]
    assert lifetime_increment(6, 1, 8).tolist() == [1] * 6
    x = torch.tensor([[1.0, 5.0, 2.0, 0.0, 3.0]])
    assert max_pool_next(x, 3).tolist() == [[5.0, 5.0, 3.0, 3.0, 3.0]]
    assert torch.equal(max_pool_next(x, 1), x)
    m = lm2.model
    c = KVCache()
    c.track_attention(0.5, window=3, pool=2)
    c.forward(m, IDS[:10], writer="teacher", attention=True)
    _set_impl(m, "eager")
    try:
        with torch.no_grad():
            out = m(input_ids=torch.tensor([IDS[:10]]), output_attentions=True)
    finally:
        _set_impl(m, "sdpa")
    for layer, att in enumerate(out.attentions):                              # (1, H, 10, 10)
        mass = att[0].mean(0)[7:].sum(0)                                      # the last 3 queries
        torch.testing.assert_close(c.attn["acc"][layer], max_pool_next(mass.view(1, -1), 2)[0],
                                   rtol=1e-4, atol=1e-5)
    assert c.attn["count"].tolist() == [3.0] * 8 + [2.0, 1.0]
    c.forward(m, [9], writer="teacher", attention=True)
    assert c.attn["count"].tolist() == [4.0] * 8 + [3.0, 2.0, 1.0]
    assert (c.copy().attn_window, c.copy().attn_pool) == (3, 2)
    # Scissorhands' counts: measured queries that gave an entry less than the uniform share 1/T_i
    b = KVCache()
    b.track_attention(0.5, below=True)
    b.forward(m, IDS[:10], writer="teacher", attention=True)
    b.forward(m, [9], writer="teacher", attention=True)
    _set_impl(m, "eager")
    try:
        with torch.no_grad():
            out = m(input_ids=torch.tensor([IDS[:10] + [9]]), output_attentions=True)
    finally:
        _set_impl(m, "sdpa")
    for layer, att in enumerate(out.attentions):                              # (1, H, 11, 11)
        a = att[0].mean(0)                                                    # (11, 11)
        want = torch.zeros(11)
        for i in range(11):
            want[: i + 1] += (a[i, : i + 1] < 1.0 / (i + 1)).float()
        assert torch.equal(b.attn["low"][layer], want)
        assert 0 < float(want.sum()) < 66
    assert "low" not in c.attn and b.copy().attn["low"].shape == (2, 11)
    with pytest.raises(ValueError, match="window"):
        c.track_attention(0.5, window=4, pool=2)
    for bad in ({"window": 0}, {"pool": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            KVCache().track_attention(0.5, **bad)


def test_attention_hooks_removed_and_stats_follow_edits(lm2):
    m = lm2.model
    def n_hooks():
        return sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) for mod in m.modules())

    before = n_hooks()
    c = KVCache()
    c.track_attention(0.9)
    c.forward(m, IDS[:12], writer="teacher", attention=True)
    assert n_hooks() == before
    acc = c.attn["acc"].clone()
    c.evict([2, 3])
    keep = [s for s in range(12) if s not in (2, 3)]
    assert torch.equal(c.attn["acc"], acc[:, keep])
    c.apply([{"action": "insert", "pos": 1, "token_ids": [40]}], m, writer="teacher")
    assert c.attn["acc"].shape == (2, 11) and float(c.attn["acc"][:, 1].abs().sum()) == 0.0
    assert torch.equal(c.copy().attn["acc"], c.attn["acc"])
    with pytest.raises(ValueError, match="track_attention"):
        KVCache().forward(m, [1, 2], writer="teacher", attention=True)


def test_forward_nbytes_counts_the_dequantized_int8_prefix(lm2):
    m = lm2.model
    c, _ = KVCache.prefill(m, IDS, writer="teacher")
    fp = c.nbytes()
    assert c.forward_nbytes() == fp
    c.quantize_older(window=4, group=8)
    nq = c.n_int8
    assert nq == len(IDS) - 4 and c.nbytes() < fp
    per_entry = fp // len(IDS)                                  # FP K/V bytes of one entry, every layer
    assert c.forward_nbytes() == c.nbytes() + nq * per_entry     # the FP copy each forward materializes


def test_append_from_and_splice_last_read_int8_sources(lm2):
    m = lm2.model
    src, _ = KVCache.prefill(m, IDS, writer="teacher")
    exact = src.copy()
    src.quantize_older(window=2, group=4)                       # almost all of src is INT8
    dst, _ = KVCache.prefill(m, IDS[:10], writer="student")
    dst.append_from(src, 3)                                     # positions 10, 11, 12: INT8 in src
    k, _ = dst.kv(1)
    rk, _ = exact.kv(1)
    bound = float(rk.abs().max()) / 254 + 1e-6
    assert float((k[:, :, 10:13] - rk[:, :, 10:13]).abs().max()) <= bound
    assert float((k[:, :, 10:13] - rk[:, :, 10:13]).abs().max()) > 0     # really read through INT8
    dst.check()


def test_evict_failure_leaves_cache_unchanged(lm2, monkeypatch):
    m = lm2.model
    c = KVCache()
    c.track_attention(0.9)
    c.forward(m, IDS, writer="teacher", attention=True)
    c.quantize_older(window=4, group=8)
    live, acc, n8 = list(c.live), c.attn["acc"].clone(), c.n_int8
    kv = [c.kv(i) for i in range(c.num_layers)]

    def boom(self, idx):
        raise RuntimeError("out of memory (injected)")

    monkeypatch.setattr(Int8Layer, "gather", boom)
    with pytest.raises(RuntimeError, match="injected"):
        c.evict([0, 5, 22])
    assert c.live == live and c.n_int8 == n8 and torch.equal(c.attn["acc"], acc)
    assert all(torch.equal(a, b) for i in range(c.num_layers) for a, b in zip(c.kv(i), kv[i]))
    assert "evicted" not in c.events.event
    c.check()


def test_streamingllm_positions_inside_the_cache(lm1):
    """StreamingLLM as published: after each cut the survivors sit at positions 0 .. window - 1 and the next
    query takes position ``window``; the logits equal a fresh cache of the same tokens at those positions."""
    from kvlab.decode.evict_phase import apply_keep, evict_view
    from kvlab.eviction import SlidingWindow, StreamingLLM

    pol, slide = StreamingLLM(8, sinks=2), SlidingWindow(8, sinks=2)
    c, _ = KVCache.prefill(lm1.model, IDS, writer="teacher")
    s, _ = KVCache.prefill(lm1.model, IDS, writer="teacher")
    for tok in (9, 10, 11):
        for cache, p in ((c, pol), (s, slide)):
            apply_keep(cache, p.keep(evict_view(cache, 1, None, 64)), lm1.model)
            cache.forward(lm1.model, [tok], writer="teacher")
    assert len(c) == 9 and c.positions == list(range(9)) and c.next_position == 9
    assert s.positions[:2] == [0, 1] and s.positions[2] > 2                        # sliding keeps the gap
    kept = [IDS[0], IDS[1]] + (IDS + [9, 10, 11])[-7:]
    assert c.token_ids == kept and s.token_ids == kept
    ref, _ = KVCache.prefill(lm1.model, kept, writer="teacher")
    torch.testing.assert_close(c.kv(c.num_layers - 1)[0], ref.kv(c.num_layers - 1)[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(c.forward(lm1.model, [12], writer="teacher"),
                               ref.forward(lm1.model, [12], writer="teacher"), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="sinks"):
        StreamingLLM(4, sinks=4)
