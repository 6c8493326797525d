"""Eviction policies: validation, budgets, protected windows, block areas; pure decisions."""
from __future__ import annotations

import math

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlab.eviction import (EVICTION_POLICIES, H2O, BlockEvict, ConfKV, EvictView, FullCache, PyramidKV, RandomEvict,
                            Scissorhands, SlidingWindow, SnapKV, confidence, drawn_stats, pyramid_weights)

V = 1000
CONFIDENT = SimpleNamespace(entropy_bits=0.05, top1_prob=0.99, margin=0.985)
UNSURE = SimpleNamespace(entropy_bits=8.0, top1_prob=0.05, margin=0.001)


def view(n, record=CONFIDENT, layers=3, seed=0, step=1, positions=None):
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(layers, n, generator=g) * 5
    return EvictView(step=step, length=n, positions=tuple(positions or range(n)), record=record, vocab_size=V,
                     num_layers=layers, attn={"acc": acc, "ema": acc / 5, "count": torch.arange(n, 0, -1).float(),
                                              "low": (5 - acc).round()})


def test_registry_names():
    assert set(EVICTION_POLICIES) == {"full", "sliding", "h2o", "random", "confkv", "block", "snapkv", "scissorhands",
                                      "pyramidkv", "knorm", "snapkv_scorer", "streamingllm"}
    assert EVICTION_POLICIES["pyramidkv"] is PyramidKV
    assert EVICTION_POLICIES["confkv"] is ConfKV


@pytest.mark.parametrize("make, name", [
    (lambda: SlidingWindow(0), "window"),
    (lambda: SlidingWindow(8, sinks=8), "sinks"),
    (lambda: H2O(0, 0), "budget"),
    (lambda: H2O(-3, 0), "budget"),
    (lambda: H2O(16, 16), "recent"),
    (lambda: RandomEvict(16, 20), "recent"),
    (lambda: RandomEvict(16, 4, rate=1.5), "rate"),
    (lambda: ConfKV(gamma=1.2), "gamma"),
    (lambda: ConfKV(gamma=-0.1), "gamma"),
    (lambda: ConfKV(tight=0), "tight"),
    (lambda: ConfKV(tight=64, loose=32), "loose"),
    (lambda: ConfKV(tight=32, protect=32), "protect"),
    (lambda: ConfKV(attn_weight=2.0), "attn_weight"),
    (lambda: ConfKV(int8_window=0), "int8_window"),
    (lambda: ConfKV(pyramid_ratio=0.0), "pyramid_ratio"),
    (lambda: ConfKV(confidence_from="logits"), "confidence_from"),
    (lambda: SnapKV(16, window=16), "window"),
    (lambda: Scissorhands(16, 16), "recent"),
    (lambda: SnapKV(32, kernel=4), "kernel"),
    (lambda: PyramidKV(16, window=16), "window"),
    (lambda: PyramidKV(32, kernel=4), "kernel"),
    (lambda: PyramidKV(32, beta=0), "beta"),
    (lambda: PyramidKV(0), "budget"),
    (lambda: BlockEvict(block_size=0), "block_size"),
    (lambda: BlockEvict(evictable_blocks=0), "evictable_blocks"),
    (lambda: BlockEvict(score="max"), "score"),
    (lambda: BlockEvict(kvcrush=-1), "kvcrush"),
    (lambda: BlockEvict(start_blocks=0), "start_blocks"),
    (lambda: BlockEvict(recent_blocks=0), "recent_blocks"),
    (lambda: BlockEvict(anchor="median"), "anchor"),
    (lambda: BlockEvict(snapkv_window=0), "snapkv_window"),
    (lambda: BlockEvict(pool_window=0), "pool_window"),
    (lambda: BlockEvict.from_sizes(0, 128, 448, block_size=16), "start_size"),
    (lambda: BlockEvict.from_sizes(32, 128, 448, block_size=24), "start_size"),
    (lambda: BlockEvict.from_sizes(32, 100, 448, block_size=16), "recent_size"),
    (lambda: BlockEvict.from_sizes(32, 128, 160, block_size=16), "max_cache_size"),
])
def test_bad_parameters_name_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_from_sizes_matches_openvino_layout():
    p = BlockEvict.from_sizes(32, 128, 448, block_size=16, score="norm_sum")
    assert (p.start_blocks, p.evictable_blocks, p.recent_blocks, p.max_cache_size) == (2, 18, 8, 448)
    d = BlockEvict()                                          # seed 003 defaults: 32 start / 512 evictable / 128 recent
    assert (d.block_size * d.start_blocks, d.block_size * d.evictable_blocks, d.block_size * d.recent_blocks) \
        == (32, 512, 128)
    assert (d.score, d.attention_window, d.attention_pool, d.max_after_eviction) == ("norm_sum", 8, 7, 687)


def test_confidence_formula_and_budget_switch():
    hi = confidence(CONFIDENT.entropy_bits, CONFIDENT.top1_prob, CONFIDENT.margin, V)
    lo = confidence(UNSURE.entropy_bits, UNSURE.top1_prob, UNSURE.margin, V)
    assert hi > 0.99 and lo < 0.1
    # exact form: sigmoid(3(1-H/lnV) + 0.5 min(ln p1 - ln p2, 10) + 3 p1 - 3)
    import math
    h = 2.0 * math.log(2) / math.log(V)
    z = 3 * (1 - h) + 0.5 * (math.log(0.6) - math.log(0.3)) + 3 * 0.6 - 3
    assert confidence(2.0, 0.6, 0.3, V) == pytest.approx(1 / (1 + math.exp(-z)))
    p = ConfKV(gamma=0.7, tight=16, loose=32, protect=4, attn_weight=0.5)
    k_conf = p.keep(view(40, CONFIDENT))
    k_unsure = p.keep(view(40, UNSURE))
    assert (k_conf.budget, len(k_conf.slots)) == (16, 16)
    assert (k_unsure.budget, len(k_unsure.slots)) == (32, 32)
    assert k_conf.signals()["confidence"] == pytest.approx(hi)
    assert ConfKV(gamma=0.0, tight=16, loose=32, protect=4).keep(view(40, UNSURE)).budget == 16
    assert ConfKV(gamma=1.0, tight=16, loose=32, protect=4).keep(view(40, CONFIDENT)).budget == 32


def test_confkv_ranker_ablations():
    n = 30
    v = view(n, CONFIDENT)
    rec = ConfKV(tight=10, loose=20, protect=2, attn_weight=0.0).keep(v)
    assert rec.slots == tuple(range(n - 10, n))                   # recency only = newest
    att = ConfKV(tight=10, loose=20, protect=2, attn_weight=1.0, per_layer=False).keep(v)
    ema = v.attn["ema"][:, : n - 2]
    norm = (ema - ema.amin(1, keepdim=True)) / (ema.amax(1, keepdim=True) - ema.amin(1, keepdim=True))
    top = sorted(torch.topk(norm.mean(0), 8).indices.tolist())
    assert att.slots == tuple(top) + (n - 2, n - 1)               # per_layer=False: the layer mean
    own = ConfKV(tight=10, loose=20, protect=2, attn_weight=1.0).keep(v)      # default: each layer its own
    assert own.layers == tuple(tuple(sorted(torch.topk(row, 8).indices.tolist())) + (n - 2, n - 1) for row in norm)
    assert not ConfKV(attn_weight=0.0).needs_attention and ConfKV().needs_attention


def test_pyramid_deeper_layers_keep_fewer_each_by_its_own_ranking():
    w = pyramid_weights(30, 0.25)
    assert float(w[0]) == pytest.approx(1.75) and float(w[-1]) == pytest.approx(0.25)
    assert bool((w[:-1] > w[1:]).all()) and float(w.mean()) == pytest.approx(1.0)     # equal memory
    n = 40
    ema = torch.zeros(3, n)
    ema[0, :20] = 1.0           # layer 0 (shallow) likes the old half, layers 1 and 2 the newer entries
    ema[1, 20:38] = 1.0
    ema[2, 30:38] = 1.0
    v = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 3, {"acc": ema, "ema": ema, "count": torch.ones(n)})
    flat = ConfKV(tight=12, loose=12, protect=2, attn_weight=1.0, per_layer=False).keep(v)
    pyr = ConfKV(tight=12, loose=12, protect=2, attn_weight=1.0, pyramidal=True, pyramid_ratio=0.5).keep(v)
    assert flat.layers is None and len(flat.slots) == 12
    assert [len(k) for k in pyr.layers] == [18, 12, 6]          # 12 · (1.5, 1, 0.5): mean 12
    assert pyr.slots == pyr.layers[0] and pyr.budget == 12
    assert all(s < 20 for s in pyr.layers[0][:-2])               # each layer keeps what IT attends to
    assert all(20 <= s < 38 for s in pyr.layers[1][:-2]) and all(30 <= s < 38 for s in pyr.layers[2][:-2])
    assert all(k[-2:] == (n - 2, n - 1) for k in pyr.layers)     # the protected window on every layer
    # a ragged view (layers already differ): each layer is ranked over its own slots and positions
    lp = (tuple(range(n)), tuple(range(0, n, 2)), tuple(range(n - 8, n)))
    emas = [ema[0], ema[1, list(lp[1])], ema[2, list(lp[2])]]
    rag = EvictView(1, n, lp[0], CONFIDENT, V, 3, {"acc": emas, "ema": emas, "count": [torch.ones(len(p)) for p in lp]},
                    layer_positions=lp)
    k = ConfKV(tight=12, loose=12, protect=2, attn_weight=1.0, pyramidal=True, pyramid_ratio=0.5).keep(rag)
    assert [len(x) for x in k.layers] == [18, 12, 6]
    assert sum(lp[1][s] >= 20 for s in k.layers[1][:-2]) == 8    # every liked slot of layer 1's own set
    with pytest.raises(ValueError, match="pyramid_ratio"):       # no layer may fall to the protected window
        ConfKV(tight=4, loose=4, protect=3, pyramidal=True, pyramid_ratio=0.25)


@pytest.mark.parametrize("budget,layers,ratio", [(48, 30, 0.5), (56, 30, 0.5), (13, 7, 0.3), (100, 2, 0.2),
                                                 (17, 1, 0.5), (64, 30, 0.25)])
def test_pyramid_mean_budget_equals_uniform_budget(budget, layers, ratio):
    from kvlab.eviction.confkv import pyramid_budgets

    b = pyramid_budgets(budget, layers, ratio)
    assert sum(b) == layers * budget                              # the pyramid's mean budget is the uniform one
    assert b == sorted(b, reverse=True) and len(b) == layers
    assert max(b) <= math.ceil(budget * (2 - ratio)) and min(b) >= math.floor(budget * ratio)


def test_block_eviction_decides_per_layer():
    """OpenVINO scores and evicts blocks per layer: layers whose scores differ evict different blocks,
    the same number of them; each layer's choice is layer_evicted over its own acc and count."""
    bs, n = 2, 2 + 6 * 2 + 2                                   # start 1 block, 6 evictable, recent 1
    g = torch.Generator().manual_seed(3)
    acc = torch.rand(3, n, generator=g)
    count = torch.arange(n, 0, -1).float()
    v = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 3, {"acc": acc, "ema": acc, "count": count})
    for p in (BlockEvict(bs, 1, 3, 1), BlockEvict(bs, 1, 2, 1, kvcrush=1, score="sum")):
        k = p.keep(v)
        want = [p.kept_slots(p.layer_evicted(acc[i], count, n, 1), n) for i in range(3)]
        assert list(k.layers) == want and k.slots == want[0]
        assert len({len(x) for x in k.layers}) == 1 and len(set(k.layers)) > 1
    rot = BlockEvict(bs, 1, 3, 1, rerotate=True).keep(v)          # re-rotation: the same per-layer choice
    assert rot.rerotate and rot.layers == BlockEvict(bs, 1, 3, 1).keep(v).layers


def test_h2o_keeps_heavy_hitters_and_recent():
    n = 20
    acc = torch.zeros(2, n)
    acc[:, [1, 7, 9]] = 10.0
    v = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 2, {"acc": acc, "ema": acc, "count": torch.ones(n)})
    assert H2O(budget=7, recent=4).keep(v).slots == (1, 7, 9, 16, 17, 18, 19)


def test_sliding_keeps_sinks_and_newest():
    assert SlidingWindow(8, sinks=2).keep(view(20)).slots == (0, 1, 14, 15, 16, 17, 18, 19)
    assert SlidingWindow(8, sinks=0).keep(view(20)).slots == tuple(range(12, 20))


def test_random_is_seeded_and_rate_gates_steps():
    p = RandomEvict(10, 3, seed=1)
    assert p.keep(view(30, step=5)) == p.keep(view(30, step=5))
    assert p.keep(view(30, step=5)).slots != RandomEvict(10, 3, seed=2).keep(view(30, step=5)).slots
    gated = RandomEvict(10, 3, seed=1, rate=0.3)
    fired = sum(len(gated.keep(view(30, step=s)).slots) < 30 for s in range(400))
    assert 80 < fired < 160                                     # ~ 0.3 · 400


def _confkv(t, extra, p, lam, pyr, sinks):
    tight = t + p + sinks + 1
    pyr = pyr and math.floor(tight * 0.5) > p + sinks           # a valid pyramid (else ValueError, tested apart)
    return ConfKV(tight=tight, loose=tight + extra, protect=p, attn_weight=lam, pyramidal=pyr, gamma=0.5, sinks=sinks)


POLICIES = st.one_of(
    st.builds(lambda w, s: SlidingWindow(w + s + 1, sinks=s), st.integers(1, 40), st.integers(0, 6)),
    st.builds(lambda b, r, k: H2O(b + r + k + 1, r, sinks=k), st.integers(0, 40), st.integers(0, 10),
              st.integers(0, 4)),
    st.builds(lambda b, r, k: Scissorhands(b + r + k + 1, r, sinks=k), st.integers(0, 40), st.integers(0, 10),
              st.integers(0, 4)),
    st.builds(lambda b, r, seed, k: RandomEvict(b + r + k + 1, r, seed=seed, sinks=k), st.integers(0, 40),
              st.integers(0, 10), st.integers(0, 5), st.integers(0, 4)),
    st.builds(_confkv, st.integers(0, 30), st.integers(0, 30), st.integers(0, 10), st.sampled_from([0.0, 0.5, 1.0]),
              st.booleans(), st.integers(0, 4)),
)


@settings(max_examples=200, deadline=None)
@given(POLICIES, st.integers(1, 120), st.booleans(), st.integers(0, 3))
def test_budgets_and_protected_windows_respected(policy, n, confident, seed):
    """Every ranker: down to its budget (per layer; a pyramid's layers by pyramid_budgets), its
    protected window kept, and with sinks=k the first k positions survive every eviction."""
    from kvlab.eviction.confkv import pyramid_budgets

    v = view(n, CONFIDENT if confident else UNSURE, seed=seed, step=seed + 1)
    k = policy.keep(v)
    layers = k.layers if k.layers is not None else (k.slots,) * v.num_layers
    budgets = [k.budget] * v.num_layers
    if getattr(policy, "pyramidal", False):
        budgets = pyramid_budgets(k.budget, v.num_layers, policy.pyramid_ratio)
    for slots, budget in zip(layers, budgets):
        slots = list(slots)
        assert slots == sorted(set(slots)) and all(0 <= s < n for s in slots)
        if n <= budget:
            assert slots == list(range(n))                       # nothing evicted at or below the budget
            continue
        assert len(slots) == budget                          # down to the budget, not below
        protected = getattr(policy, "recent", None)
        if protected is None:
            protected = getattr(policy, "protect", None)
        if protected is None:                                # sliding window: sinks + newest
            protected = policy.window - policy.sinks
        assert set(range(policy.sinks)) <= set(slots)        # the sinks survive every eviction
        assert set(range(n - protected, n)) <= set(slots)


def test_sinks_survive_where_the_ranker_would_drop_them():
    """Position 0 has the lowest recency and no attention here: without sinks every ranker drops it,
    with sinks=2 positions 0 and 1 stay, and the budget still holds."""
    n = 40
    v = view(n, CONFIDENT)
    zero = {name: t.clone() for name, t in v.attn.items()}
    for name in ("acc", "ema"):
        zero[name][:, :2] = 0.0
    zero["low"] = torch.zeros(3, n)
    zero["low"][:, :2] = 100.0
    v = EvictView(1, n, v.positions, CONFIDENT, V, 3, zero)
    for make in (lambda k: H2O(12, 4, sinks=k), lambda k: Scissorhands(12, 4, sinks=k),
                 lambda k: ConfKV(tight=12, loose=12, protect=4, gamma=0.0, sinks=k),
                 lambda k: ConfKV(tight=12, loose=12, protect=4, gamma=0.0, attn_weight=0.0, sinks=k),
                 lambda k: ConfKV(tight=12, loose=12, protect=4, gamma=0.0, sinks=k, per_layer=False)):
        off, on = make(0).keep(v), make(2).keep(v)
        for slots in (off.layers or (off.slots,)):
            assert 0 not in slots
        for slots in (on.layers or (on.slots,)):
            assert slots[:2] == (0, 1) and len(slots) == 12
    with pytest.raises(ValueError, match="sinks"):
        ConfKV(tight=12, loose=12, protect=10, sinks=2)


BLOCKS = st.builds(lambda bs, sb, eb, rb, score, crush, anchor: BlockEvict(bs, sb, eb, rb, score=score, kvcrush=crush,
                                                                           anchor=anchor),
                   st.integers(1, 6), st.integers(1, 3), st.integers(1, 6), st.integers(1, 3),
                   st.sampled_from(["sum", "norm_sum"]), st.integers(0, 3),
                   st.sampled_from(["mean", "alternate", "random", "zeros", "ones"]))


@settings(max_examples=150, deadline=None)
@given(BLOCKS, st.integers(1, 120), st.integers(0, 3))
def test_block_eviction_never_touches_start_or_recent_areas(policy, n, seed):
    """OpenVINO's semantics: no eviction below max + bs; then whole evictable blocks only, and the
    cache lands in [max, max + bs - 1] (plus at most kvcrush blocks kept on top)."""
    k = policy.keep(view(n, seed=seed))
    bs, mx = policy.block_size, policy.max_cache_size
    s, r = policy.start_blocks * bs, policy.recent_blocks * bs
    dropped = k.dropped(n)
    if n < mx + bs:
        assert not dropped
        return
    d = policy.n_evict(n)
    assert d >= 1
    crush = policy.kvcrush if policy.kvcrush and d >= policy.kvcrush else 0
    assert len(dropped) == (d - crush) * bs                    # floor counts, whole blocks
    assert mx <= len(k.slots) - crush * bs <= mx + bs - 1
    assert set(range(min(s, n))) <= set(k.slots)
    assert set(range(max(n - r, 0), n)) <= set(k.slots)
    for j in dropped:                                         # whole blocks of the evictable area only
        assert s <= j < n - r
        b0 = s + (j - s) // bs * bs
        assert set(range(b0, b0 + bs)) <= set(dropped)


def test_block_eviction_fires_only_once_a_whole_block_overflows():
    p = BlockEvict(4, 1, 3, 1, score="sum")                    # max 20 entries, blocks of 4
    assert p.n_evict(23) == 0 and not p.keep(view(23)).dropped(23)
    assert p.n_evict(24) == 1 and len(p.keep(view(24)).slots) == 20
    assert p.n_evict(27) == 1 and len(p.keep(view(27)).slots) == 23   # the partial block stays recent
    assert p.n_evict(32) == 3 and len(p.keep(view(32)).slots) == 20


def test_block_scores_sum_vs_norm_sum_and_ties():
    bs, n = 2, 2 + 6 * 2 + 2 + 1                              # start 1 block, 6 evictable + partial, recent 1
    acc = torch.ones(2, n)
    acc[:, 4:6] = 50.0                                        # block 1 heavy under SUM
    count = torch.ones(n)
    count[4:6] = 1000.0                                       # ... but old: NORM_SUM divides it away
    v = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 2, {"acc": acc, "ema": acc, "count": count})
    p = BlockEvict(bs, 1, 4, 1, score="sum")
    assert {4, 5} <= set(p.keep(v).slots)
    assert not {4, 5} & set(BlockEvict(bs, 1, 4, 1, score="norm_sum").keep(v).slots)
    # equal scores: the older blocks go first (OpenVINO's (score, index) order); 2 of 6 blocks go
    flat = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 2,
                     {"acc": torch.ones(2, n), "ema": torch.ones(2, n), "count": torch.ones(n)})
    assert BlockEvict(bs, 1, 4, 1).keep(flat).dropped(n) == [2, 3, 4, 5]
    assert BlockEvict(bs, 1, 4, 1, rerotate=True).keep(v).rerotate


def test_kvcrush_anchor_hamming_and_spacing():
    """KVCrush (kvcrush.cpp): indicators = top half of the evictable entries by raw acc; MEAN anchor
    over ALL evictable blocks with > 0.5; candidates = the evicted blocks sorted by Hamming distance
    (nearest first); picks at ranks 0, s, 2s with s = ⌊d/k⌋; kept on top of the budget."""
    bs = 4
    p = BlockEvict(bs, 1, 2, 1, score="sum", kvcrush=2)        # max 16; 10 blocks → d = 8 evicted by score
    nb = 10
    n = bs + nb * bs + bs
    # block b's entries: the raw scores decide indicators; block sums decide the score order
    pats = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 0],
            [1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 1]]
    acc1 = torch.zeros(n)
    for b, pat in enumerate(pats):
        for j, bit in enumerate(pat):
            acc1[bs + b * bs + j] = (2.0 + 0.01 * b + 0.001 * j) if bit else 0.001 * (b + 1)
    assert sum(map(sum, pats)) == nb * bs // 2                 # exactly the top half are 1s
    acc = acc1.expand(3, n).clone()
    v = EvictView(1, n, tuple(range(n)), CONFIDENT, V, 3, {"acc": acc, "ema": acc, "count": torch.ones(n)})
    scores = p.block_scores(acc1, torch.ones(n), nb)
    evicted = sorted(sorted(range(nb), key=lambda b: (float(scores[b]), b))[:8])
    picks, info = p.kvcrush_keep(acc1, evicted, nb, step=1)
    assert info["indicators"].tolist() == pats
    col_mean = torch.tensor(pats, dtype=torch.float64).mean(0)
    assert info["anchor"].tolist() == [int(m > 0.5) for m in col_mean] == [1, 1, 0, 0]
    want_dist = [sum(a != b for a, b in zip(pat, [1, 1, 0, 0])) for pat in pats]
    assert info["distance"].tolist() == want_dist
    cand = sorted(evicted, key=lambda b: (want_dist[b], b))
    assert info["candidates"] == cand and picks == [cand[0], cand[4]]     # stride ⌊8/2⌋ = 4
    k = p.keep(v)
    plain = BlockEvict(bs, 1, 2, 1, score="sum").keep(v)
    assert len(k.slots) == len(plain.slots) + 2 * bs           # representatives on top of the budget
    assert set(plain.slots) < set(k.slots)
    assert {bs + b * bs for b in picks} <= set(k.slots)
    # other anchors
    assert BlockEvict(bs, 1, 2, 1, kvcrush=1, anchor="alternate").anchor_bits(info["indicators"], 0).tolist() \
        == [0, 1, 0, 1]
    assert BlockEvict(bs, 1, 2, 1, kvcrush=1, anchor="ones").anchor_bits(info["indicators"], 0).tolist() == [1] * 4
    assert BlockEvict(bs, 1, 2, 1, kvcrush=1, anchor="zeros").anchor_bits(info["indicators"], 0).tolist() == [0] * 4
    r = BlockEvict(bs, 1, 2, 1, kvcrush=1, anchor="random", seed=3)
    assert torch.equal(r.anchor_bits(info["indicators"], 5), r.anchor_bits(info["indicators"], 5))
    # only when at least `kvcrush` blocks are evicted: d = 1 < 2 keeps nothing extra
    n1 = bs + 3 * bs + bs
    v1 = EvictView(1, n1, tuple(range(n1)), CONFIDENT, V, 3,
                   {"acc": acc[:, :n1], "ema": acc[:, :n1], "count": torch.ones(n1)})
    assert p.keep(v1).slots == BlockEvict(bs, 1, 2, 1, score="sum").keep(v1).slots


def test_drawn_stats_follow_temperature_and_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = torch.softmax(logits, 0)
    ent, p1, m = drawn_stats(logits, 0.0, 0.9)                 # greedy: the model's own distribution
    assert p1 == pytest.approx(float(p[0])) and m == pytest.approx(float(p[0] - p[1]))
    assert ent == pytest.approx(float(-(p * p.log2()).sum()), rel=1e-5)
    pt = torch.softmax(logits / 0.5, 0)                       # T = 0.5 sharpens
    ent_t, p1_t, _ = drawn_stats(logits, 0.5, 1.0)
    assert p1_t == pytest.approx(float(pt[0])) and ent_t < ent
    # nucleus 0.7 at T = 1: the sorted cumulative mass before each token < 0.7 keeps tokens 0, 1
    keep = p[:2] / p[:2].sum()
    ent_p, p1_p, m_p = drawn_stats(logits, 1.0, 0.7)
    assert p1_p == pytest.approx(float(keep[0])) and m_p == pytest.approx(float(keep[0] - keep[1]))
    _, p1_one, m_one = drawn_stats(logits, 0.1, 0.5)          # a one-token nucleus: certainty
    assert p1_one == 1.0 and m_one == 1.0


def test_confkv_confidence_from_drawn_vs_raw():
    """The model's raw distribution (the record's) decides the budget by default (the paper's "Let z be
    the logits"); confidence_from="drawn" uses the tempered top-p one the token was drawn from."""
    n = 40
    base = view(n, UNSURE)
    logits = torch.zeros(V)
    logits[:3] = torch.tensor([3.0, 2.0, 1.0])                # raw T = 1: flat over 1000 tokens (unsure)
    kw = dict(step=1, length=n, positions=base.positions, record=UNSURE, vocab_size=V, num_layers=3,
              attn=base.attn, logits=logits)
    sharp = EvictView(**kw, temperature=0.2, top_p=0.9)        # tempered + nucleus: one token left
    greedy = EvictView(**kw, temperature=0.0, top_p=1.0)       # greedy: the raw model distribution
    p = ConfKV(gamma=0.7, tight=16, loose=32, protect=4, confidence_from="drawn")
    assert p.step_confidence(sharp) > 0.99 and p.keep(sharp).budget == 16
    assert p.step_confidence(greedy) < 0.7 and p.keep(greedy).budget == 32
    raw = ConfKV(gamma=0.7, tight=16, loose=32, protect=4)
    assert raw.confidence_from == "raw"
    assert raw.keep(sharp).budget == 32 and raw.step_confidence(sharp) == pytest.approx(
        confidence(UNSURE.entropy_bits, UNSURE.top1_prob, UNSURE.margin, V))


def test_snapkv_compresses_the_prompt_once_by_pooled_window_scores():
    n, w = 30, 4
    acc = torch.zeros(2, n)
    acc[:, 7] = 10.0                                          # one heavy entry: the pool spreads it to 5..9
    acc[:, 20] = 4.0
    v = EvictView(step=1, length=n, positions=tuple(range(n)), record=CONFIDENT, vocab_size=V, num_layers=2,
                  attn={"acc": acc, "ema": acc, "count": torch.ones(n)}, first=True)
    p = SnapKV(budget=12, window=w, kernel=5)
    sc = p.scores(acc[0], n)
    want = torch.nn.functional.avg_pool1d(acc[0, :n - w].view(1, 1, -1), 5, stride=1, padding=2).view(-1)
    assert torch.allclose(sc, want) and float(sc[5]) == pytest.approx(2.0)
    k = p.keep(v).slots
    # 8 of 26 candidates: 5..9 (pooled 2.0), then 3 of 18..22 (0.8 each; ties → newer), + the window
    assert k == (5, 6, 7, 8, 9, 20, 21, 22, 26, 27, 28, 29)
    assert SnapKV(budget=12, window=w).keep(EvictView(**{**v.__dict__, "first": False})).slots == tuple(range(n))
    later = EvictView(step=2, length=n + 5, positions=tuple(range(n + 5)), record=CONFIDENT, vocab_size=V,
                      num_layers=2, attn={"acc": torch.zeros(2, n + 5), "ema": acc, "count": torch.ones(n + 5)})
    assert p.keep(later).slots == tuple(range(n + 5))           # decoding appends without eviction
    assert p.attention_window == w and p.needs_attention


def test_scissorhands_drops_the_entries_most_often_below_average():
    n = 12
    low = torch.tensor([[0, 5, 1, 7, 2, 2, 9, 0, 3, 4, 8, 8.0]] * 2)      # (L, T) below-average counts
    v = EvictView(step=3, length=n, positions=tuple(range(n)), record=CONFIDENT, vocab_size=V, num_layers=2,
                  attn={"acc": low, "ema": low, "count": torch.ones(n), "low": low})
    p = Scissorhands(budget=7, recent=2)
    # candidates 0..9: keep the 5 with the fewest lows: 0 (0), 7 (0), 2 (1), then 4/5 (2 each) → 4, 5
    assert p.keep(v).slots == (0, 2, 4, 5, 7, 10, 11)
    assert p.attention_below and p.needs_attention
    assert Scissorhands(budget=12, recent=2).keep(v).slots == tuple(range(n))


def test_full_cache_keeps_everything():
    assert FullCache().keep(view(50)).slots == tuple(range(50))


def test_pyramidkv_budgets_follow_the_reference_pyramid():
    """Zefan-Cai/PyramidKV's schedule: lo = (B-w)//β, hi = 2(B-w) - lo (capped at n - w), integer
    steps down the layers; the layers together keep L·B plus the steps' rounding."""
    p = PyramidKV(budget=64, window=16, beta=20)
    b = p.layer_budgets(200, 24)
    assert b[0] == 94 + 16 and b[1] == 90 + 16 and b[-1] == 94 - 23 * 4 + 16     # lo = 2, hi = 94, step 4
    assert all(x > y for x, y in zip(b, b[1:])) and sum(b) == 24 * 64
    assert p.layer_budgets(64, 24) == [64] * 24                                  # n ≤ B: nothing to cut
    assert p.layer_budgets(90, 24) == [64] * 24                                  # n < 2(B - w): SnapKV's uniform cut
    capped = p.layer_budgets(100, 4)                                             # hi = 2·48 - 2 = 94 ≥ n - w = 84
    assert capped == [100, 76, 52, 28]                                           # lo = 96 - 84, step 24
    assert 7 * 50 < sum(PyramidKV(budget=50, window=8, beta=3).layer_budgets(300, 7)) <= 7 * 50 + 7 * 6 // 2
    assert PyramidKV(budget=64, window=16).layer_budgets(200, 1) == [64]


def test_pyramidkv_cuts_each_layer_by_its_own_window_scores_once():
    n, w = 60, 4
    acc = torch.zeros(3, n)
    acc[0, 5] = acc[1, 30] = acc[2, 50] = 10.0                # each layer's own heavy entry
    v = EvictView(step=1, length=n, positions=tuple(range(n)), record=CONFIDENT, vocab_size=V, num_layers=3,
                  attn={"acc": acc, "ema": acc, "count": torch.ones(n)}, first=True)
    p = PyramidKV(budget=16, window=w, beta=4)
    k = p.keep(v)
    budgets = p.layer_budgets(n, 3)
    assert [len(x) for x in k.layers] == budgets and budgets[0] > budgets[1] > budgets[2]
    assert k.slots == k.layers[0] and k.budget == 16
    for layer, heavy in enumerate((5, 30, 50)):
        assert heavy in k.layers[layer] and k.layers[layer][-w:] == tuple(range(n - w, n))
        want = SnapKV(16, window=w).layer_keep(acc[layer], n, budgets[layer])
        assert k.layers[layer] == want
    assert not {5, 30} & set(k.layers[2])                     # the top layer keeps only its own heavy entry
    later = EvictView(step=2, length=n, positions=tuple(range(n)), record=CONFIDENT, vocab_size=V, num_layers=3,
                      attn={"acc": acc, "ema": acc, "count": torch.ones(n)})
    assert p.keep(later).dropped(n) == [] and p.keep(later).layers is None       # decoding appends
