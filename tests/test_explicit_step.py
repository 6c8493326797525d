"""The explicit batched step (``kvlab.cache.step``) computes the model's own forward: logits, cached keys and values
and attention statistics equal what ``LlamaForCausalLM.forward`` gives within float rounding, through every kind of
row a batched step runs (measured, deferred, plain, a padded prefill). ``PackedLinear`` equals ``F.linear``. Models
it cannot compute exactly fall back to their own forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_tiny_lm
from kvlab.cache import KVCache
from kvlab.cache import attn_fn
from kvlab.cache import batch as batch_mod
from kvlab.cache import step as S
from kvlab.cache.batch import Bank, forward_rows
from kvlab.core.compat import cache_kwarg
from kvlab.core import packed as P
from kvlab.core.packed import PACK_ROWS, PACKS, PackedLinear, can_pack

TOL = 1e-5


def test_packed_linear_equals_linear_at_any_row_count():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 40, generator=g)
    lin = PackedLinear(w)
    for m in (8, 3, 8, 1, 5, 8):
        x = torch.randn(m, 40, generator=g)
        torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert lin(torch.randn(4, 2, 40, generator=g)).shape == (4, 2, 96)
    if can_pack(w):                                            # MKL here: the newest row counts are packed
        assert lin.pack and list(lin.packs)[-1] == 8 and len(lin.packs) == PACKS
    else:
        assert not lin.packs
    before = dict(lin.packs)
    x = torch.randn(PACK_ROWS + 1, 40, generator=g)                # a prefill's rows: the plain product, no pack
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert lin.packs.keys() == before.keys()
    assert not PackedLinear(w.to(torch.bfloat16)).pack         # bf16 runs F.linear


def test_each_packing_library_equals_linear(monkeypatch):
    """MKL's and oneDNN's packed products (each where this torch has it) equal F.linear; a pack made by one library is
    not used by the other; the timed choice is one of them."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(72, 48, generator=g)
    lin = PackedLinear(w)
    for lib in P.BACKENDS:
        if not P._available(lib):
            continue
        monkeypatch.setattr(P, "BACKEND", lib)
        for m in (8, 2):
            x = torch.randn(m, 48, generator=g)
            torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
        assert {k: v[0] for k, v in lin.packs.items()} == {2: lib}
    monkeypatch.setattr(P, "BACKEND", None)                    # the default: MKL wherever torch has it
    assert P.backend() == next((b for b in P.BACKENDS if P._available(b)), None)
    monkeypatch.setattr(P, "BACKEND", "auto")                  # timed once per process
    assert P.backend() in (*P.BACKENDS, None)


def test_a_bad_packing_library_is_named():
    P_bad = "blas"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "BACKEND", P_bad)
        with pytest.raises(ValueError, match=r"kvlab.core.packed.BACKEND='blas' must be one of \('mkl', 'onednn'\), 'auto'"):
            PackedLinear(torch.randn(8, 4))(torch.randn(2, 4))


def test_packed_linear_names_a_bad_weight():
    with pytest.raises(ValueError, match="weight must be"):
        PackedLinear(torch.randn(7))


@torch.inference_mode()
def test_explicit_equals_the_models_forward_prefill_and_step():
    lm = make_tiny_lm(seed=3)
    model = lm.model.eval()
    attn_fn.use(model)
    step = S.explicit_step(model)
    assert step is not None and S.unsupported(model) is None
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (3, 6), generator=g)                                 # (B, n)
    pos = torch.arange(6).repeat(3, 1) + torch.tensor([[0], [4], [9]])               # rows at other positions
    c_ref, c_exp = DynamicCache(config=model.config), DynamicCache(config=model.config)
    ref = model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=0, **{cache_kwarg(model): c_ref}).logits
    got = step(ids, pos, c_exp, 0)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    nxt = torch.randint(3, 120, (3, 1), generator=g)
    ref = model(input_ids=nxt, position_ids=pos[:, -1:] + 1, use_cache=True, logits_to_keep=1,
                **{cache_kwarg(model): c_ref}).logits
    got = step(nxt, pos[:, -1:] + 1, c_exp, 1)
    torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
    for a, b in zip(c_ref.layers, c_exp.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=TOL, atol=TOL)
        torch.testing.assert_close(a.values, b.values, rtol=TOL, atol=TOL)


def _bank_run(lm, explicit: bool, monkeypatch):
    """A bank of 3 rows from one tracked prefill; a padded batched prefill of different lengths, then 12 steps:
    row 0 measured at every step, row 1 deferred, row 2 plain. Returns logits per forward, K/V and statistics."""
    if not explicit:
        monkeypatch.setattr(batch_mod, "explicit_step", lambda model: None)
    calls = []
    real = S.LlamaStep.__call__
    monkeypatch.setattr(S.LlamaStep, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    model = lm.model
    base = KVCache()
    base.track_attention(ema_decay=0.9, below=True)
    g = torch.Generator().manual_seed(1)
    base.forward(model, torch.randint(3, 120, (10,), generator=g).tolist(), writer="teacher", attention=True)
    bank = Bank.for_model(model, 3, capacity=64)
    caches = [bank.adopt(b, base) for b in range(3)]
    out = [forward_rows(bank, model, caches, [[5, 6, 7], [8], [9, 10]], writer="teacher", steps=[0] * 3)]
    for j in range(12):
        t = int(torch.randint(3, 120, (1,), generator=g))
        out.append(forward_rows(bank, model, caches, [t] * 3, writer="teacher", steps=[j + 1] * 3,
                                attention=[True, False, False], defer=[False, True, False]))
    stats = [c.layer_attn() for c in caches[:2]]
    kv = [[c.kv(i) for i in range(c.num_layers)] for c in caches]
    assert len(calls) == (13 if explicit else 0)
    return out, kv, stats


def test_forward_rows_explicit_equals_the_models_forward(monkeypatch):
    lm = make_tiny_lm(seed=4)
    with monkeypatch.context() as mp:
        ref = _bank_run(lm, False, mp)
    with monkeypatch.context() as mp:
        got = _bank_run(lm, True, mp)
    for a, b in zip(ref[0], got[0]):
        torch.testing.assert_close(b, a, rtol=TOL, atol=TOL)
    for rows_a, rows_b in zip(ref[1], got[1]):
        for (ka, va), (kb, vb) in zip(rows_a, rows_b):
            torch.testing.assert_close(kb, ka, rtol=TOL, atol=TOL)
            torch.testing.assert_close(vb, va, rtol=TOL, atol=TOL)
    for sa, sb in zip(ref[2], got[2]):
        assert sa.keys() == sb.keys()
        for name in sa:
            for u, v in zip(sa[name], sb[name]):
                torch.testing.assert_close(v, u, rtol=1e-4, atol=1e-5)


def test_weights_edited_in_place_rebuild_the_step():
    lm = make_tiny_lm(seed=5)
    model = lm.model.eval()
    first = S.explicit_step(model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    second = S.explicit_step(model)
    assert second is not first and S.explicit_step(model) is second
    assert torch.equal(second.layers[1].down.weight, model.model.layers[1].mlp.down_proj.weight)
    model.train()
    assert S.explicit_step(model) is None and "training" in S.unsupported(model)
    model.eval()


def test_models_it_cannot_compute_fall_back():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    small = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=128)
    qwen = Qwen3ForCausalLM(Qwen3Config(**small)).eval()                           # q_norm / k_norm
    assert S.explicit_step(qwen) is None and "layer 0" in S.unsupported(qwen)
    biased = LlamaForCausalLM(LlamaConfig(attention_bias=True, **small)).eval()
    assert S.explicit_step(biased) is None and "biased" in S.unsupported(biased)
    gelu = LlamaForCausalLM(LlamaConfig(hidden_act="gelu", **small)).eval()
    assert "SiLU" in S.unsupported(gelu)


@pytest.mark.integration
@torch.inference_mode()
def test_real_teacher_explicit_step_equals_its_forward(real_pair):
    model = real_pair[0].model
    attn_fn.use(model)
    step = S.explicit_step(model)
    assert step is not None
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 40000, (8, 24), generator=g)
    pos = torch.arange(24).repeat(8, 1)
    c_ref, c_exp = DynamicCache(config=model.config), DynamicCache(config=model.config)
    model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): c_ref})
    step(ids, pos, c_exp, 1)
    nxt = torch.randint(3, 40000, (8, 1), generator=g)
    ref = model(input_ids=nxt, position_ids=pos[:, -1:] + 1, use_cache=True, logits_to_keep=1,
                **{cache_kwarg(model): c_ref}).logits
    got = step(nxt, pos[:, -1:] + 1, c_exp, 1)                                     # batch 8: the packed products
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= 1e-4 * scale
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_deferral_is_chosen_per_device_type(monkeypatch):
    from kvlab.cache import deferred
    assert deferred.defers("cuda") is True and deferred.defers(torch.device("cpu")) is True
    monkeypatch.setitem(deferred.DEFERS, "cpu", False)          # the A/B's other arm
    assert deferred.defers("cpu") is False and deferred.defers("cuda") is True


def test_a_hooked_model_runs_its_own_forward():
    """Hooks (the loop's layer-input capture for kvpress's presses, a user's) see only the model's own forward."""
    lm = make_tiny_lm(seed=6)
    model = lm.model.eval()
    assert S.explicit_step(model) is not None
    seen = []
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(lambda mod, args: seen.append(1))
    try:
        assert S.explicit_step(model) is None
        base = KVCache()
        base.forward(model, [5, 6, 7], writer="teacher")
        bank = Bank.for_model(model, 2, capacity=16)
        caches = [bank.adopt(b, base) for b in range(2)]
        seen.clear()
        forward_rows(bank, model, caches, [8, 9], writer="teacher", steps=[0, 0])
        assert seen == [1]
    finally:
        handle.remove()
    assert S.explicit_step(model) is not None


def test_a_dropped_model_frees_its_step():
    """The step (packs: a copy of the weights) lives exactly as long as its model (studies load many models)."""
    import gc
    import weakref
    gc.collect()                                # earlier tests' dead models first: only this one dies below
    lm = make_tiny_lm(seed=7)
    model = lm.model.eval()
    ref = weakref.ref(S.explicit_step(model))
    n = len(S._STEPS)
    del lm, model
    gc.collect()
    assert ref() is None and len(S._STEPS) == n - 1
