"""The playground's logic without a browser (tiny models): readouts equal kvlab's numbers for the
config a control selects, stored configs answer from disk, cancelled runs store nothing, bad input
is reported per control and keeps the last good result, step-through works for every mode/policy."""
from __future__ import annotations

import statistics
import threading
from dataclasses import replace

import pytest

from kvlab.decode import DecodeConfig, Sampling
from kvlab.harness.experiment import run_config, scored_run
from kvlab.refresh.policies import EntropyGate, MCGate, Periodic, ProbeKL, Speculative
from kvlab.playground import Playground, Settings, Stepper, check, decode_config
from kvlab.playground.controller import fmt
from kvlab.playground.settings import Range, percentile_of
from kvlab.store import RunStore

PROMPT = "the quick brown fox"
N = 10


@pytest.fixture
def pg(tiny_teacher, tiny_student, tmp_path):
    p = Playground(tiny_teacher, students={0.3: tiny_student}, store=RunStore(tmp_path / "runs"),
                   prompts=[PROMPT, "hello there"], calib_prompts=["calibrate me"], calib_tokens=N,
                   settings=Settings(prompt=PROMPT, N=N, policy="periodic", T=4, seed=3))
    p.start()
    yield p
    p.cancel()
    p.wait(30)


def _direct(teacher, student, cfg, tmp_path, name):
    """kvlab's own numbers for ``cfg``, computed in a separate store (no playground involved)."""
    return scored_run(teacher, student, PROMPT, cfg, RunStore(tmp_path / name))


def _sampling():
    return Sampling(temperature=0.7, top_p=0.9, seed=3)


# ------------------------------------------------------------------ readouts follow the controls


def test_setting_a_slider_shows_kvlab_numbers_for_that_config(pg, tiny_teacher, tiny_student, tmp_path):
    assert pg.shown is not None and pg.shown.settings.T == 4
    assert pg.set(T=3)
    pg.wait()
    want = _direct(tiny_teacher, tiny_student, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=_sampling(),
                                                             refresh=Periodic(3)), tmp_path, "direct")
    base = _direct(tiny_teacher, tiny_student, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=_sampling()),
                   tmp_path, "direct")
    ro = pg.shown.readouts
    assert pg.shown.settings.T == 3
    assert ro["teacher_ppl"] == pytest.approx(want["teacher_ppl"], rel=1e-6)
    assert ro["kl"] == pytest.approx(want["kl"], rel=1e-5)
    assert ro["repeat3"] == want["repeat3"] and ro["refreshes"] == want["refreshes"] == 3
    assert ro["teacher_tokens_pct"] == pytest.approx(100 * want["teacher_tokens"] / N)
    assert pg.shown.base_readouts["teacher_ppl"] == pytest.approx(base["teacher_ppl"], rel=1e-6)
    assert pg.shown.base_readouts["refreshes"] == 0
    # the shown run is the stored run of exactly that config
    assert pg.store.get(pg.config(pg.settings, tiny_student)) == pg.shown.result


def test_entropy_tau_moves_the_readout(pg, tiny_teacher, tiny_student, tmp_path):
    ent = [e for e, s in zip(pg.shown.base["steps"]["entropy_bits"], pg.shown.base["steps"]["source"]) if s == "student"]
    tau = round(statistics.median(ent), 4)
    assert pg.set(policy="entropy", tau_bits=tau)
    pg.wait()
    want = _direct(tiny_teacher, tiny_student, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=_sampling(),
                                                             refresh=EntropyGate(tau)), tmp_path, "direct")
    assert pg.shown.settings.tau_bits == tau
    assert pg.shown.readouts["refreshes"] == want["refreshes"] > 0
    assert pg.shown.readouts["teacher_ppl"] == pytest.approx(want["teacher_ppl"], rel=1e-6)
    # τ's calibrated percentile is where τ falls in the calibration runs' student entropy
    pct = pg.percentiles()["tau_bits"]
    assert pct == pytest.approx(percentile_of(pg.calibration().entropy, tau))


def test_stored_config_answers_from_disk_without_decoding(pg, monkeypatch):
    first = pg.shown
    pg.set(T=5)
    pg.wait()
    assert pg.shown.source == "live"

    def no_decoding(*a, **k):
        raise AssertionError("a stored config must not decode")

    monkeypatch.setattr("kvlab.playground.reader.scored_run", no_decoding)        # every run the playground reads
    monkeypatch.setattr("kvlab.playground.calibration.scored_run", no_decoding)   # every calibration run
    assert pg.set(T=4)
    assert pg.runner.current is None                      # nothing started in the background
    assert pg.shown.source == "disk" and pg.shown.key == first.key
    assert pg.shown.readouts == first.readouts
    assert pg.last_response_s is not None


def test_streamed_points_are_the_stored_steps(pg):
    points = []
    pg.subscribe(lambda ev, p: points.append(p) if ev == "point" else None)
    pg.set(T=2)
    pg.wait()
    assert [p.step for p in points] == list(range(1, N + 1))
    assert [p.entropy_bits for p in points] == pytest.approx(pg.shown.result["steps"]["entropy_bits"])
    assert [p.refreshed for p in points] == pg.shown.result["steps"]["refreshed"]
    assert pg.last_live["tokens"] == N and pg.last_live["tps"] > 0


# ------------------------------------------------------------------ cancellation


def test_cancelled_run_leaves_no_partial_row(pg, tiny_student):
    """Moving the slider while a run decodes cancels it: its config has no row, the newer one is shown."""
    moved = threading.Event()

    def move_on_first_point(ev, p):
        if ev == "point" and p.step == 2 and not moved.is_set():
            moved.set()
            pg.set(T=7)                                   # the user moves the slider again

    pg.subscribe(move_on_first_point)
    before = len(pg.store)
    pg.set(T=6)
    pg.wait()
    assert moved.is_set()
    s6, s7 = pg.settings.replace(T=6), pg.settings.replace(T=7)
    assert pg.store.get(pg.config(s6, tiny_student)) is None      # cancelled: nothing stored
    assert pg.store.get(pg.config(s7, tiny_student)) is not None
    assert len(pg.store) == before + 1
    assert pg.shown.settings.T == 7 and pg.settings.T == 7
    assert not list(pg.store.root.rglob("*.tmp"))


def test_a_stale_run_never_overwrites_a_newer_answer(pg, tiny_student):
    """A run that finishes after the user moved on (here: to a stored config) is stored but not shown."""
    state = {}

    def move_at_last_step(ev, p):
        if ev == "point" and p.step == N and "moved" not in state:
            state["moved"] = True
            pg.set(T=4)                                   # stored: answered from disk at once

    pg.subscribe(move_at_last_step)
    pg.set(T=8)
    pg.wait()
    assert state.get("moved")
    assert pg.shown.settings.T == 4 and pg.shown.source == "disk"


# ------------------------------------------------------------------ precompute


def test_precompute_stores_every_slider_position(pg, tiny_student):
    progress = []
    pg.subscribe(lambda ev, p: progress.append(p) if ev == "progress" and p.stage == "precompute" else None)
    grid = pg.grid("T")
    assert grid == list(range(1, N + 1))                  # T > N is invalid, so the grid stops at N
    pg.precompute("T", [2, 3, 9])
    pg.wait()
    for T in (2, 3, 9):
        assert pg.store.get(pg.config(pg.settings.replace(T=T), tiny_student)) is not None
    assert progress[-1].done == progress[-1].total == 3
    assert pg.set(T=9) and pg.shown.source == "disk"


def test_precompute_refuses_values_out_of_range(pg):
    with pytest.raises(ValueError, match="not valid"):
        pg.precompute("T", [2, N + 5])
    with pytest.raises(ValueError, match="param="):
        pg.precompute("nope")


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("changes, control", [
    ({"prompt": "   "}, "prompt"), ({"prompt": ""}, "prompt"),
    ({"N": 0}, "N"), ({"N": -4}, "N"), ({"N": 2.5}, "N"),
    ({"T": 0}, "T"), ({"T": N + 1}, "T"),
    ({"policy": "entropy", "tau_bits": -0.5}, "tau_bits"), ({"policy": "entropy", "tau_bits": 99.0}, "tau_bits"),
    ({"policy": "speculative", "k": 0}, "k"), ({"policy": "speculative", "k": N + 3}, "k"),
    ({"policy": "probe_kl", "kappa": -1.0}, "kappa"), ({"policy": "probe_kl", "M": 0}, "M"),
    ({"mode": "teacher"}, "policy"),                      # a refresh needs overfill
    ({"sampling": "sample", "temperature": 0.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"prune_ratio": 0.9}, "prune_ratio"), ({"evict": "nonsense"}, "evict"), ({"seed": -1}, "seed"),
])
def test_bad_input_is_named_and_keeps_the_last_good_result(pg, changes, control):
    good = pg.shown
    assert pg.set(**changes) is False
    assert control in pg.errors and control.split("_")[0] in pg.errors[control]
    assert pg.shown is good                               # the last good result stays on screen
    assert pg.runner.current is None
    fixed = {k: getattr(good.settings, k) for k in changes}
    assert pg.set(**fixed) and not pg.errors
    assert pg.shown.key == good.key


def test_unknown_control_raises(pg):
    with pytest.raises(ValueError, match="unknown control"):
        pg.set(tau=1.0)


def test_a_failing_run_is_reported_and_the_kernel_goes_on(tiny_teacher, tiny_student, tmp_path):
    def broken(ratio):
        raise RuntimeError(f"no student for {ratio}")

    p = Playground(tiny_teacher, tiny_student, students=broken, prune_ratios=(0.3, 0.5), store=RunStore(tmp_path),
                   prompts=[PROMPT], calib_prompts=["x y"], settings=Settings(prompt=PROMPT, N=4, policy="none"))
    p.start()
    good = p.shown
    assert p.set(prune_ratio=0.5)
    p.wait()
    assert "no student for 0.5" in p.errors["run"] and p.shown is good
    assert p.set(prune_ratio=0.3) and p.shown.key == good.key


# ------------------------------------------------------------------ settings -> config


def test_settings_build_the_policies_kvlab_runs():
    s = Settings(prompt="p", N=32)
    assert decode_config(s.replace(policy="periodic", T=5, W=2)).refresh == Periodic(5, W=2)
    assert decode_config(s.replace(policy="periodic", T=5, W=0)).refresh == Periodic(5)
    assert decode_config(s.replace(policy="entropy", tau_bits=2.5)).refresh == EntropyGate(2.5)
    assert decode_config(s.replace(policy="probe_kl", M=4, kappa=0.3)).refresh == ProbeKL(4, 0.3)
    assert decode_config(s.replace(policy="speculative", k=6)).refresh == Speculative(6)
    assert decode_config(s.replace(policy="mc", mc_threshold=0.2, mc_every=3)).refresh == MCGate(
        threshold=0.2, signal="mi", probe_every=3, refractory=3)
    assert decode_config(s.replace(policy="none")).refresh is None
    g = decode_config(s.replace(sampling="greedy"))
    assert g.sampling.greedy and g.sampling.seed == s.seed
    assert decode_config(s.replace(policy="periodic", refresh_next="teacher")).refresh_next == "teacher"
    # a float slider position and the same grid point key the same run
    assert s.replace(tau_bits=0.1 * 3) == s.replace(tau_bits=0.3)
    assert Range(0.0, 1.0, 0.1).positions()[3] == 0.3
    assert check(s.replace(policy="entropy", tau_bits=7.5), vocab_size=128) == {
        "tau_bits": "tau_bits=7.5 must be in 0..7.00 bits (log2 of the vocabulary, 128, is the largest entropy)"}


def test_baseline_is_the_same_run_without_refresh_or_eviction():
    s = Settings(prompt="p", policy="speculative", k=3, refresh_next="teacher", N=20, seed=4)
    b = s.baseline()
    assert decode_config(b) == replace(decode_config(s), refresh=None, refresh_next="rerun")


# ------------------------------------------------------------------ step-through


CASES = [("teacher", "none"), ("student", "none")] + [("overfill", p) for p in
                                                      ("none", "periodic", "entropy", "probe_kl", "speculative", "mc")]


@pytest.mark.parametrize("mode, policy", CASES)
def test_step_through_every_mode_and_policy(pg, tiny_student, mode, policy):
    s = pg.settings.replace(mode=mode, policy=policy, T=3, k=3, M=2, kappa=0.0, tau_bits=0.0, mc_every=2,
                            mc_threshold=0.0, refresh_next="teacher")
    assert pg.set(**{k: getattr(s, k) for k in ("mode", "policy", "T", "k", "M", "kappa", "tau_bits", "mc_every",
                                                  "mc_threshold", "refresh_next")})
    pg.wait()
    st = Stepper(pg)
    first = st.step()
    assert first.record.step == 1 and len(first.top5) == 5
    probs = [p for _, p, _ in first.top5]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    assert first.cache_len == len(first.live)
    views = [first] + st.run()
    assert len(views) == N and views[-1].done and st.step() is None
    stored = pg.store.get(pg.config(s, tiny_student))
    assert [v.record.token_id for v in views] == stored["steps"]["token_id"]        # the same decoding
    assert [v.refreshed for v in views] == stored["steps"]["refreshed"]
    fired = [v for v in views if v.refreshed]
    if mode == "overfill" and policy != "none":
        assert fired, "every refresh policy fires at threshold 0 / small periods"
        v = fired[0]
        # refresh_next="teacher": the spliced span is teacher-written in the live map right after the step
        L, t = v.prompt_len, v.record.step
        writers = {sl.position: sl.writer for sl in v.live}
        assert all(writers[p] == "teacher" for p in range(L + t - v.spliced, L + t))
        assert v.spliced > 0
    else:
        assert not fired
    st.reset()
    assert st.history == [] and st.step().record.step == 1


def test_step_through_refuses_bad_settings(pg):
    from kvlab.playground import SettingsError

    st = Stepper(pg)
    st.step()
    with pytest.raises(SettingsError) as e:
        st.reset(pg.settings.replace(N=0))
    assert "N" in e.value.errors
    assert len(st.history) == 1                            # the old decoding is untouched


# ------------------------------------------------------------------ the widget view (no browser)


def test_view_slider_redraws_readout_with_the_stored_value(pg, tiny_student):
    pytest.importorskip("ipywidgets")
    from kvlab.playground.view import PlaygroundView

    v = PlaygroundView(pg)
    v.controls["T"].value = 2
    pg.wait()
    stored = pg.store.get(pg.config(pg.settings.replace(T=2), tiny_student))
    assert f"<span class='kvlab-ro-teacher_ppl'>{fmt(stored['teacher_ppl'], 'g3')}</span>" in v.table.value
    assert pg.key(pg.settings.replace(T=2)) in v.table.value
    assert list(v.fig.data[1].y) == pytest.approx(stored["steps"]["entropy_bits"])
    assert list(v.fig.data[6].x) == stored["live"]["positions"]
    # bad input: the error appears next to N, the readout keeps the last good value
    table = v.table.value
    v.controls["N"].value = 0
    assert "N=0" in v.errs["N"].value and v.table.value == table
    v.controls["N"].value = N
    assert v.errs["N"].value == ""
    # the refresh-policy sliders shown are the chosen policy's
    v.controls["policy"].value = "speculative"
    assert v.policy_rows["k"].layout.display == "" and v.policy_rows["T"].layout.display == "none"
    pg.wait()
    # step-through tab
    assert v.steps.reset()
    v.steps.step_once()
    assert "step <b>1</b>" in v.step_info.value and "top-5" in v.step_info.value
    slots = v.stepper.history[-1].live
    assert v.step_map.value.count("class='kvlab-slot ") == len(slots) > 0


# ------------------------------------------------------------------ eviction (kvlab.eviction)


def test_eviction_control_runs_that_policy_at_that_budget(pg, tiny_teacher, tiny_student, tmp_path):
    from kvlab.eviction import SlidingWindow

    assert "sliding" in pg.eviction_names and "full" not in pg.eviction_names
    assert pg.set(evict="sliding", budget=16)
    pg.wait()
    want = _direct(tiny_teacher, tiny_student, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=_sampling(),
                                                             refresh=Periodic(4), evict=SlidingWindow(16, sinks=4)),
                   tmp_path, "direct")
    sh = pg.shown
    assert sh.readouts["teacher_ppl"] == pytest.approx(want["teacher_ppl"], rel=1e-6)
    assert max(sh.result["steps"]["cache_len"]) <= 16 < max(sh.base["steps"]["cache_len"])   # baseline: full cache
    assert len(sh.result["live"]["positions"]) <= 16
    assert sh.readouts["cache_kib"] < sh.base_readouts["cache_kib"]
    assert pg.config(pg.settings, tiny_student)["decode"]["evict"] == {"policy": "SlidingWindow", "window": 16, "sinks": 4}


@pytest.mark.parametrize("name", ["sliding", "h2o", "random", "confkv", "block"])
def test_every_eviction_policy_keeps_the_cache_within_its_budget(pg, name):
    budget = 24
    assert pg.set(evict=name, budget=budget), pg.errors
    pg.wait()
    assert not pg.errors
    lens = pg.shown.result["steps"]["cache_len"]
    assert max(lens) <= budget and sum(pg.shown.result["steps"]["evicted"]) > 0
    st = Stepper(pg)
    views = st.run()
    assert len(views) == N and max(v.cache_len for v in views) <= budget
    assert len(views[-1].live) == views[-1].cache_len


def test_a_budget_the_policy_cannot_hold_is_named(pg):
    good = pg.shown
    assert pg.set(evict="block", budget=12) is False      # start + recent blocks alone need 8 of max 8
    assert "budget" in pg.errors and "block" in pg.errors["budget"]
    assert pg.shown is good
