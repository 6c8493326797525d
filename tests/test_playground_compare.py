"""The playground's comparison features without a browser (tiny models): honest ratios (no cross-run
timing), spread over prompts × seeds, calibrated MC threshold, Conf-KV γ / H2O recent window, pins and
overlay, PNG + CSV export, why a refresh fired, and the plot details."""
from __future__ import annotations

import csv
import math
import statistics

import pytest

from kvlab.decode import DecodeConfig, Sampling
from kvlab.harness.experiment import scored_run
from kvlab.playground import Playground, Settings, Stepper, decode_config
from kvlab.playground.controller import fmt, nice_range, readouts
from kvlab.playground.settings import refresh_policy
from kvlab.playground.spread import pairs
from kvlab.playground.why import refresh_reasons, same_tokens_note
from kvlab.store import RunStore

PROMPTS = ["the quick brown fox", "hello there", "once upon a time"]
N = 10


@pytest.fixture
def pg(tiny_teacher, tiny_student, tmp_path):
    p = Playground(tiny_teacher, students={0.3: tiny_student}, store=RunStore(tmp_path / "runs"), background=False,
                   prompts=PROMPTS, calib_prompts=["calibrate me"], calib_tokens=N,
                   settings=Settings(prompt=PROMPTS[0], N=N, policy="periodic", T=4, seed=3))
    p.start()
    return p


# ------------------------------------------------------------------ honest ratios


def test_readouts_never_compare_separately_timed_runs(pg):
    sh = pg.shown
    slow_base = {**sh.base, "total_s": sh.base["total_s"] * 100, "tps": 0.001}
    assert readouts(sh.result, slow_base, "overfill") == readouts(sh.result, sh.base, "overfill")
    assert sh.readouts["teacher_time_pct"] == sh.result["teacher_pct"]          # measured inside this run
    assert "overhead_pct" not in sh.readouts
    assert math.isnan(readouts(sh.result, sh.base, "teacher")["teacher_time_pct"])


def test_time_vs_baseline_is_timed_back_to_back(pg):
    got = []
    pg.subscribe(lambda ev, p: got.append(p) if ev == "timing" else None)
    pg.time_vs_baseline(repeats=2)
    assert len(got) == 1 and got[0]["pairs"] == 2 and got[0]["settings"] == pg.settings
    assert math.isfinite(got[0]["overhead_pct"]) and math.isfinite(got[0]["noise_pct"])
    with pytest.raises(ValueError, match="repeats"):
        pg.time_vs_baseline(repeats=0)


def test_single_run_numbers_have_three_significant_digits():
    assert fmt(4.65123, "g3") == "4.65" and fmt(0.012345, "g3") == "0.0123" and fmt(127.79, "g3") == "128"
    assert fmt(3, "g3") == "3" and fmt(-0.5, "+g3") == "-0.500" and fmt(float("nan"), "g3") == "–"


# ------------------------------------------------------------------ spread


def test_spread_is_mean_and_paired_ci_over_prompts_and_seeds(pg, tiny_teacher, tiny_student, tmp_path):
    events = []
    pg.subscribe(lambda ev, p: events.append(p) if ev == "spread" and p is not None else None)
    assert pg.set(n_prompts=3, n_seeds=2)
    sp = pg.spread
    assert sp.complete and sp.total == 6 and [e.done for e in events] == [1, 2, 3, 4, 5, 6]   # filled in as pairs finish
    assert math.isnan(events[3].stats["teacher_ppl"]["lo"])      # no interval below MIN_PAIRS (5) pairs, as in the tables
    direct = RunStore(tmp_path / "direct")
    ppl, d = [], []
    for prompt in PROMPTS[:3]:
        for seed in (3, 4):
            samp = Sampling(temperature=0.7, top_p=0.9, seed=seed)
            from kvlab.refresh.policies import Periodic
            r = scored_run(tiny_teacher, tiny_student, prompt, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=samp,
                                                                            refresh=Periodic(4)), direct)
            b = scored_run(tiny_teacher, tiny_student, prompt, DecodeConfig(mode="overfill", max_new_tokens=N, sampling=samp),
                           direct)
            ppl.append(r["teacher_ppl"])
            d.append(r["teacher_ppl"] - b["teacher_ppl"])
    st = sp.stats["teacher_ppl"]
    assert st["mean"] == pytest.approx(statistics.mean(ppl), rel=1e-6)
    assert st["d"] == pytest.approx(statistics.mean(d), rel=1e-6, abs=1e-9)
    assert st["n"] == 6 and st["lo"] <= st["d"] <= st["hi"]
    # the single run shown is still the first pair
    assert pg.shown.settings.prompt == PROMPTS[0] and pg.shown.settings.seed == 3
    # back to one run: no spread
    assert pg.set(n_prompts=1, n_seeds=1) and pg.spread is None


def test_spread_controls_are_checked(pg):
    assert pg.set(n_seeds=2)
    good = pg.spread
    assert good.complete and pg.set(N=0) is False and pg.spread is good      # bad input keeps the last good spread
    assert pg.set(N=N, n_seeds=1)
    assert pg.set(n_prompts=len(PROMPTS) + 1) is False and "n_prompts" in pg.errors
    assert pg.set(n_prompts=1, sampling="greedy", n_seeds=2) is False and "greedy" in pg.errors["n_seeds"]
    ps = pairs(Settings(prompt=PROMPTS[1], n_prompts=2, n_seeds=3, seed=5), PROMPTS)
    assert [(p.prompt, p.seed) for p in ps] == [(PROMPTS[1], s) for s in (5, 6, 7)] + [(PROMPTS[0], s) for s in (5, 6, 7)]


# ------------------------------------------------------------------ MC gate: calibrated range, passes, p


def test_mc_threshold_is_calibrated_per_signal(pg):
    assert pg.set(policy="mc", mc_signal="u", mc_passes=3, mc_p=0.2, mc_every=2)
    cal = pg.mc_calibration()
    assert set(cal) == {"u", "mi", "flip"} and len(cal["u"]) > 0
    r = pg.mc_range()
    assert r.hi >= max(cal["u"]) and r.lo == 0 and r.hi / r.step <= 200
    # a newly chosen signal starts at its calibrated 90th percentile, on the slider's grid
    import numpy as np
    assert pg.settings.mc_threshold == pytest.approx(float(np.percentile(cal["u"], 90)), abs=r.step)
    assert pg.percentiles()["mc_threshold"] == pytest.approx(
        100 * sum(v <= pg.settings.mc_threshold for v in cal["u"]) / len(cal["u"]))
    gate = decode_config(pg.settings).refresh
    assert (gate.signal, gate.n_passes, gate.dropout_p, gate.probe_every) == ("u", 3, 0.2, 2)
    assert pg.set(mc_signal="mi")
    assert pg.settings.mc_threshold <= pg.mc_range().hi and pg.mc_range() != r
    assert pg.set(mc_passes=1) is False and "mc_passes" in pg.errors
    assert pg.set(mc_passes=3, mc_p=0.9) is False and "mc_p" in pg.errors


def test_nice_range_covers_the_top():
    r = nice_range(171.3)
    assert r.lo == 0 and r.hi >= 171.3 and r.step in (1.0, 2.0) and nice_range(1.7).hi >= 1.7


# ------------------------------------------------------------------ Conf-KV γ and H2O's recent window


def test_confkv_gamma_and_h2o_recent_reach_the_policy(pg):
    s = Settings(prompt="p", N=20, evict="confkv", budget=32)
    assert decode_config(s).evict.gamma == 0.9                       # the eviction experiments' γ, not 0.7
    assert decode_config(s.replace(gamma=0.75)).evict.gamma == 0.75
    h = decode_config(s.replace(evict="h2o", recent=5)).evict
    assert (h.budget, h.recent) == (32, 5)
    assert pg.set(evict="h2o", budget=24, recent=24) is False and "below budget" in pg.errors["recent"]
    assert pg.set(recent=6)
    assert pg.config(pg.settings, pg.student_for(0.3))["decode"]["evict"]["recent"] == 6
    assert pg.set(evict="confkv", gamma=1.5) is False and "gamma" in pg.errors


# ------------------------------------------------------------------ why a refresh fired


@pytest.mark.parametrize("policy", ["periodic", "entropy", "probe_kl", "speculative", "mc"])
def test_refresh_reasons_from_the_store_match_the_live_records(pg, policy):
    assert pg.set(policy=policy, T=3, k=3, M=2, kappa=0.0, tau_bits=0.5, mc_every=2, mc_threshold=0.0)
    sh = pg.shown
    assert sh.reasons, "each policy fires at these settings"
    pol = refresh_policy(pg.settings)
    views = Stepper(pg).run()
    assert all(v.why == pol.explain(v.record) for v in views)          # step-through says why (or why not)
    live = [(v.record.step, v.why) for v in views if v.refreshed]
    assert list(sh.reasons) == live == refresh_reasons(pol, sh.result["steps"])
    word = {"periodic": "T reached", "entropy": "entropy", "probe_kl": "probe KL", "speculative": "k=3",
            "mc": "MC mi"}[policy]
    assert all(word in w for _, w in sh.reasons)


def test_same_tokens_means_same_ppl_note(pg):
    sh = pg.shown
    same = {**sh.base, "refreshes": 2, "steps": {**sh.base["steps"], "refreshed": [True, True] + [False] * (N - 2)}}
    assert "same teacher-PPL" in same_tokens_note(same, sh.base)
    assert same_tokens_note(sh.base, sh.base) is None


# ------------------------------------------------------------------ pins, export, view details


def test_pin_overlays_and_export_writes_png_and_csv(pg, tmp_path):
    pytest.importorskip("ipywidgets")
    from kvlab.playground.export import export_view
    from kvlab.playground.view import MAX_PINS, T_PIN0, PlaygroundView

    v = PlaygroundView(pg)
    first = pg.pin()
    assert pg.set(T=2)
    assert pg.pinned == [first] and pg.shown.key != first.key
    e = v.fig.data[T_PIN0]
    assert e.visible and list(e.y) == pytest.approx(first.result["steps"]["entropy_bits"]) and "pin 1" in e.name
    assert v.table.value.count("kvlab-pin-teacher_ppl") == 1 and fmt(first.readouts["kl"], "g3") in v.table.value
    for T in (3, 5, 6, 7):
        assert pg.set(T=T)
        pg.pin()
    assert len(pg.pinned) == MAX_PINS
    pg.unpin()
    assert pg.pinned == [] and not v.fig.data[T_PIN0].visible
    pg.pin()
    assert pg.set(T=4)
    png, series, table = export_view(pg, tmp_path / "exp")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = list(csv.DictReader(open(series)))
    assert {r["role"] for r in rows} == {"run", "baseline", "pin 1"} and len(rows) == 3 * N
    ro = {r["readout"]: r for r in csv.DictReader(open(table))}
    assert float(ro["teacher_ppl"]["run"]) == pytest.approx(pg.shown.readouts["teacher_ppl"])
    assert float(ro["kl"]["pin 1"]) == pytest.approx(pg.pinned[0].readouts["kl"])


def test_view_plot_details(pg):
    pytest.importorskip("ipywidgets")
    from kvlab.playground.view import PlaygroundView

    v = PlaygroundView(pg)
    assert v.controls["mode"].description == "mode" and v.controls["sampling"].description == "sampling"
    assert v.fig.layout.yaxis2.rangemode == "tozero"
    shape = v.fig.layout.shapes[0]
    assert shape.x0 == pg.shown.prompt_len - 0.5 and "prompt | generated" in shape.label.text
    names = {t.name for t in v.fig.data if t.showlegend is not False}
    assert {"teacher-written entry", "student-written entry"} <= names
    assert v.fig.layout.legend.x >= 0.5                       # the legend sits on the plot, not above it
    pg.set(T=3)
    pg.set(T=4)                                               # stored: a store hit
    assert pg.shown.source == "disk"
    assert v.progress.layout.visibility == "hidden" and v.progress.value == 0
    page = v.status.value + v.progress_msg.value + v.table.value
    assert page.count("run store") == 1                       # the status line says it once
    assert "one sample, no spread" in v.table.value
    assert "why refreshes fired" in v.why.value and "emitted tokens" in v.why.value
    assert v.steps.reset()
    for _ in range(4):                                         # periodic T=4: step 4 refreshes
        v.steps.step_once()
    assert "why: T reached: step 4 is a multiple of T=4" in v.step_info.value and "emitted tokens" in v.step_info.value


# ------------------------------------------------------------------ the student switch (a trained variant per run)


def test_the_playground_switches_students(tiny_teacher, tiny_student, tmp_path):
    from kvlab.playground.controller import load_variant
    from kvlab.core.tiny import make_tiny_lm

    other = make_tiny_lm(seed=2, intermediate_size=48)
    p = Playground(tiny_teacher, students={0.3: tiny_student, "standalone": other}, store=RunStore(tmp_path),
                   background=False, prompts=PROMPTS, calib_prompts=["calibrate me"], calib_tokens=N,
                   settings=Settings(prompt=PROMPTS[0], N=N, policy="periodic", T=4, seed=3))
    assert p.student_variants == ("pruned", "standalone")
    p.start()
    assert p.config(p.settings, tiny_student)["student"] == tiny_student.fingerprint
    assert p.set(student="standalone")
    assert p.shown.result == p.store.get(p.config(p.settings, other))            # the run of that student
    assert p.shown.key != p.key(p.settings.replace(student="pruned"))
    assert "prune_ratio" not in p.settings.relevant() and "student standalone" in p.shown.label
    assert p.set(student="nonsense") is False and "student" in p.errors
    with pytest.raises(ValueError, match="student="):
        load_variant("nonsense", None)


def test_a_trained_student_missing_from_the_cache_is_a_control_error(tiny_teacher, tiny_student, tmp_path,
                                                                    monkeypatch):
    """The playground never trains: choosing a trained variant the model cache lacks marks the "student"
    control with the train-student command and loads nothing; once it is in the cache the choice is fine."""
    from kvlab.core.models import DEFAULT_SHAPE
    from kvlab.playground.students import student_problem, student_variants_offered
    from kvlab.train.weights import trained_dir

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))          # an empty model cache
    assert student_variants_offered() == ("pruned", "standalone", "overfill", "refresh-aware")
    assert student_problem("pruned") is None and "must be one of" in student_problem("nonsense")
    p = Playground(tiny_teacher, tiny_student, store=RunStore(tmp_path / "runs"), background=False, prompts=PROMPTS,
                   calib_prompts=["calibrate me"], calib_tokens=N, prune_ratios=(0.3,),
                   settings=Settings(prompt=PROMPTS[0], N=N, policy="periodic", T=4, seed=3))
    assert p.student_variants == student_variants_offered()
    assert p.set(student="overfill") is False
    assert f"python -m kvlab train-student --student overfill --prune {DEFAULT_SHAPE}" in p.errors["student"]
    assert p.students.loaded() == (("pruned", 0.3),)                    # nothing loaded, nothing trained
    assert not (tmp_path / "cache").exists()
    assert "student" not in p.check(p.settings.replace(mode="teacher"))    # the teacher alone needs no student
    target = trained_dir("overfill", DEFAULT_SHAPE)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")                            # it is in the cache now
    assert student_problem("overfill") is None and "student" not in p.check()


# ------------------------------------------------------------------ the controller's parts, alone


def test_run_reader_answers_from_disk_only_with_the_run_and_its_baseline_stored(tiny_teacher, tiny_student, tmp_path):
    """RunReader (kvlab.playground.reader) without a Playground: no key before the student is loaded, no
    disk answer while the baseline is missing, then the stored run and its stored baseline."""
    from kvlab.playground.reader import RunReader
    from kvlab.playground.students import StudentPool

    s = Settings(prompt=PROMPTS[0], N=N, policy="periodic", T=4, seed=3)
    pool = StudentPool(tiny_teacher, {0.3: tiny_student})
    reader = RunReader(tiny_teacher, StudentPool(tiny_teacher, {}), RunStore(tmp_path))
    assert reader.key(s) is None and reader.stored(s) is None and reader.from_disk(s, 0.0) is None
    assert reader.key(s.replace(mode="teacher", policy="none")) is not None     # the teacher needs no student
    reader = RunReader(tiny_teacher, pool, RunStore(tmp_path))
    assert reader.from_disk(s, 0.0) is None                                      # nothing stored yet
    run = reader.scored(s, tiny_student)
    assert reader.stored(s) == run and reader.from_disk(s, 0.0) is None          # the baseline is not stored
    base = reader.scored(s.baseline(), tiny_student)
    sh = reader.from_disk(s, 0.0)
    assert sh.source == "disk" and sh.result == run and sh.base == base and sh.key == reader.key(s)
    assert sh.readouts == readouts(run, base, "overfill") and sh.readouts["refreshes"] == 2
    assert len(sh.tokens) == N and sh.prompt_len == len(tiny_teacher.encode_prompt(PROMPTS[0]))


def test_pins_keep_the_newest_distinct_runs():
    from types import SimpleNamespace

    from kvlab.playground.compare import MAX_PINS, Pins

    pins = Pins()
    with pytest.raises(ValueError, match="nothing is shown"):
        pins.pin(None)
    runs = [SimpleNamespace(key=f"k{i}") for i in range(MAX_PINS + 2)]
    for r in runs:
        assert pins.pin(r) is r
    pins.pin(runs[-1])                                                          # pinned already: nothing changes
    assert [p.key for p in pins.runs] == [r.key for r in runs[-MAX_PINS:]]      # the oldest dropped first
    with pytest.raises(ValueError, match="key='k0' is not pinned"):
        pins.unpin("k0")
    pins.unpin(runs[-1].key)
    assert [p.key for p in pins.runs] == [r.key for r in runs[-MAX_PINS:-1]]
    pins.unpin()
    assert pins.runs == []


def test_render_readouts_table_without_widgets(pg):
    """kvlab.playground.render builds the panels' HTML from plain values (no ipywidgets): the table shows
    this run, its baseline, the signed difference and a column per pinned run other than the shown one."""
    from kvlab.playground.render import spread_html, table_html

    first = pg.pin()
    assert pg.set(T=2)
    sh = pg.shown
    page = table_html(sh, pg.pinned + [sh])                       # the shown run is never its own pin column
    assert page.count("kvlab-pin-teacher_ppl") == 1 and f"<span class='kvlab-run-key'>{sh.key}</span>" in page
    ro, base = sh.readouts["teacher_ppl"], sh.base_readouts["teacher_ppl"]
    assert f"<span class='kvlab-ro-teacher_ppl'>{fmt(ro, 'g3')}</span>" in page
    assert f"<span class='kvlab-base-teacher_ppl'>{fmt(base, 'g3')}</span>" in page and fmt(ro - base, "+g3") in page
    assert f"<span class='kvlab-pin-kl'>{fmt(first.readouts['kl'], 'g3')}</span>" in page
    assert "kvlab-pin-" not in table_html(sh) and spread_html(None) == ""
