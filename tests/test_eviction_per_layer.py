"""Per-layer ranking: H2O, Scissorhands, SnapKV and uniform Conf-KV decide per layer — every
layer keeps its own top entries by its own statistic plus its own newest window — and ``per_layer=False``
keeps the earlier layer-mean decision (one live set). The expected decisions are recomputed here from
the view alone (sort by score, ties → newer slot), not through the policies' helpers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import make_tiny_lm
from kvlab.decode import DecodeConfig, Decoding
from kvlab.eviction import H2O, ConfKV, EvictView, Scissorhands, SnapKV

V = 1000
CONFIDENT = SimpleNamespace(entropy_bits=0.05, top1_prob=0.99, margin=0.985)
PROMPT = "the quick brown fox jumps over the lazy dog " * 2

POLICIES = {
    "h2o": lambda **kw: H2O(budget=12, recent=3, **kw),
    "scissorhands": lambda **kw: Scissorhands(budget=12, recent=3, **kw),
    "snapkv": lambda **kw: SnapKV(budget=12, window=4, kernel=3, **kw),
    "confkv": lambda **kw: ConfKV(gamma=0.5, tight=12, loose=20, protect=3, attn_weight=0.5, **kw),
    "confkv_attn_only": lambda **kw: ConfKV(gamma=0.5, tight=12, loose=20, protect=3, attn_weight=1.0, **kw),
}


def make_view(lengths, seed=0, same_positions=False):
    """A view whose layers hold ``lengths[l]`` entries each, with their own positions (ascending, so
    the newest entries are the last slots) and their own random statistics."""
    g = torch.Generator().manual_seed(seed)
    if same_positions:
        lp = (tuple(range(lengths[0])),) * len(lengths)
    else:
        lp = tuple(tuple(sorted(torch.randperm(80, generator=g)[:n].tolist())) for n in lengths)
    attn = {name: [torch.rand(n, generator=g) * 5 for n in lengths] for name in ("acc", "ema", "low", "count")}
    return EvictView(step=1, length=lengths[0], positions=lp[0], record=CONFIDENT, vocab_size=V,
                     num_layers=len(lengths), attn=attn, first=True, layer_positions=lp)


def ranked(score, k) -> list[int]:
    """The ``k`` highest of ``score`` (one per candidate slot 0..C-1), ties → the newer slot; ascending."""
    order = sorted(range(len(score)), key=lambda j: (-float(score[j]), -j))
    return sorted(order[:max(k, 0)])


def minmax(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else torch.zeros_like(x)


def pooled(acc: torch.Tensor, kernel: int) -> list[float]:
    """Centred average pool with zero padding (SnapKV's smoothing), by hand."""
    h, n = kernel // 2, len(acc)
    return [sum(float(acc[i]) for i in range(j - h, j + h + 1) if 0 <= i < n) / kernel for j in range(n)]


def layer_score(p, view, l, n_cand):
    """Layer ``l``'s score of its candidates (the slots outside its protected window) under policy ``p``."""
    if isinstance(p, H2O):
        return view.attn["acc"][l][:n_cand]
    if isinstance(p, Scissorhands):
        return -view.attn["low"][l][:n_cand]
    if isinstance(p, SnapKV):
        return pooled(view.attn["acc"][l][:n_cand], p.kernel)
    pos = torch.tensor(view.layer_positions[l][:n_cand], dtype=torch.float32)
    return p.attn_weight * minmax(view.attn["ema"][l][:n_cand]) + (1 - p.attn_weight) * minmax(pos)


def window(p) -> int:
    return p.window if isinstance(p, SnapKV) else p.protect if isinstance(p, ConfKV) else p.recent


def budget(p) -> int:
    return p.tight if isinstance(p, ConfKV) else p.budget      # CONFIDENT: Conf-KV's tight budget


def expected_layers(p, view) -> list[tuple[int, ...]]:
    out = []
    for l, pos in enumerate(view.layer_positions):
        n, b, w = len(pos), budget(p), window(p)
        if n <= b:
            out.append(tuple(range(n)))
            continue
        out.append(tuple(ranked(layer_score(p, view, l, n - w), b - w)) + tuple(range(n - w, n)))
    return out


def expected_mean(p, view) -> tuple[int, ...]:
    n, b, w = view.length, budget(p), window(p)
    if n <= b:
        return tuple(range(n))
    score = torch.stack([torch.as_tensor(layer_score(p, view, l, n - w), dtype=torch.float32)
                         for l in range(view.num_layers)]).mean(0)
    return tuple(ranked(score, b - w)) + tuple(range(n - w, n))


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("lengths", [(40, 40, 40), (40, 10, 50)], ids=["equal", "ragged"])
def test_each_layer_keeps_its_own_top_entries_and_recent_window(name, lengths):
    p = POLICIES[name]()
    view = make_view(lengths, seed=len(name))
    k = p.keep(view)
    want = expected_layers(p, view)
    assert k.layers is not None and list(k.layers) == want
    assert k.slots == k.layers[0] and k.budget == budget(p)             # PyramidKV/BlockEvict's convention
    assert len(set(k.layers)) == 3                                       # the layers keep different entries
    w = window(p)
    for kept, n in zip(k.layers, lengths):
        assert len(kept) == min(n, budget(p))                           # budget = entries per layer
        assert set(range(max(n - w, 0), n)) <= set(kept)                 # that layer's own newest window
    assert k.dropped_layers(lengths) == [[s for s in range(n) if s not in set(kept)]
                                         for kept, n in zip(k.layers, lengths)]


@pytest.mark.parametrize("name", list(POLICIES))
def test_per_layer_false_is_the_layer_mean_decision(name):
    view = make_view((40, 40, 40), seed=7, same_positions=True)
    old = POLICIES[name](per_layer=False).keep(view)
    assert old.layers is None and old.slots == expected_mean(POLICIES[name](), view)
    new = POLICIES[name]().keep(view)
    assert any(kept != old.slots for kept in new.layers)                 # the two rankings do differ here
    # the layer-mean ranking needs one live set: a ragged cache is refused, naming the fix
    with pytest.raises(ValueError, match="per layer"):
        POLICIES[name](per_layer=False).keep(make_view((40, 30, 40), seed=7))
    # under the budget on every layer, both keep everything
    small = make_view((9, 9, 9), seed=1, same_positions=True)
    assert POLICIES[name](per_layer=False).keep(small).slots == POLICIES[name]().keep(small).slots == tuple(range(9))


@pytest.mark.parametrize("make", [lambda: H2O(12, 3, per_layer=1), lambda: Scissorhands(12, 3, per_layer="yes"),
                                  lambda: SnapKV(32, per_layer=None), lambda: ConfKV(per_layer=0),
                                  lambda: ConfKV(pyramidal=True, per_layer=False)])
def test_per_layer_flag_is_validated(make):
    with pytest.raises(ValueError, match="per_layer"):
        make()


# ----------------------------------------------------------------------------- through the decode loop


class Recording:
    """Wraps a policy; records each view it saw (statistics copied) and its decision. Test only."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def keep(self, view):
        attn = {k: [t.detach().clone() for t in v] for k, v in view.attn.items()}
        seen = EvictView(**{**view.__dict__, "attn": attn})
        decision = self.inner.keep(view)
        self.log.append((seen, decision))
        return decision


@pytest.fixture(scope="module")
def sharp3():
    """A 3-layer tiny model with sharper attention: a random init attends almost uniformly, so an
    entry's accumulated mass is nearly its age on every layer and all layers would rank alike; q and
    k scaled by 8 give each layer its own content-dependent attention."""
    lm = make_tiny_lm(seed=5, layers=3)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return lm


DECODE = {
    "h2o": lambda **kw: H2O(20, 4, **kw),
    "scissorhands": lambda **kw: Scissorhands(20, 4, **kw),
    "confkv": lambda **kw: ConfKV(gamma=0.0, tight=20, loose=30, protect=4, **kw),
    "snapkv": lambda **kw: SnapKV(budget=12, window=2, kernel=3, **kw),
}


@pytest.mark.parametrize("name", list(DECODE))
def test_decode_evicts_per_layer_and_the_cache_stays_consistent(sharp3, name):
    """On a 3-layer tiny model (sharpened attention): every decision is each layer's own top entries by its own measured
    statistic (recomputed from the recorded view), the cache applies it per layer (each layer's next
    view holds exactly what that layer kept, plus the new entry), the mirror stays consistent, and the
    layers end up holding different entries; with per_layer=False they stay one live set."""
    pol = Recording(DECODE[name]())
    d = Decoding(sharp3, None, PROMPT, DecodeConfig(mode="teacher", chat=False, max_new_tokens=12, evict=pol))
    recs = []
    for rec in d:
        d.cache.check()
        recs.append(rec)
    L = len(d.prompt_ids)
    b = budget(pol.inner)
    assert L > b
    evicting = [(v, k) for v, k in pol.log if k.layers is not None]
    assert evicting                                                      # eviction bit, per layer
    for v, k in evicting:
        assert list(k.layers) == expected_layers(pol.inner, v)
    for (v, k), (nxt, _) in zip(pol.log, pol.log[1:]):                   # the cache did what was decided
        for l in range(3):
            kept = k.layers[l] if k.layers is not None else k.slots
            assert nxt.layer_positions[l][:-1] == tuple(v.layer_positions[l][s] for s in kept)
    lp = d.cache.layer_positions()
    assert len(set(lp)) > 1                                             # the layers hold different entries
    grow = 0 if name != "snapkv" else len(recs) - 1                     # SnapKV cuts once, then appends
    assert d.cache.layer_lengths() == [b + grow] * 3
    assert all(p[-3:] == lp[0][-3:] for p in lp)                        # the newest entries on every layer
    assert sum(r.evicted for r in recs) == L + len(recs) - 1 - len(d.cache)     # ledger: live or evicted
    old = Decoding(sharp3, None, PROMPT, DecodeConfig(mode="teacher", chat=False, max_new_tokens=12,
                                                     evict=DECODE[name](per_layer=False)))
    for _ in old:
        old.cache.check()
    assert old.cache.uniform and old.cache.layer_lengths() == [b + grow] * 3


@pytest.mark.parametrize("seed", range(40))
def test_batched_ranking_equals_top_slots_per_layer(seed):
    """top_slots_layers (one sort for all layers) picks exactly what top_slots picks layer by layer,
    ties (many, from small integer scores) included; ragged lengths fall back to the loop."""
    from kvlab.eviction.base import top_slots, top_slots_layers

    g = torch.Generator().manual_seed(seed)
    L = int(torch.randint(1, 6, (1,), generator=g))
    m = int(torch.randint(1, 40, (1,), generator=g))
    ragged = seed % 4 == 3
    rows = [torch.randint(0, 4, (m + (l if ragged else 0),), generator=g).float() for l in range(L)]
    for k in (0, 1, m // 2, m - 1, m, m + 3):
        want = [top_slots(r, list(range(r.numel())), k) for r in rows]
        assert top_slots_layers(rows, k) == want


@pytest.mark.parametrize("cls", ["H2O", "Scissorhands"])
def test_batched_per_layer_decision_equals_layer_keep(cls):
    """H2O / Scissorhands' batched per-layer decision is layer_keep on every layer."""
    g = torch.Generator().manual_seed(7)
    L, n = 4, 30
    view = make_view([n] * L, seed=7)
    rows = [torch.randint(0, 5, (n,), generator=g).float() for _ in range(L)]   # many ties
    stat = "acc" if cls == "H2O" else "low"
    view = EvictView(**{**view.__dict__, "attn": {**view.attn, stat: rows}})
    pol = {"H2O": H2O, "Scissorhands": Scissorhands}[cls](budget=12, recent=4)
    keep = pol.keep(view)
    args = (lambda r: (r, n)) if cls == "H2O" else (lambda r: (r, n, 12))
    assert keep.layers == tuple(pol.layer_keep(*args(r)) for r in rows)
    assert len(set(keep.layers)) > 1          # the layers really differ
