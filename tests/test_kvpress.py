"""kvpress's presses, as they are, through kvlab (issue 38): every press kvpress exports runs on the tiny model
or is refused up front with a message naming it; batch 1 and batch 8; decode time; the positions kvlab keeps
equal kvpress's own compress on the same prefill; ≥10 presses on the embedded teacher (integration).
Skipped when kvpress is not installed (``make install`` installs it)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

kvpress = pytest.importorskip("kvpress")

import kvlab  # noqa: E402
from kvlab.core.tiny import make_tiny_lm  # noqa: E402
from kvlab.decode import run_batch  # noqa: E402
from kvlab.eviction.kvpress import installed_presses  # noqa: E402
from kvlab.eviction.press_policy import from_kvpress  # noqa: E402
from kvlab.eviction.kvpress.support import LACKS, MAPPED, PREFILL_ONLY  # noqa: E402
from kvlab.eviction.scorer import ScorerPolicy  # noqa: E402
from kvlab.refresh.base import policy_dict  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog, and then it sleeps. " * 2
DOWNLOADS = {"QFilterPress", "KVzapPress", "ExpectedAttentionStatsPress"}   # post_init_from_model downloads


def default_press(name: str):
    """kvpress's own default settings (its tests' default_presses), small windows for the tiny model."""
    cls = getattr(kvpress, name)
    if name in ("SnapKVPress", "PyramidKVPress"):
        return cls(window_size=4)
    if name == "CriticalKVPress":
        return cls(kvpress.KnormPress())
    if name in ("AdaKVPress", "CriticalAdaKVPress", "KeyRerotationPress", "ChunkPress", "BlockPress",
                "ChunkKVPress", "EntropyGatedChunkKVPress"):
        try:
            return cls(kvpress.KnormPress())
        except TypeError:
            return cls(press=kvpress.KnormPress())
    if name == "DecodingPress":
        return cls(base_press=kvpress.KnormPress(), compression_interval=2, target_size=24)
    if name == "CompressionRatioDecodingPress":
        return cls(base_press=kvpress.KnormPress())
    if name == "PrefillDecodingPress":
        return cls(prefilling_press=kvpress.KnormPress(), decoding_press=None)
    if name == "ComposedPress":
        return cls([kvpress.KnormPress(), kvpress.RandomPress()])
    if name == "PerLayerCompressionPress":
        return cls(kvpress.KnormPress(), compression_ratios=[0.5, 0.5])
    for kw in ({}, {"base_press": kvpress.KnormPress()}, {"press": kvpress.KnormPress()},
               {"presses": [kvpress.KnormPress()]}):
        try:
            return cls(**kw)
        except (TypeError, AssertionError):
            continue
    return cls()


EXPORTED = [r["press"] for r in installed_presses()]
SCORERS = [r["press"] for r in installed_presses() if r["runs"] == "scorer" and r["press"] not in DOWNLOADS]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_lm(seed=0)


def _run(lm, policy, tokens=4):
    cfg = kvlab.DecodeConfig(mode="teacher", max_new_tokens=tokens, evict=policy)
    return kvlab.run(lm, None, PROMPT, cfg)


def test_import_kvlab_imports_no_kvpress():
    code = "import sys, kvlab; kvlab.ScorerPolicy; kvlab.from_kvpress; assert 'kvpress' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_installed_kvpress_exports_presses():
    assert len(EXPORTED) >= 40 and {"KnormPress", "SnapKVPress", "TOVAPress"} <= set(SCORERS)


@pytest.mark.parametrize("name", EXPORTED)
def test_every_press_runs_or_is_refused_up_front(name, tiny):
    """Each exported press: runs (ScorerPolicy, or from_kvpress for the mapped wrappers) at batch 1, or is
    refused when the policy is built, with a ValueError naming it."""
    try:
        press = default_press(name)
    except Exception as e:                                          # noqa: BLE001
        pytest.fail(f"{name}: kvpress's own constructor failed with the bridge's default settings: {e!r}")
    kind = next(r["runs"] for r in installed_presses() if r["press"] == name)
    if kind == "refused":
        with pytest.raises(ValueError, match=name):
            ScorerPolicy(press, budget=24)
        with pytest.raises(ValueError, match=name):
            from_kvpress(press, budget=24)
        return
    if kind == "from_kvpress":
        with pytest.raises(ValueError, match=name):
            ScorerPolicy(press, budget=24)
        policy = from_kvpress(press, budget=24)
    elif name in DOWNLOADS:                                        # offline: post_init_from_model fails, named
        with pytest.raises(ValueError, match=name):
            _run(tiny, ScorerPolicy(press, budget=24))
        return
    else:
        policy = ScorerPolicy(press, budget=24, sinks=2)
    trace = _run(tiny, policy)
    assert all(r.cache_len <= 24 + 4 for r in trace.records), f"{name}: the budget was not kept"
    assert trace.records[0].evicted > 0, f"{name}: nothing was evicted"


@pytest.mark.parametrize("name", SCORERS)
def test_scorers_at_batch_8_and_decode_time(name, tiny):
    """Batch 8 (kvlab's batched decode), prefill compression; decode-time eviction (every_step) except the
    prefill-only scorers, which are refused for it up front."""
    press = default_press(name)
    traces = run_batch(tiny, None, [PROMPT[i:] for i in range(8)],
                             kvlab.DecodeConfig(mode="teacher", max_new_tokens=3,
                                                evict=ScorerPolicy(press, budget=24, sinks=2)))
    assert len(traces) == 8 and all(t.records[0].cache_len == 24 for t in traces), name
    if name in PREFILL_ONLY:
        with pytest.raises(ValueError, match=name):
            ScorerPolicy(press, budget=24, every_step=True)
        return
    pol = ScorerPolicy(press, budget=24, sinks=2, every_step=True)
    traces = run_batch(tiny, None, [PROMPT[i:] for i in range(8)],
                             kvlab.DecodeConfig(mode="teacher", max_new_tokens=4, evict=pol))
    assert all(r.cache_len == 24 for t in traces for r in t.records), name


def test_batch_rows_equal_their_single_runs(tiny):
    pol = ScorerPolicy(kvpress.SnapKVPress(window_size=4), budget=24, sinks=2, every_step=True)
    cfg = kvlab.DecodeConfig(mode="teacher", max_new_tokens=5, evict=pol)
    prompts = [PROMPT, PROMPT[3:]]
    batch = run_batch(tiny, None, prompts, cfg)
    for p, t in zip(prompts, batch):
        one = kvlab.run(tiny, None, p, cfg)
        assert [r.token_id for r in one.records] == [r.token_id for r in t.records]


def test_run_key_is_stable_json(tiny):
    for press in (kvpress.SnapKVPress(window_size=4), kvpress.ExpectedAttentionPress(),
                  kvpress.CriticalKVPress(kvpress.KnormPress())):
        pol = ScorerPolicy(press, budget=24)
        before = json.dumps(policy_dict(pol), sort_keys=True)
        _run(tiny, pol, tokens=2)
        assert json.dumps(policy_dict(pol), sort_keys=True) == before
        assert type(press).__name__ in before


def test_mapped_wrappers(tiny):
    pol = from_kvpress(kvpress.DecodingPress(kvpress.KnormPress(), compression_interval=2, target_size=20))
    assert (pol.budget, pol.every_step, pol.interval) == (20, True, 2)
    lens = [r.cache_len for r in _run(tiny, pol, tokens=6).records]
    assert max(lens[1:]) <= 21 and min(lens[1:]) == 20
    pol = from_kvpress(kvpress.KeyRerotationPress(kvpress.KnormPress()), budget=20)
    assert pol.rerotate and _run(tiny, pol).records[0].cache_len == 20
    with pytest.raises(ValueError, match="budget"):
        from_kvpress(kvpress.KnormPress())
    with pytest.raises(ValueError, match="KVzipPress"):
        from_kvpress(kvpress.KVzipPress(), budget=8)


# ------------------------------------------------------------------ kept positions vs kvpress's own compress


def _kvpress_kept(lm, press, ids, n_kept):
    """Per layer, the positions kvpress's own ``compress`` keeps on the prefill of ``ids``, fed what its
    forward hook reads (the attention module's input kwargs and the layer's cache after the forward; its
    hook itself reads kwargs["past_key_values"], which transformers 5.24 renamed, so it is called here)."""
    from kvlab.cache.attention import attention_modules
    from kvlab.studies.kvpress.heads import capture_prefill

    model = lm.model
    with torch.no_grad():
        _, cache, got = capture_prefill(model, ids[0].tolist())
    T = ids.shape[1]
    press.compression_ratio = 1 - n_kept / T
    base = model.model
    out = []
    for m in attention_modules(model):
        kw = got[m.layer_idx]
        keys, values = cache.layers[m.layer_idx].keys, cache.layers[m.layer_idx].values
        from kvlab.eviction.kvpress.call import PressModule
        mod = PressModule(m, base.rotary_emb)
        with torch.no_grad():
            k2, _ = press.compress(mod, kw["hidden_states"], keys, values, None, kw)
        assert k2.shape[2] == n_kept
        match = (k2[0, 0][:, None, :] == keys[0, 0][None, :, :]).all(-1)        # (n_kept, T)
        out.append(sorted(int(j) for j in match.float().argmax(1)))
    return out


CHECKED = {"KnormPress": lambda: kvpress.KnormPress(), "SnapKVPress": lambda: kvpress.SnapKVPress(window_size=4),
           "ExpectedAttentionPress": lambda: kvpress.ExpectedAttentionPress(), "TOVAPress": lambda: kvpress.TOVAPress(),
           "StreamingLLMPress": lambda: kvpress.StreamingLLMPress(n_sink=4)}


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_kept_positions_equal_kvpress_compress(name):
    """One KV head (so kvpress's per-head top-k is kvlab's head-mean top-k): on the same prefill, kvlab keeps
    exactly the positions kvpress's own compress keeps, on every layer."""
    lm = make_tiny_lm(seed=3, num_kv_heads=1)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    n_kept = 40
    press = CHECKED[name]()
    want = _kvpress_kept(lm, press, ids, n_kept)
    d = kvlab.Decoding(lm, None, PROMPT, kvlab.DecodeConfig(mode="teacher", max_new_tokens=1,
                                                            evict=ScorerPolicy(press, budget=n_kept)))
    list(d)
    assert [list(p) for p in d.cache.layer_positions()] == want, name


# ------------------------------------------------------------------ the embedded teacher


RUN_ON_TEACHER = ["KnormPress", "SnapKVPress", "ExpectedAttentionPress", "TOVAPress", "StreamingLLMPress",
                  "PyramidKVPress", "ObservedAttentionPress", "LeverageScorePress", "CompactorPress", "CURPress",
                  "LagKVPress", "KeyDiffPress", "RandomPress", "CriticalKVPress"]


@pytest.mark.integration
def test_presses_on_the_embedded_teacher(real_pair):
    teacher, _ = real_pair
    prompt = ("Explain, step by step, how a key-value cache speeds up autoregressive decoding in a transformer, "
              "what it stores per layer and head, why its memory grows with the context, and which methods "
              "compress it. ") * 4
    ran = []
    for name in RUN_ON_TEACHER:
        press = default_press(name) if name not in ("SnapKVPress", "PyramidKVPress") else \
            getattr(kvpress, name)(window_size=16)
        cfg = kvlab.DecodeConfig(mode="teacher", max_new_tokens=3, evict=ScorerPolicy(press, budget=64, sinks=4))
        trace = kvlab.run(teacher, None, prompt, cfg)
        assert trace.records[0].cache_len == 64, name
        ran.append(name)
    assert len(ran) >= 10
