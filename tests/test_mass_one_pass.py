"""Attention statistics measured in one pass (the ``"kvlab"`` attention function hands its probabilities to a
``MassSink``, :mod:`kvlab.cache.mass`) equal the old path's (a forward under ``QueryCapture`` hooks, then a second
Q·Kᵀ pass over the cached keys) within fp32 tolerance: acc, ema, count, low and the observation window, over a
prefill and several decode steps (an eviction between them), for a single cache and for batched rows."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_lm
from kvlab.cache import KVCache
from kvlab.cache.attention import QueryCapture
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.forward import _record
from kvlab.core.compat import cache_kwarg

SETTINGS = [dict(window=None, below=False, ema_prefill="query"), dict(window=3, below=True, ema_prefill="query"),
            dict(window=None, below=True, ema_prefill="sum")]


def old_forward(cache: KVCache, model, ids: list[int], step: int) -> torch.Tensor:
    """KVCache.forward(attention=True) as it ran before the one-pass sink: hooks, then QueryCapture.mass."""
    n = len(ids)
    positions = list(range(cache.next_position, cache.next_position + n))
    store, st = cache._store, cache._stats
    before = [len(x) for x in cache._mirror.lives]
    with torch.inference_mode():
        with QueryCapture(model) as cap:
            out = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]),
                        **{cache_kwarg(model): store.hf}, use_cache=True, logits_to_keep=1)
        mass = cap.mass(lambda i: store.hf.layers[i].keys, n, window=st.window, below=st.below, decay=st.query_decay)
        _record(cache, ids, positions, "t", step, mass, cap.low, before, cap.ema_mass)
    cache.next_position = positions[-1] + 1
    return out.logits[0, -1]


def assert_stats_close(new: KVCache, old: KVCache) -> None:
    a, b = new.layer_attn(), old.layer_attn()
    assert set(a) == set(b)
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert x.shape == y.shape
            if name == "low":
                assert int((x != y).sum()) <= 1, name            # a count: equal unless a share sits on 1/T_i
            else:
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=name)


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 120, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("settings", SETTINGS)
def test_single_cache_one_pass_equals_the_capture(settings):
    lm = make_tiny_lm(seed=4, layers=3, num_kv_heads=2)
    model = lm.model
    new, old = KVCache(), KVCache()
    for c in (new, old):
        c.track_attention(0.8, **settings)
    prompt, cont = _tokens(0, 12), _tokens(1, 6)
    ln = new.forward(model, prompt, writer="t", attention=True)
    lo = old_forward(old, model, prompt, -1)
    torch.testing.assert_close(ln, lo, rtol=1e-4, atol=1e-4)
    assert_stats_close(new, old)
    for step, tok in enumerate(cont, start=1):
        if step == 3:                                        # per-layer eviction: ragged layers
            for c in (new, old):
                c.evict([], layers=[[1, 4], [2], [0, 5, 6]])
        ln = new.forward(model, [tok], writer="t", step=step, attention=True)
        lo = old_forward(old, model, [tok], step)
        torch.testing.assert_close(ln, lo, rtol=1e-4, atol=1e-4)
        assert_stats_close(new, old)
        new.check()


@pytest.mark.parametrize("settings", SETTINGS[:2])
def test_batched_rows_one_pass_equal_the_capture(settings):
    lm = make_tiny_lm(seed=5, layers=2, num_kv_heads=1)
    model = lm.model
    B = 3
    bank = Bank.for_model(model, B, capacity=64)
    rows = [bank.row_cache(b) for b in range(B)]
    refs = [KVCache() for _ in range(B)]
    for c in rows + refs:
        c.track_attention(0.9, **settings)
    prompts = [_tokens(10 + b, 9) for b in range(B)]
    forward_rows(bank, model, rows, prompts, writer="t", steps=[-1] * B, attention=[True] * B)
    for b in range(B):
        old_forward(refs[b], model, prompts[b], -1)
        assert_stats_close(rows[b], refs[b])
    conts = [_tokens(20 + b, 5) for b in range(B)]
    for step in range(5):
        if step == 2:                                        # rows evict differently (row 1 from the front)
            for c, r in ((rows[0], refs[0]), (rows[1], refs[1])):
                for x in (c, r):
                    x.evict([0, 1, 2] if x in (rows[1], refs[1]) else [5])
        forward_rows(bank, model, rows, [conts[b][step] for b in range(B)], writer="t", steps=[step] * B,
                     attention=[True] * B)
        for b in range(B):
            old_forward(refs[b], model, [conts[b][step]], step)
            assert_stats_close(rows[b], refs[b])
            rows[b].check()


def test_in_place_softmax_equals_torch_softmax():
    """``mass.softmax_`` (a prefill's scores normalized in their own storage) is ``torch.softmax`` over the last dim,
    masked (-inf) entries included, within fp32 rounding; it returns the tensor it was given."""
    from kvlab.cache.mass import softmax_

    g = torch.Generator().manual_seed(0)
    s = torch.randn(2, 3, 5, 17, generator=g) * 8
    s[..., 10:] = float("-inf")                                   # causal-style masked tail
    want = torch.softmax(s, dim=-1)
    x = s.clone()
    got = softmax_(x)
    assert got is x
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert bool((got[..., 10:] == 0).all())
