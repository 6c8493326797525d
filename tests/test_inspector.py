"""The cache inspector (kvlab.viz.inspector) and its playground tab (kvlab.playground.inspection),
on tiny random models: its data equal the cache's per-layer live maps and attention statistics at every
step; the state rebuilt for any step t of a finished run equals what a live observation after step t
saw; the hover titles carry position, writer, score and eviction step; the playground shows the
inspector of an evicting run (watched live, or decoded again for a store hit) and says plainly that a
full-cache run has nothing to inspect."""
from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from kvlab.decode import DecodeConfig, Decoding
from kvlab.eviction import H2O, ConfKV, Scissorhands, SlidingWindow
from kvlab.viz.inspector import CacheInspector, score_stat, tokens_html
from kvlab.playground import Playground, Settings, decode_config
from kvlab.playground.inspection import NOTHING, Inspection
from kvlab.playground.render import inspect_html, png_html
from kvlab.refresh.policies import Periodic
from kvlab.store import RunStore

PROMPT = "the quick brown fox jumps over the lazy dog and then some more words follow here " * 2
N = 12


def _watch(decoding: Decoding, stat):
    """Drain ``decoding`` with an inspector; per step, what a live observation saw right then."""
    ins = CacheInspector(stat=stat)
    live = {}
    for rec in decoding:
        ins.observe(rec, decoding.cache)
        c = decoding.cache
        attn = c.layer_attn()
        live[rec.step] = {"lives": [list(x) for x in c.lives], "positions": c.layer_positions(),
                          "evicted": rec.evicted, "spliced": rec.spliced, "frame": ins.token_frame(), "survival": ins.survival(),
                          "stat": None if attn is None or stat is None else [t.tolist() for t in attn[stat]]}
    return ins, live


CASES = {
    "h2o-teacher": (H2O(16, 4, sinks=2), dict(mode="teacher")),
    "sliding-overfill-refresh": (SlidingWindow(16, sinks=4), dict(mode="overfill", refresh=Periodic(4))),
    "confkv-pyramidal": (ConfKV(gamma=0.5, tight=16, loose=20, protect=4, sinks=2, pyramidal=True), dict(mode="teacher")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inspector_matches_the_live_maps_at_every_step_and_rebuilds_any_step(tiny_teacher, tiny_student, case):
    policy, kw = CASES[case]
    cfg = DecodeConfig(max_new_tokens=N, chat=False, evict=policy, **kw)
    d = Decoding(tiny_teacher, tiny_student if kw["mode"] != "teacher" else None, PROMPT, cfg)
    stat = score_stat(policy)
    ins, live = _watch(d, stat)
    assert ins.steps == list(range(1, N + 1))
    assert sum(v["evicted"] for v in live.values()) > 0                       # the policy evicted
    for t, seen in live.items():
        # the live maps after step t, per layer, as the cache held them then
        assert [set(x) for x in ins.lives_at(t)] == [set(x) for x in seen["lives"]]
        pos, m = ins.survival(at=t)
        for l, held in enumerate(seen["positions"]):
            assert {p for p, keep in zip(pos, m[l]) if keep} == set(held)
        # the rebuilt state after step t is what the live observation after step t saw
        rp, rm = seen["survival"]
        assert pos == rp and np.array_equal(m, rm)
        pd.testing.assert_frame_equal(ins.token_frame(at=t), seen["frame"])
        frame = seen["frame"]
        assert list(frame.layers) == [sum(r in set(x) for x in seen["lives"]) for r in frame.row]
        # rows leaving layer 0 at step t: its evictions and the entries a refresh rewrote, as the record counts them
        assert sum(ins.left.get((r, 0)) == t for r in range(len(frame))) == seen["evicted"] + seen["spliced"]
        assert (frame.rewritten == t).sum() == seen["spliced"]
    # the last step's data are the cache's own, and scores on each layer equal its statistic
    last = live[N]
    if last["stat"] is not None:
        for l, rows in enumerate(last["lives"]):
            assert [ins.score[(r, l)] for r in rows] == pytest.approx(last["stat"][l])
    f = ins.token_frame()
    assert f[f.layers == 0].first_evicted.notna().all()
    assert f[f.layers == ins.num_layers].first_evicted.isna().all()
    if kw.get("refresh") is not None:   # the text shows each position once: the rewritten entries are left out
        assert f.rewritten.notna().any()
        page = tokens_html(f, ins.num_layers)
        assert page.count("<span") == f.rewritten.isna().sum() == len(set(f.position))
        assert tokens_html(f, ins.num_layers, rewritten=True).count("rewritten at step") == f.rewritten.notna().sum()
    if case.startswith("confkv"):  # pyramidal budgets per layer: the layers hold different entries
        assert any(len({tuple(x) for x in v["lives"]}) > 1 for v in live.values())


def test_the_score_at_step_t_is_the_statistic_the_cache_had_then(tiny_teacher):
    """Per (row, layer), the score rebuilt for step t is the cache's statistic after step t (live
    entries), or the one it had when last seen (gone ones)."""
    d = Decoding(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=N, chat=False,
                                                           evict=H2O(16, 4, sinks=2)))
    ins = CacheInspector(stat="acc")
    per_step, last_seen = {}, {}
    for rec in d:
        ins.observe(rec, d.cache)
        acc = d.cache.layer_attn()["acc"]
        for l, rows in enumerate(d.cache.lives):
            for r, v in zip(rows, acc[l].tolist()):
                last_seen[(r, l)] = v
        per_step[rec.step] = dict(last_seen)
    for t, want in per_step.items():
        frame = ins.token_frame(at=t).set_index("row")
        for r in frame.index:
            vals = [want[(r, l)] for l in range(ins.num_layers) if (r, l) in want]
            assert frame.score[r] == pytest.approx(np.mean(vals) if vals else float("nan"), nan_ok=True)


def test_hover_titles_carry_position_writer_score_and_eviction_step(tiny_teacher):
    d = Decoding(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=N, chat=False,
                                                           evict=H2O(16, 4, sinks=2)))
    ins, _ = _watch(d, "acc")
    f = ins.token_frame(tiny_teacher.tokenizer)
    page = tokens_html(f, ins.num_layers, score_name="accumulated attention")
    titles = re.findall(r'<span title="([^"]*)"', page)
    assert f.score.notna().sum() > ins.num_layers * 10        # most entries it saw have their score
    rows = f.sort_values("position", kind="stable")
    assert len(titles) == len(rows) == page.count("<span")
    for title, r in zip(titles, rows.itertuples()):
        assert title.startswith(f"position {r.position}, written by {r.writer} (")
        assert f"kept by {r.layers}/{ins.num_layers} layers" in title
        if pd.isna(r.score):      # gone before the inspector's first read (the prompt beyond the budget, at step 1)
            assert r.first_evicted == r.born and "no score (evicted in the step it was written" in title
        else:
            assert f"accumulated attention {r.score:.4g}" in title
        if pd.isna(r.first_evicted):
            assert "never evicted" in title
        else:
            assert f"evicted at step {int(r.first_evicted)}" in title
    # a token evicted at step s > t was never evicted as of step t
    row = f[f.first_evicted.notna() & (f.first_evicted > 1)].iloc[0]
    t = int(row.first_evicted) - 1
    at_t = ins.token_frame(at=t).set_index("row").loc[row.row]
    assert pd.isna(at_t.first_evicted) and at_t.layers > row.layers


def test_reading_a_step_the_inspector_did_not_see_is_refused(tiny_teacher):
    d = Decoding(tiny_teacher, None, PROMPT, DecodeConfig(mode="teacher", max_new_tokens=3, chat=False,
                                                           evict=SlidingWindow(16, sinks=4)))
    ins = CacheInspector(stat=None)
    with pytest.raises(ValueError, match="observe at least one step"):
        ins.survival()
    rec = next(iter(d))
    ins.observe(rec, d.cache)
    with pytest.raises(ValueError, match="observed already"):
        ins.observe(rec, d.cache)
    for bad in (0, 2, True, "1"):
        with pytest.raises(ValueError, match=r"at=.* must be an observed step, 1\.\.1"):
            ins.token_frame(at=bad)
    assert ins.token_frame().score.isna().all()          # no statistic: no score (a sliding window ranks by position)
    assert "no attention score" in tokens_html(ins.token_frame(), ins.num_layers)


def test_score_stat_is_what_each_policy_ranks_by():
    assert score_stat(H2O(16, 4)) == "acc"
    assert score_stat(ConfKV(tight=8, loose=16, protect=2)) == "ema"
    assert score_stat(Scissorhands(16, 4)) == "low"
    assert score_stat(SlidingWindow(16)) is None and score_stat(None) is None


# ------------------------------------------------------------------ the playground's inspector tab


@pytest.fixture
def pg(tiny_teacher, tiny_student, tmp_path):
    p = Playground(tiny_teacher, students={0.3: tiny_student}, store=RunStore(tmp_path / "runs"),
                   prompts=[PROMPT], calib_prompts=["calibrate me"], calib_tokens=N, background=False,
                   settings=Settings(prompt=PROMPT, mode="teacher", policy="none", N=N, seed=3))
    p.start()
    return p


def _direct(pg, s):
    """The run of settings ``s`` decoded here with an inspector (no playground involved)."""
    d = Decoding(pg.teacher, None, s.prompt, replace(decode_config(s), keep_dists=True))
    return _watch(d, score_stat(decode_config(s).evict))


def test_playground_inspects_an_evicting_run_and_says_a_full_cache_has_nothing(pg):
    events = []
    pg.subscribe(lambda e, p: events.append(p) if e == "inspect" else None)
    # the full cache: nothing to inspect, said plainly, and no decode needed for it
    assert pg.inspection.state == "full"
    v = pg.inspection.view()
    assert v.step is None and v.message == NOTHING and "nothing to inspect" in inspect_html(v)
    assert pg.inspect() is None and events[-1] is pg.inspection
    # an evicting run decoded now: the inspector watched it
    assert pg.set(evict="h2o", budget=16, recent=4), pg.errors
    ins = pg.inspection
    assert events[-1] is ins and ins.state == "ready" and ins.key == pg.shown.key
    assert ins.steps == list(range(1, N + 1))
    want, live = _direct(pg, pg.settings)
    assert sum(x["evicted"] for x in live.values()) > 0
    for t in ins.steps:
        v = ins.view(at=t)
        assert v.step == t and (v.first, v.last) == (1, N) and v.stat == "acc"
        pos, m = live[t]["survival"]
        assert list(v.positions) == pos and np.array_equal(v.survival, m)
        assert v.tokens_html.count("<span") == len(live[t]["frame"])
        assert f"after step {t}:" in v.message and "accumulated attention" in v.message
    with pytest.raises(ValueError, match=f"at={N + 1} must be an observed step"):
        ins.view(at=N + 1)
    png = ins.survival_png(at=3)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png_html(png).startswith("<img")
    # back to the full cache (a store hit), then to the stored evicting run: no history until inspect()
    assert pg.set(evict="full") and pg.inspection.state == "full"
    assert pg.set(evict="h2o") and pg.shown.source == "disk"
    assert pg.inspection.state == "stored" and "run store" in pg.inspection.view().message
    job = pg.inspect()                                   # decoded again, inline here
    assert job is not None and job.error is None
    again = pg.inspection
    assert again.state == "ready" and again.note == "" and events[-1] is again
    for t in again.steps:
        assert np.array_equal(again.view(at=t).survival, live[t]["survival"][1])
    assert pg.inspect() is None                          # already inspected: shown again at once


def test_inspector_tab_follows_its_step_slider(pg):
    pytest.importorskip("ipywidgets")
    from kvlab.playground.view import PlaygroundView

    v = PlaygroundView(pg)
    panel = v.inspector
    assert "nothing to inspect" in panel.text.value and panel.slider.layout.display == "none"
    assert panel.button.layout.display == "none"
    pg.set(evict="sliding", budget=16)
    assert (panel.slider.min, panel.slider.max, panel.slider.value) == (1, N, N)
    assert f"after step {N}:" in panel.text.value and "<img class='kvlab-inspect-map'" in panel.map.value
    panel.slider.value = 2
    assert "after step 2:" in panel.text.value
    assert panel.text.value.count("<span title=") == len(pg.inspection.inspector.token_frame(at=2))
    pg.set(evict="full")
    pg.set(evict="sliding")                                # a store hit: the button offers the re-decode
    assert pg.inspection.state == "stored" and panel.button.layout.display == ""
    panel.button.click()
    assert pg.inspection.state == "ready" and f"after step {N}:" in panel.text.value


def test_an_inspection_of_a_full_cache_needs_no_inspector():
    s = Settings(prompt=PROMPT)
    ins = Inspection(s, "k")
    assert ins.state == "full" and ins.steps == [] and ins.figure() is None and ins.survival_png() is None
    assert ins.view().message == NOTHING
