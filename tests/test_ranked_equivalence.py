"""Decision equivalence of the ranked eviction policies (H2O, Scissorhands, SnapKV, PyramidKV, Knorm,
SnapKVScorer, ScorerPolicy, Conf-KV) against pinned decisions (``tests/data/ranked_decisions.json``).

Each case runs the policy twice: through the decode loop on a 3-layer tiny model with sharpened
attention (every step's kept slots per layer, the evicted count, the cache's live positions per
layer afterwards, the chosen token), and on synthetic views (ragged and uniform layers, many ties,
a 28-layer view for the layer-mean ranking, keys and values for the scorers). The pinned file was
written before the policies moved onto :class:`kvlab.eviction.ranked.RankedEviction`; a refactor
must reproduce it exactly. Re-pin only for an intended change of decisions:
``python tests/test_ranked_equivalence.py --record``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_tiny_lm  # noqa: E402
from kvlab.decode import DecodeConfig, Decoding, Sampling  # noqa: E402
from kvlab.eviction import (H2O, ConfKV, EvictView, KeyNorm, Knorm, PyramidKV, Scissorhands, ScorerPolicy,  # noqa: E402
                            SnapKV, SnapKVScorer)

DATA = Path(__file__).parent / "data" / "ranked_decisions.json"
PROMPT = "the quick brown fox jumps over the lazy dog " * 2
CONFIDENT = SimpleNamespace(entropy_bits=0.05, top1_prob=0.99, margin=0.985)
UNSURE = SimpleNamespace(entropy_bits=6.0, top1_prob=0.2, margin=0.01)

CASES = {
    "h2o": lambda: H2O(20, 4),
    "h2o_sinks": lambda: H2O(20, 4, sinks=2),
    "h2o_mean": lambda: H2O(20, 4, per_layer=False),
    "h2o_mean_sinks": lambda: H2O(20, 4, per_layer=False, sinks=3),
    "scissorhands": lambda: Scissorhands(20, 4),
    "scissorhands_sinks": lambda: Scissorhands(18, 3, sinks=2),
    "scissorhands_mean": lambda: Scissorhands(20, 4, per_layer=False),
    "scissorhands_mean_sinks": lambda: Scissorhands(20, 4, per_layer=False, sinks=1),
    "snapkv": lambda: SnapKV(budget=12, window=2, kernel=3),
    "snapkv_wide": lambda: SnapKV(budget=24, window=6, kernel=5),
    "snapkv_mean": lambda: SnapKV(budget=12, window=2, kernel=3, per_layer=False),
    "pyramidkv": lambda: PyramidKV(budget=16, window=2, kernel=3, beta=2),
    "pyramidkv_flat": lambda: PyramidKV(budget=40, window=4, kernel=5),
    "confkv": lambda: ConfKV(gamma=0.0, tight=20, loose=30, protect=4),
    "confkv_gated": lambda: ConfKV(gamma=0.0505, tight=16, loose=28, protect=3, sinks=2),
    "confkv_mean": lambda: ConfKV(gamma=0.0, tight=20, loose=30, protect=4, per_layer=False, sinks=2),
    "confkv_recency": lambda: ConfKV(gamma=0.0, tight=20, loose=30, protect=4, attn_weight=0.0),
    "confkv_recency_mean": lambda: ConfKV(gamma=0.0, tight=20, loose=30, protect=4, attn_weight=0.0, per_layer=False),
    "confkv_pyramid_int8": lambda: ConfKV(gamma=0.0505, tight=20, loose=30, protect=4, pyramidal=True, int8_window=6,
                                          int8_group=8, attn_weight=1.0),
    "confkv_pyramid_int8_paper": lambda: ConfKV(gamma=0.0, tight=24, loose=32, protect=4, pyramidal=True,
                                                pyramid_ratio=0.4, int8_window=8, sinks=1, ema_prefill="sum"),
    "confkv_drawn": lambda: ConfKV(gamma=0.056, tight=16, loose=28, protect=3, confidence_from="drawn"),
    "knorm": lambda: Knorm(budget=16),
    "knorm_every_step": lambda: Knorm(budget=16, sinks=2, protect=3, every_step=True),
    "snapkv_scorer": lambda: SnapKVScorer(budget=12, window=2, kernel=3),
    "snapkv_scorer_every_step": lambda: SnapKVScorer(budget=14, window=3, kernel=3, sinks=1, every_step=True),
    "scorer_policy": lambda: ScorerPolicy(KeyNorm(), budget=14, sinks=1, protect=2, every_step=True),
}
SAMPLED = {"confkv_drawn"}     # decoded with temperature sampling (the drawn distribution differs from the raw)
# the gammas sit inside the tiny model's confidences (about 0.05), so the budget switches between tight and loose


class Recording:
    """Wraps a policy and records each decision it returns (test only)."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def keep(self, view):
        k = self.inner.keep(view)
        self.log.append(k)
        return k


def decision(k) -> dict:
    same = k.layers is not None and tuple(k.slots) == tuple(k.layers[0])
    return {"slots": "layers[0]" if same else list(k.slots),
            "layers": None if k.layers is None else [list(x) for x in k.layers],
            "budget": k.budget, "confidence": k.confidence, "int8_window": k.int8_window, "int8_group": k.int8_group,
            "rerotate": k.rerotate}


def sharp_model():
    """A 3-layer tiny model with q and k scaled by 8: each layer attends by content, so the layers rank apart."""
    with torch.random.fork_rng():
        lm = make_tiny_lm(seed=5, layers=3)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    return lm


def decode_trace(lm, name: str) -> list[dict]:
    pol = Recording(CASES[name]())
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=3) if name in SAMPLED else Sampling()
    d = Decoding(lm, None, PROMPT, DecodeConfig(mode="teacher", chat=False, max_new_tokens=14, evict=pol,
                                                sampling=sampling))
    out = []
    for rec in d:
        d.cache.check()
        out.append({"token": int(rec.token_id), "evicted": int(rec.evicted), "cache_len": int(rec.cache_len),
                    "live": [list(p) for p in d.cache.layer_positions()]})
    assert len(pol.log) == len(out)
    for o, k in zip(out, pol.log):
        o["keep"] = decision(k)
    return out


def synthetic_views(uniform_only: bool) -> list[EvictView]:
    """Views with ragged or uniform layers, tie-heavy and continuous statistics, 3 and 28 layers."""
    views = []
    g = torch.Generator().manual_seed(11)
    shapes = [(3, (40, 40, 40)), (28, (64,) * 28), (3, (9, 9, 9))]
    if not uniform_only:
        shapes += [(3, (40, 10, 50)), (4, (31, 33, 31, 45))]
    for i, (L, lengths) in enumerate(shapes):
        uniform = len(set(lengths)) == 1
        for ties in (False, True):
            if uniform and i % 2 == 0:
                lp = (tuple(range(lengths[0])),) * L
            elif uniform:
                lp = (tuple(sorted(torch.randperm(400, generator=g)[:lengths[0]].tolist())),) * L
            else:
                lp = tuple(tuple(sorted(torch.randperm(400, generator=g)[:n].tolist())) for n in lengths)
            lp = tuple((0, 1) + p[2:] if j % 2 == 0 else p for j, p in enumerate(lp)) if not uniform else lp

            def stat(n):
                return (torch.randint(0, 4, (n,), generator=g).float() if ties
                        else torch.rand(n, generator=g, dtype=torch.float64).float() * 5)
            attn = {name: [stat(n) for n in lengths] for name in ("acc", "ema", "low", "count")}
            kv = {l: (torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g))
                  for l, n in enumerate(lengths)}
            for record in (CONFIDENT, UNSURE):
                views.append(EvictView(step=1 + len(views) % 3, length=lengths[0], positions=lp[0], record=record,
                                       vocab_size=1000, num_layers=L, attn=attn, first=len(views) % 3 != 2,
                                       layer_positions=lp, kv=kv.__getitem__))
    return views


def view_decisions(name: str) -> list:
    pol = CASES[name]()
    out = []
    for v in synthetic_views(uniform_only=not getattr(pol, "per_layer", True)):
        try:
            out.append(decision(pol.keep(v)))
        except ValueError as e:                              # e.g. a budget below the sinks on a tiny layer
            out.append({"error": str(e)})
    return out


def record_all() -> dict:
    lm = sharp_model()
    return {name: {"decode": decode_trace(lm, name), "views": view_decisions(name)} for name in CASES}


@pytest.fixture(scope="module")
def pinned():
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def sharp():
    return sharp_model()


def test_every_case_is_pinned(pinned):
    assert sorted(pinned) == sorted(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_decisions_on_synthetic_views_are_unchanged(pinned, name):
    assert view_decisions(name) == pinned[name]["views"]


def same(got, want, rel: float = 1e-5) -> bool:
    """``got`` equals the pinned ``want``: every decision (slots, counts, positions, tokens) exactly, every float (a
    step's confidence) within ``rel``: the pins were written on one CPU, and MKL's products round differently on
    another (the AMD EPYC's confidence differs in the 8th digit; the decisions do not)."""
    if isinstance(want, float) and isinstance(got, float):
        return got == pytest.approx(want, rel=rel, abs=1e-12)
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k], rel) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(same(g, w, rel) for g, w in zip(got, want))
    return got == want


def test_same_compares_decisions_exactly_and_floats_within_rounding():
    assert same({"slots": [1, 2], "confidence": 0.0496221665813193}, {"slots": [1, 2], "confidence": 0.04962212325318414})
    assert not same({"slots": [1, 3], "confidence": 0.5}, {"slots": [1, 2], "confidence": 0.5})
    assert not same({"confidence": 0.51}, {"confidence": 0.5}) and not same({"a": 1}, {"a": 1, "b": 2})


@pytest.mark.parametrize("name", list(CASES))
def test_decode_decisions_are_unchanged(pinned, sharp, name):
    got = decode_trace(sharp, name)
    want = pinned[name]["decode"]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert same(g, w), f"{name}: step {step} differs: {g} != {w}"
    assert any(s["evicted"] for s in got)                    # the case does evict


def test_the_docs_ranked_policy_runs(sharp):
    """docs/custom_policies.md's ranked-policy cell, executed as written: per layer, the newest entry and the
    top of that layer's EMA, ``budget`` entries each, through the decode loop."""
    import re

    from kvlab.eviction import EVICTION_POLICIES

    doc = (Path(__file__).resolve().parent.parent / "docs" / "custom_policies.md").read_text()
    cell = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class TovaRanked" in b]
    assert len(cell) == 1
    ns = {}
    exec(cell[0], ns)
    try:
        pol = EVICTION_POLICIES.entry("tova_ranked").at_budget(10)
        d = Decoding(sharp, None, PROMPT, DecodeConfig(mode="teacher", chat=False, max_new_tokens=4, evict=pol))
        for _ in d:
            d.cache.check()
        assert d.cache.layer_lengths() == [10] * 3 and len(set(d.cache.layer_positions())) > 1
    finally:
        EVICTION_POLICIES.unregister("tova_ranked")


if __name__ == "__main__" and "--record" in sys.argv:
    DATA.parent.mkdir(exist_ok=True)
    DATA.write_text(json.dumps(record_all(), separators=(",", ":")) + "\n")
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes)")
