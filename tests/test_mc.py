"""Real MC dropout: hooks, the batched probe on the cache, signals, the MCGate policy."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvlab.studies.mc import real as mc_real
from kvlab.uncertainty import mc
from kvlab.cache import KVCache
from kvlab.decode import DecodeConfig, Sampling
from kvlab.uncertainty.mc import MCGate, mc_dropout, mc_signals, mc_step


def _snapshot(cache: KVCache):
    kvs = [cache.kv(i) for i in range(cache.num_layers)]
    led = cache.ledger
    return kvs, (list(led.token_id), list(led.position), list(led.writer), list(led.step)), list(cache.live), \
        cache.next_position


def _same(a, b) -> bool:
    kvs_a, led_a, live_a, np_a = a
    kvs_b, led_b, live_b, np_b = b
    return (led_a == led_b and live_a == live_b and np_a == np_b and len(kvs_a) == len(kvs_b)
            and all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(kvs_a, kvs_b)))


@pytest.fixture()
def decoded(tiny_student):
    """A student cache after prefill + two decode steps, and the last step's clean logits."""
    model = tiny_student.model
    cache, _ = KVCache.prefill(model, [5, 9, 17, 33, 4], writer="student")
    cache.forward(model, [11], writer="student", step=1)
    logits = cache.forward(model, [12], writer="student", step=2)
    return model, cache, logits


# ------------------------------------------------------------------ hooks


def _hook_count(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_dropout_hooks_cover_every_sublayer_and_are_removed(tiny_student):
    model = tiny_student.model
    n_layers = model.config.num_hidden_layers
    with mc_dropout(model, 0.3, seed=0) as n:
        assert n == 2 * n_layers
        assert _hook_count(model) == 2 * n_layers
    assert _hook_count(model) == 0


def test_dropout_hooks_removed_on_error(decoded):
    model, cache, logits = decoded
    with pytest.raises(RuntimeError, match="boom"):
        with mc_dropout(model, 0.5, seed=0):
            noisy = cache.probe_last(model, 2)
            assert not torch.allclose(noisy[0], logits, atol=1e-4)   # the noise was live
            raise RuntimeError("boom")
    assert _hook_count(model) == 0
    torch.testing.assert_close(cache.probe_last(model, 1)[0], logits, rtol=0, atol=1e-5)  # clean again


def test_dropout_changes_passes_independently_and_is_seeded(decoded):
    model, cache, _ = decoded
    with mc_dropout(model, 0.2, seed=7):
        a = cache.probe_last(model, 4)
    with mc_dropout(model, 0.2, seed=7):
        b = cache.probe_last(model, 4)
    assert torch.equal(a, b)
    assert all(not torch.allclose(a[0], a[i]) for i in range(1, 4))


def test_no_sublayers_found_is_a_value_error(tiny_student):
    with pytest.raises(ValueError, match="sublayers"):
        with mc_dropout(tiny_student.model, 0.1, sublayers=("nope",)):
            pass


# ------------------------------------------------------------------ the batched probe


def test_p0_passes_equal_the_clean_pass(decoded):
    model, cache, logits = decoded
    with mc_dropout(model, 0.0, seed=0):
        Z = cache.probe_last(model, 5)                                # (5, V)
    assert Z.shape == (5, logits.shape[-1])
    for z in Z:
        torch.testing.assert_close(z, logits, rtol=0, atol=1e-5)
    sig = mc_signals(Z, logits)
    assert sig["flip"] == 0.0 and sig["u"] < 1e-10 and sig["mi"] < 1e-8


def test_probe_leaves_cache_bit_identical(decoded):
    model, cache, logits = decoded
    before = _snapshot(cache)
    mc_step(model, cache, logits, n_passes=6, p=0.3, seed=1)
    assert _snapshot(cache) is not None and _same(before, _snapshot(cache))
    cache.check()
    # decoding continues exactly as if no probe had happened
    ref = cache.copy()
    torch.testing.assert_close(cache.forward(model, [13], writer="student", step=3),
                               ref.forward(model, [13], writer="student", step=3), rtol=0, atol=0)


def test_probe_after_prefill_only_and_bad_n(tiny_student):
    model = tiny_student.model
    cache, logits = KVCache.prefill(model, [7], writer="student")        # prefix of length 0
    torch.testing.assert_close(cache.probe_last(model, 3)[1], logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="n_copies"):
        cache.probe_last(model, 0)
    with pytest.raises(ValueError, match="non-empty"):
        KVCache().probe_last(model, 2)


# ------------------------------------------------------------------ signals on hand-made logits


def test_signals_hand_computed():
    Z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 2.0]])
    clean = torch.tensor([0.0, 1.0])
    sig = mc_signals(Z, clean)
    # population variance per column: {1,0,0} -> 2/9, {0,1,2} -> 2/3; mean over V=2 -> 4/9
    assert sig["u"] == pytest.approx(4 / 9, abs=1e-12)
    # argmaxes 0, 1, 1 vs clean 1 -> one flip in three
    assert sig["flip"] == pytest.approx(1 / 3)

    def softmax(z):
        e = [math.exp(v) for v in z]
        return [v / sum(e) for v in e]

    def H(p):
        return -sum(v * math.log(v) for v in p)

    ps = [softmax(z) for z in ([1, 0], [0, 1], [0, 2])]
    pbar = [sum(p[j] for p in ps) / 3 for j in range(2)]
    assert sig["h_pred"] == pytest.approx(H(pbar), abs=1e-12)
    assert sig["mi"] == pytest.approx(H(pbar) - sum(H(p) for p in ps) / 3, abs=1e-12)


def test_u_is_the_seeds_population_variance():
    rng = np.random.default_rng(0)
    Z = rng.normal(size=(16, 50))
    assert mc_signals(torch.tensor(Z), torch.tensor(Z[0]))["u"] == pytest.approx(Z.var(axis=0).mean(), rel=1e-12)


def test_identical_passes_have_zero_mi_and_u():
    z = torch.tensor([0.3, -1.0, 2.0])
    sig = mc_signals(torch.stack([z, z, z]), z)
    assert sig == pytest.approx({"u": 0.0, "mi": 0.0, "flip": 0.0, "h_pred": sig["h_pred"]}, abs=1e-12)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan"), "0.1", True])
def test_bad_p(decoded, p):
    model, cache, logits = decoded
    with pytest.raises(ValueError, match=r"^p="):
        mc_step(model, cache, logits, n_passes=4, p=p)
    with pytest.raises(ValueError, match="dropout_p|p="):
        MCGate(threshold=1.0, dropout_p=p)
    assert _hook_count(model) == 0


@pytest.mark.parametrize("n", [1, 0, -3, 2.0, True])
def test_bad_n(decoded, n):
    model, cache, logits = decoded
    with pytest.raises(ValueError, match="n_passes"):
        mc_step(model, cache, logits, n_passes=n, p=0.1)
    with pytest.raises(ValueError, match="n_passes"):
        MCGate(threshold=1.0, n_passes=n)
    with pytest.raises(ValueError, match="n_passes"):
        mc.make_mc_probe(n_passes=n)


@pytest.mark.parametrize("pct", [0, 100, -5, 150, "70"])
def test_bad_percentile_before_any_decoding(pct):
    # teacher/student None: the error must come from validation, before any model is touched
    with pytest.raises(ValueError, match="percentile"):
        mc.calibrate(None, None, percentile=pct)
    with pytest.raises(ValueError, match="percentile"):
        MCGate.calibrated(None, None, percentile=pct)


def test_bad_gate_fields():
    with pytest.raises(ValueError, match="signal"):
        MCGate(threshold=1.0, signal="entropy")
    with pytest.raises(ValueError, match="threshold"):
        MCGate(threshold=float("inf"))
    with pytest.raises(ValueError, match="probe_every"):
        MCGate(threshold=1.0, probe_every=0)
    with pytest.raises(ValueError, match="refractory"):
        MCGate(threshold=1.0, refractory=-1)
    with pytest.raises(ValueError, match="refractory"):
        MCGate.calibrated(None, None, percentile=70, refractory=-1)


# ------------------------------------------------------------------ MCGate


def test_gate_protocol_attributes():
    g = MCGate(threshold=0.5, signal="flip", probe_every=4)
    assert g.probe == "mc" and g.probe_every == 4 and g.key == "mc_flip"
    with pytest.raises(Exception):
        g.threshold = 1.0   # frozen


def test_gate_fires_per_scripted_sequence_with_refractory():
    """Probe every 4 steps; the loop refreshes whenever the gate says so; since_refresh counts from
    the prefill (step 0) as in the refresh loop; refractory 4 then 8."""
    gate = MCGate(threshold=0.5, signal="mi", probe_every=4, refractory=4)
    script = {4: 0.9, 8: 0.9, 12: 0.9, 16: 0.1, 20: 0.6, 24: 0.51, 28: 0.5, 32: 0.7}
    fires, last = [], None
    for step in range(1, 34):
        signals = {"mc_mi": script[step]} if step in script else {}
        rec = SimpleNamespace(step=step, signals=signals, since_refresh=step if last is None else step - last)
        if gate.should_refresh(rec):
            fires.append(step)
            last = step
    # refractory 4: every probe above threshold fires (4, 8, 12, 20, 24, 32; 16 and 28 are not > 0.5)
    assert fires == [4, 8, 12, 20, 24, 32]
    gate8 = MCGate(threshold=0.5, signal="mi", probe_every=4, refractory=8)
    fires, last = [], 0
    for step in range(1, 34):
        rec = SimpleNamespace(step=step, signals={"mc_mi": script[step]} if step in script else {},
                              since_refresh=step - last)
        if gate8.should_refresh(rec):
            fires.append(step)
            last = step
    # 4 is only 4 after the prefill; 8 fires; 12 only 4 after; 16 below; 20 is 12 after 8 -> fires;
    # 24 only 4 after; 28 not > threshold; 32 is 12 after 20 -> fires
    assert fires == [8, 20, 32]
    # the seed's convention (None = no refresh yet): the first probe may fire
    assert gate8.should_refresh(SimpleNamespace(signals={"mc_mi": 0.9}, since_refresh=None))
    # the older name is accepted too
    assert not gate8.should_refresh(SimpleNamespace(signals={"mc_mi": 0.9}, steps_since_refresh=3))


def test_gate_ignores_steps_without_mc_signals_and_other_signals():
    gate = MCGate(threshold=0.1, signal="u", refractory=0)
    assert not gate.should_refresh(SimpleNamespace(signals={}, since_refresh=5))
    assert not gate.should_refresh(SimpleNamespace(signals={"mc_mi": 9.0}, since_refresh=5))
    assert gate.should_refresh(SimpleNamespace(signals={"mc_u": 0.2}, since_refresh=5))


def test_gate_requires_steps_since_refresh():
    gate = MCGate(threshold=0.1, signal="u")
    with pytest.raises(AttributeError, match="since_refresh"):
        gate.should_refresh(SimpleNamespace(signals={"mc_u": 0.2}))


def test_replay_gate_matches_seed_count_triggers():
    """On a plain series, replaying MCGate equals the seed's count_triggers (M=probe_every)."""
    import pandas as pd

    from kvlab.studies.mc.sim import count_triggers

    rng = np.random.default_rng(3)
    series = rng.random(200)
    df = pd.DataFrame({"step": np.arange(200), "mi": series})
    gate = MCGate(threshold=0.6, signal="mi", probe_every=8, refractory=16)
    assert mc_real.replay_gate(gate, df, count_from_prefill=False) == count_triggers(series, 0.6, M=8, refractory=16)
    loop = mc_real.replay_gate(gate, df)        # the refresh loop's convention: no fire before step 16
    assert loop and min(loop) >= 16
    assert all(b - a >= 16 for a, b in zip(loop, loop[1:]))


# ------------------------------------------------------------------ the probe the refresh loop calls


@dataclass(frozen=True)
class _Ctx:  # the ProbeContext fields the refresh loop passes
    teacher: object
    student: object
    cache: KVCache
    teacher_cache: object
    tokens: list
    logits: torch.Tensor
    step: int
    config: object = field(default_factory=DecodeConfig)


def test_mc_probe_signals_cost_and_cache(decoded, tiny_student):
    _, cache, logits = decoded
    before = _snapshot(cache)
    cfg = SimpleNamespace(sampling=Sampling(seed=3), refresh=MCGate(threshold=1.0, n_passes=3, dropout_p=0.2))
    ctx = _Ctx(None, tiny_student, cache, None, [11, 12], logits, 3, cfg)
    res = mc.mc_probe(ctx)
    assert set(res.signals) == {"mc_u", "mc_mi", "mc_flip", "mc_h_pred"}
    assert res.cost == {"student_passes": 3.0}
    assert res.signals["mc_u"] > 0
    assert _same(before, _snapshot(cache))
    assert mc.mc_probe(ctx) == res                         # seeded by (sampling.seed, step): repeatable
    assert mc.make_mc_probe(5, 0.1)(_Ctx(None, tiny_student, cache, None, [], logits, 3)).cost == {"student_passes": 5.0}


def test_mc_trace_on_tiny_pair(tiny_teacher, tiny_student):
    df = mc.mc_trace(tiny_teacher, tiny_student, "hello there", tokens=6, n_passes=3, p=0.2, probe_every=2)
    assert list(df["step"]) == [2, 4, 6]
    assert {"entropy", "u", "mi", "flip", "h_pred", "student_passes"} <= set(df.columns)
    assert (df["u"] > 0).all() and df["flip"].between(0, 1).all() and (df["mi"] >= 0).all()


@pytest.mark.integration
def test_real_pair_probe_matches_clean_and_cache_intact(real_pair):
    teacher, student = real_pair
    from kvlab.decode import Decoding

    d = Decoding(teacher, student, "Why is the sky blue?", DecodeConfig(max_new_tokens=4, keep_dists=True))
    for rec in d:
        if rec.step == 3:
            before = _snapshot(d.cache)
            with mc_dropout(student.model, 0.0):
                Z = d.cache.probe_last(student.model, 4)
            assert torch.allclose(torch.log_softmax(Z.float(), -1), d.dists[-1].expand_as(Z), atol=1e-4)
            sig = mc_step(student.model, d.cache, d.dists[-1], n_passes=4, p=0.1, seed=0)
            assert sig["u"] > 0 and sig["mi"] > 0
            assert _same(before, _snapshot(d.cache))


def test_calibration_is_the_percentile_of_the_traces(tiny_teacher, tiny_student):
    prompts = ["abc def", "hello"]
    taus = mc.calibration_thresholds(tiny_teacher, tiny_student, percentile=70, prompts=prompts, tokens=5,
                                     n_passes=3, p=0.2)
    df = mc.mc_traces(tiny_teacher, tiny_student, prompts, tokens=5, n_passes=3, p=0.2)
    for sig in mc.SIGNALS:
        assert taus[sig] == pytest.approx(float(np.percentile(df[sig], 70)))
    gate = MCGate.calibrated(tiny_teacher, tiny_student, percentile=70, signal="u", prompts=prompts, tokens=5,
                             n_passes=3, dropout_p=0.2, refractory=4)
    assert gate.threshold == pytest.approx(taus["u"]) and gate.refractory == 4 and gate.signal == "u"


@pytest.mark.parametrize("argv, needle", [
    (["bench", "mc", "--passes", "1"], "n_passes"),
    (["bench", "mc", "--dropout", "1.0"], "p="),
    (["mc-real", "--dropout", "0.1", "-0.2"], "p="),
    (["mc-real", "--passes", "0"], "n_passes"),
])
def test_cli_bad_mc_input_fails_before_loading_models(argv, needle, capsys, monkeypatch):
    from kvlab import cli
    from kvlab.train import pair as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before validation")

    monkeypatch.setattr(models, "load_pair", boom)
    monkeypatch.setattr(models, "load_student", boom)
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_mcgate_runs_in_the_refresh_loop(tiny_teacher, tiny_student):
    """The "mc" probe is registered and the decode loop drives MCGate through the generic protocol."""
    from kvlab import run
    from kvlab.refresh.base import PROBES
    from kvlab.harness.costs import run_costs

    assert "mc" in PROBES
    gate = MCGate(threshold=-1.0, signal="mi", probe_every=3, refractory=0, n_passes=2, dropout_p=0.2)
    tr = run(tiny_teacher, tiny_student, "abc def", mode="overfill", max_new_tokens=10, refresh=gate)
    probed = [r.step for r in tr.records if r.probed]
    assert probed == [3, 6, 9]
    assert all(r.signals.get("mc_mi") is not None for r in tr.records if r.probed)
    assert [r.step for r in tr.records if r.refreshed] == probed      # threshold -1: fires at every probe
    costs = run_costs(tr.records)
    assert costs["probe_student_passes"] == 2 * len(probed) and costs["refreshes"] == 3
