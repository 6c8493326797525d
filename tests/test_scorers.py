"""kvpress-style scorers as kvlab eviction policies (kvlab/eviction/scorer.py, scorers.py), on tiny models.

What is checked, and how exactly:
* the shape contract: a scorer must return ``(B, H_kv, T)``; anything else is a ValueError naming the scorer;
* ``Knorm`` keeps, per layer, the entries with the smallest head-mean key L2 norm, recomputed here from
  the cache's own K: the sinks and the protected window are kept, and no kept candidate has a norm above
  a dropped one's by more than ``TIE = 1e-6`` (the same token at two positions has the same key norm, RoPE
  being a rotation, so exact ties are common and either may stay);
* ``SnapKVScorer`` / ``ScorerPolicy(SnapKVWindow)`` keep EXACTLY the positions kvlab's ``SnapKV``
  keeps, per layer, on the same prefilled cache, under these conditions: the same ``budget``,
  ``window`` and ``kernel``; ``SnapKV(per_layer=True)`` (its default); the wrapper with ``sinks=0``,
  ``protect=0``, ``every_step=False``; both read the same statistic (``attn["acc"]`` measured over
  the last ``window`` prompt queries). No tolerance is needed: the scores are computed by the same
  pool on the same tensor, the window's padded max score wins its ties (ties go to the newer entry),
  and the head mean of a head-constant score is exact (float64);
* the wrapped policies run through ``kvlab.decode.run`` and every layer stays within the budget;
* a batch equals single runs (discrete fields exactly, log-probs and K/V within 1e-4, the tolerance of
  tests/test_batch_decode.py, whose helpers are reused), for scores without structural ties; Knorm on
  prompts of distinct tokens (repeated tokens tie in layer-0 key norm, and the batch's rounding may
  break such a tie the other way).
"""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_lm  # noqa: F401  (the fixtures come from conftest)
from kvlab.cache import KVCache
from kvlab.cache.attention import attention_modules
from kvlab.decode import DecodeConfig, Decoding, run
from kvlab.eviction import (EVICTION_POLICIES, EvictView, KeyNorm, Knorm, ScorerPolicy, SnapKV, SnapKVScorer,
                            SnapKVWindow)
from kvlab.refresh.base import policy_dict
from test_batch_decode import DISTINCT, PROMPTS, assert_rows_equal, batch_and_singles, cfg

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words " * 2
# Knorm's tolerance: a token's key has the same norm at every position (RoPE rotates it), so repeated tokens
# tie up to float32 rounding of the norm (~1e-8 here); the policy ranks float32 norms, the test float64 ones.
TIE = 1e-6


def prefill_view(lm, prompt=PROMPT, window=None):
    """A cache holding the prompt (attention measured over its last ``window`` queries) and the view the
    decode loop builds at the first step."""
    ids = lm.encode_prompt(prompt, chat=False)
    cache = KVCache()
    if window is not None:
        cache.track_attention(window=window)
    cache.forward(lm.model, ids, writer="teacher", attention=window is not None)
    lp = cache.layer_positions()
    view = EvictView(step=1, length=len(cache), positions=lp[0], record=None, vocab_size=1, num_layers=cache.num_layers,
                     attn=cache.layer_attn(), first=True, layer_positions=lp, kv=cache.kv,
                     modules=tuple(attention_modules(lm.model)))
    return cache, view


# --------------------------------------------------------------------------- the contract


class WrongShape:
    def __init__(self, cut):
        self.cut = cut

    def score(self, module, hidden_states, keys, values, attentions, kwargs):
        return -keys.norm(dim=-1)[self.cut]


@pytest.mark.parametrize("cut", [(0,), (slice(None), slice(None), slice(1, None)), (slice(None), 0)])
def test_wrong_score_shape_names_the_scorer(tiny_teacher, cut):
    """(H_kv, T), (B, H_kv, T-1), (B, T): each refused with the scorer's name and the expected shape."""
    with pytest.raises(ValueError, match=r"scorer WrongShape returned .* for layer 0; a scorer returns \(B, H_kv, T\)"):
        run(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=2, chat=False,
                                                     evict=ScorerPolicy(WrongShape(cut), budget=8)))


def test_a_scorer_gets_the_layer_its_module_and_its_cache(tiny_teacher):
    """kvpress's arguments: the layer's attention module, (1, H_kv, T, D) keys/values equal to the cache's."""
    cache, view = prefill_view(tiny_teacher)
    seen = []

    def spy(module, hidden_states, keys, values, attentions, kwargs):
        seen.append((module, hidden_states, keys, values, attentions, dict(kwargs)))
        return torch.zeros(keys.shape[:3])

    ScorerPolicy(spy, budget=8).keep(view)
    assert len(seen) == cache.num_layers
    for l, (module, hs, k, v, attn, kw) in enumerate(seen):
        assert module.layer_idx == l and hs is None and attn is None and kw["layer"] == l and kw["first"]
        ck, cv = cache.kv(l)
        assert k.shape == (1, tiny_teacher.model.config.num_key_value_heads, len(cache), module.head_dim)
        assert torch.equal(k, ck) and torch.equal(v, cv)
        assert kw["positions"].tolist() == list(cache.layer_positions()[l])


@pytest.mark.parametrize("make, name", [
    (lambda: ScorerPolicy(object(), budget=8), "scorer"),
    (lambda: ScorerPolicy(KeyNorm(), budget=0), "budget"),
    (lambda: ScorerPolicy(KeyNorm(), budget=8, protect=-1), "protect"),
    (lambda: ScorerPolicy(KeyNorm(), budget=8, sinks=4, protect=4), "sinks"),
    (lambda: ScorerPolicy(KeyNorm(), budget=8, every_step=1), "every_step"),
    (lambda: SnapKVScorer(budget=8, window=8), "window"),
    (lambda: SnapKVScorer(budget=20, window=4, kernel=4), "kernel"),
])
def test_bad_parameters_name_the_parameter(make, name):
    with pytest.raises(ValueError, match=name):
        make()


# --------------------------------------------------------------------------- knorm


@pytest.mark.parametrize("budget, sinks, protect", [(8, 0, 0), (12, 2, 3), (5, 1, 0)])
def test_knorm_keeps_the_lowest_norm_keys(tiny_teacher, budget, sinks, protect):
    cache, view = prefill_view(tiny_teacher)
    n = len(cache)
    keep = Knorm(budget, sinks=sinks, protect=protect).keep(view)
    assert keep.layers is not None and len(keep.layers) == cache.num_layers
    for l, kept in enumerate(keep.layers):
        k = cache.kv(l)[0][0].double()                                    # (H_kv, T, D)
        norm = k.norm(dim=-1).mean(0)                                     # (T,) head-mean key norm
        cand = set(range(sinks, n - protect))
        assert set(range(sinks)) | set(range(n - protect, n)) <= set(kept), f"layer {l}: sinks / protected window"
        chosen = cand & set(kept)
        assert len(kept) == budget and len(chosen) == budget - sinks - protect
        worst_kept = max(float(norm[j]) for j in chosen)
        best_dropped = min(float(norm[j]) for j in cand - chosen)
        assert worst_kept <= best_dropped + TIE, f"layer {l}: kept a norm {worst_kept} above a dropped {best_dropped}"
    # and the ranking is not vacuous: the kept candidates' norms are well below the dropped ones' on average
    k = cache.kv(0)[0][0].double().norm(dim=-1).mean(0)
    chosen = sorted(set(keep.layers[0]) & set(range(sinks, n - protect)))
    dropped = sorted(set(range(sinks, n - protect)) - set(chosen))
    assert float(k[chosen].mean()) < float(k[dropped].mean())


def test_knorm_equals_scorer_policy_of_keynorm_and_a_function(tiny_teacher):
    """The registered policy, the wrapper with the scorer object, and the wrapper with a bare function agree."""
    _, view = prefill_view(tiny_teacher)

    def knorm(module, hidden_states, keys, values, attentions, kwargs):
        return -keys.norm(dim=-1)

    a = Knorm(9, sinks=1).keep(view).layers
    assert a == ScorerPolicy(KeyNorm(), 9, sinks=1).keep(view).layers == ScorerPolicy(knorm, 9, sinks=1).keep(view).layers


# --------------------------------------------------------------------------- SnapKV


@pytest.mark.parametrize("prompt", [PROMPT, "a b c d e f g h i j k l m n o p q r s t u v w x y z"])
@pytest.mark.parametrize("budget, window, kernel", [(8, 3, 5), (12, 4, 3), (20, 16, 5), (6, 1, 1)])
def test_snapkv_scorer_keeps_what_snapkv_keeps(tiny_teacher, prompt, budget, window, kernel):
    cache, view = prefill_view(tiny_teacher, prompt, window=window)
    assert len(cache) > budget
    ref = SnapKV(budget=budget, window=window, kernel=kernel).keep(view)
    for pol in (SnapKVScorer(budget, window=window, kernel=kernel),
                ScorerPolicy(SnapKVWindow(window, kernel), budget)):
        got = pol.keep(view)
        assert got.layers == ref.layers, type(pol).__name__
    assert all(tuple(range(len(cache) - window, len(cache))) == k[-window:] for k in ref.layers)   # the window stays


def test_snapkv_scorer_decodes_like_snapkv(tiny_teacher):
    """Through the decode loop: the same tokens, evictions and live positions per layer."""
    runs = []
    for ev in (SnapKV(budget=10, window=3), SnapKVScorer(budget=10, window=3)):
        d = Decoding(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=8, chat=False, evict=ev))
        recs = list(d)
        runs.append(([r.token_id for r in recs], [r.evicted for r in recs], d.cache.layer_positions()))
    assert runs[0] == runs[1]
    assert runs[0][1][0] > 0


# --------------------------------------------------------------------------- the decode loop


@pytest.mark.parametrize("policy", [Knorm(10, sinks=2, protect=2, every_step=True),
                                    SnapKVScorer(12, window=4, every_step=True),
                                    ScorerPolicy(KeyNorm(), 7, protect=1, every_step=True)], ids=repr)
def test_every_step_keeps_every_layer_within_budget(tiny_teacher, policy):
    d = Decoding(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=10, chat=False, evict=policy))
    recs = list(d)
    assert all(r.cache_len == policy.budget for r in recs)
    assert all(r.evicted >= 1 for r in recs)
    assert all(n == policy.budget for n in d.cache.layer_lengths())
    d.cache.check()
    if policy.sinks:
        assert all(p[: policy.sinks] == tuple(range(policy.sinks)) for p in d.cache.layer_positions())


def test_prefill_only_cuts_once(tiny_teacher):
    tr = run(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=6, chat=False, evict=Knorm(8)))
    assert [r.cache_len for r in tr.records] == list(range(8, 14))
    assert tr.records[0].evicted > 0 and all(r.evicted == 0 for r in tr.records[1:])


def value_norm(module, hidden_states, keys, values, attentions, kwargs):
    return values.norm(dim=-1)                                           # (B, H_kv, T): no structural ties


def test_scorers_batched_equal_single(tiny_teacher, tiny_student):
    """Each row decides on its own cache, every step. Knorm compresses distinct-token prompts once (its
    layer-0 norms tie for repeated tokens; see DISTINCT in tests/test_batch_decode.py)."""
    configs = [cfg(evict=SnapKVScorer(8, 3, every_step=True)), cfg(mode="overfill", evict=SnapKVScorer(8, 3)),
               cfg(evict=ScorerPolicy(value_norm, 6, sinks=1, protect=2, every_step=True)),
               cfg(mode="overfill", evict=ScorerPolicy(value_norm, 9, every_step=True))]
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, PROMPTS, configs)
    assert_rows_equal(bd, recs, singles)
    assert all(r.evicted for b in (0, 2, 3) for r in recs[b])       # every_step, prompts longer than the budget
    assert not any(r.evicted for r in recs[1])                         # "sky": 3 entries, below the budget
    configs = [cfg(evict=Knorm(6, sinks=1)), cfg(mode="overfill", evict=Knorm(8, protect=2)), cfg(evict=Knorm(5)), cfg()]
    bd, recs, singles = batch_and_singles(tiny_teacher, tiny_student, DISTINCT, configs)
    assert_rows_equal(bd, recs, singles)
    assert all(rr[0].evicted for rr in recs[:3])


# --------------------------------------------------------------------------- registry and run keys


def test_registered_by_name_and_built_at_a_budget():
    from kvlab.playground.settings import budget_policy

    assert EVICTION_POLICIES["knorm"] is Knorm and EVICTION_POLICIES["snapkv_scorer"] is SnapKVScorer
    assert EVICTION_POLICIES.entry("knorm").at_budget(12) == Knorm(12)
    assert EVICTION_POLICIES.entry("snapkv_scorer").knob_range()[0] == 17       # budget > window = 16
    assert budget_policy("knorm", Knorm, 20) == Knorm(20)


def test_run_keys_name_the_scorer():
    def mine(module, hidden_states, keys, values, attentions, kwargs):
        return keys.norm(dim=-1)

    def mine2(module, hidden_states, keys, values, attentions, kwargs):
        return -keys.norm(dim=-1)

    d = [policy_dict(ScorerPolicy(s, 8)) for s in (KeyNorm(), SnapKVWindow(), SnapKVWindow(4), mine, mine2)]
    assert d[0]["scorer"] == {"policy": "KeyNorm"} and d[1]["scorer"]["window"] == 16
    assert len({repr(x) for x in d}) == len(d)
    assert d[3]["scorer"]["code"] != d[4]["scorer"]["code"]


def test_the_docs_scorer_registers_and_runs(tiny_teacher):
    """docs/custom_policies.md's kvpress-scorer cell, executed as written: the name builds at a budget and runs."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "custom_policies.md").read_text()
    cell = [b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class ValueNorm" in b]
    assert len(cell) == 1
    ns = {}
    exec(cell[0], ns)
    try:
        pol = EVICTION_POLICIES.entry("vnorm").at_budget(7)
        assert type(pol.scorer).__name__ == "ValueNorm" and pol.budget == 7
        tr = run(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=3, chat=False, evict=pol))
        assert tr.records[0].cache_len == 7 and tr.records[0].evicted == len(tiny_teacher.encode_prompt(PROMPT, chat=False)) - 7
        assert policy_dict(pol)["scorer"]["code"]                          # defined outside kvlab: its code keys runs
    finally:
        EVICTION_POLICIES.unregister("vnorm")
