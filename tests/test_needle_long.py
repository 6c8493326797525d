"""RULER-style retrieval at long contexts (kvlab.studies.eviction.ruler / needle_long): generators, scorers,
Wilson intervals, one prefill per case, the table's columns, the CLI's errors. Tiny random models only."""
from __future__ import annotations

import argparse
import math

import pandas as pd
import pytest

from kvlab.studies.eviction import needle_long as nl
from kvlab.studies.eviction import needle_long_table as nt
from kvlab.studies.eviction import ruler

GRID = dict(lengths=(640,), n=2, budget=64, chunk=128)


def test_cases_are_deterministic_and_hold_their_needles(tiny_teacher):
    tok = tiny_teacher.tokenizer
    for task in ruler.TASKS:
        a, b = ruler.make_case(tok, task, 900, 0), ruler.make_case(tok, task, 900, 0)
        assert a == b
        assert ruler.make_case(tok, task, 900, 1).prompt != a.prompt
        assert ruler.make_case(tok, task, 900, 0, seed=1).prompt != a.prompt
        n = len(tok(a.prompt)["input_ids"])
        assert abs(n - 900) <= len(tok(ruler.FILLER)["input_ids"])          # within one filler sentence
        assert a.prompt.startswith(a.context) and a.prompt.endswith(a.question)
    single = ruler.make_case(tok, "niah_single", 900, 0)
    assert single.context.count("special magic numbers for") == 1 and single.answers[0] in single.context
    multi = ruler.make_case(tok, "niah_multikey", 900, 0)
    assert multi.context.count("One of the special magic numbers for") == ruler.DISTRACTORS + 1
    asked = multi.question.split("number for ")[1].split("?")[0]
    assert f"for {asked} is: {multi.answers[0]}." in multi.context
    mv = ruler.make_case(tok, "niah_multivalue", 900, 0)
    assert len(mv.answers) == ruler.VALUES and all(v in mv.context for v in mv.answers)
    vt = ruler.make_case(tok, "vt", 900, 0)
    names = vt.answers
    assert len(names) == ruler.HOPS + 1
    value = vt.question.split("the value ")[1].split(" ")[0]
    assert f"VAR {names[0]} = {value}." in vt.context
    pos = [vt.context.index(f"VAR {names[i + 1]} = VAR {names[i]}.") for i in range(ruler.HOPS)]
    assert pos == sorted(pos) and vt.context.index(f"VAR {names[0]} =") < pos[0]    # the chain in order


def test_generator_errors_name_the_parameter(tiny_teacher):
    with pytest.raises(ValueError, match="task="):
        ruler.make_case(tiny_teacher.tokenizer, "niah", 900, 0)
    with pytest.raises(ValueError, match="length="):
        ruler.make_case(tiny_teacher.tokenizer, "vt", 10, 0)
    with pytest.raises(ValueError, match="n="):
        ruler.make_cases(tiny_teacher.tokenizer, ["vt"], [900], 0)


def test_scorers_on_known_answers():
    s = ruler.score
    assert s("niah_single", " 71432. The", ["71432"]) == (1.0, 1.0)
    assert s("niah_single", " 714321", ["71432"]) == (0.0, 0.0)          # a longer number is wrong
    assert s("niah_single", " the number", ["71432"]) == (0.0, 0.0)
    assert s("niah_multikey", " 11111, not 71432", ["71432"]) == (0.0, 0.0)   # the first number counts
    assert s("niah_multivalue", " 44444, 11111, 33333 and 22222.", ["11111", "22222", "33333", "44444"]) == (1.0, 1.0)
    assert s("niah_multivalue", " 11111, 22222, 99999", ["11111", "22222", "33333", "44444"]) == (0.0, 0.5)
    assert s("vt", " ABCDE, FGHIJ, KLMNO, PQRST, UVWXY", ["ABCDE", "FGHIJ", "KLMNO", "PQRST", "UVWXY"]) == (1.0, 1.0)
    assert s("vt", " ABCDE, FGHIJX", ["ABCDE", "FGHIJ"]) == (0.0, 0.5)     # whole names only
    with pytest.raises(ValueError, match="task="):
        s("passkey", "1", ["1"])
    with pytest.raises(ValueError, match="answers"):
        s("vt", "A", [])


def test_wilson_on_known_values():
    lo, hi = nt.wilson(4, 30)
    assert (round(lo, 2), round(hi, 2)) == (0.05, 0.30)                   # the 4/30
    assert math.isclose(lo, 0.053, abs_tol=1e-3) and math.isclose(hi, 0.297, abs_tol=1e-3)
    lo, hi = nt.wilson(0, 10)
    assert lo == 0.0 and math.isclose(hi, 0.2775, abs_tol=1e-4)
    lo, hi = nt.wilson(10, 10)
    assert math.isclose(lo, 0.7225, abs_tol=1e-4) and math.isclose(hi, 1.0)
    lo, hi = nt.wilson(30, 60)
    assert math.isclose(lo + hi, 1.0, abs_tol=1e-12) and math.isclose(lo, 0.3773, abs_tol=1e-3)


def test_one_prefill_per_case_and_resume(tiny_teacher, tmp_path, monkeypatch):
    from kvlab.store import RunStore

    calls = []
    real = nl.prefill
    monkeypatch.setattr(nl, "prefill", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    grid = nl.LongGrid(tasks=("niah_single",), **GRID)
    store = RunStore(tmp_path)
    runs = nl.run_grid(tiny_teacher, grid, store, progress=False)
    cases = len(grid.tasks) * grid.n
    assert len(calls) == cases                                # one prefill per case, every policy and setting
    assert len(runs) == cases * len(nl.POLICIES) * len(nl.SETTINGS)
    assert store.stats.computed == len(runs)
    again = nl.run_grid(tiny_teacher, grid, store, progress=False, time_limit=0)
    assert len(calls) == cases                                # all stored: no prefill at all
    pd.testing.assert_frame_equal(runs.drop(columns=["decode_s"]), again.drop(columns=["decode_s"]))
    # every policy's peak is the budget (SnapKV streamed: its cut leaves at least its window + 1, and the tiny
    # tokenizer's question alone is longer than the budget)
    evicting = runs[(runs.policy != "full") & ~((runs.policy == "snapkv") & (runs.setting == "streamed"))]
    assert (evicting.max_cache_len <= grid.budget).all()
    assert (runs[runs.policy == "full"].mean_cache_len > grid.budget).all()


def test_branch_equals_a_run_of_its_own(tiny_teacher, tmp_path):
    """The full cache and the sliding window branched from the shared prefill answer as a run of the whole
    prompt alone does (prefill setting)."""
    from kvlab.decode import DecodeConfig, Sampling, run
    from kvlab.store import RunStore

    grid = nl.LongGrid(tasks=("niah_single",), policies=("full", "sliding"), settings=("prefill",), **GRID)
    case = ruler.make_case(tiny_teacher.tokenizer, "niah_single", 640, 0)
    got = {r["policy"]: r for r in nl.case_runs(tiny_teacher, case, grid, RunStore(tmp_path))}
    for name in ("full", "sliding"):
        cfg = DecodeConfig(mode="teacher", max_new_tokens=case.answer_tokens, sampling=Sampling(), chat=False,
                           evict=nl.policy(name, 64, case.answer_tokens))
        assert run(tiny_teacher, None, case.prompt, cfg).text == got[name]["text"]   # (no newline: all tokens)


def test_window_branch_keeps_every_entry(tiny_teacher):
    import torch

    case = ruler.make_case(tiny_teacher.tokenizer, "niah_single", 640, 0)
    hay, _ = nl.question_ids(tiny_teacher, case)
    base, logits = nl.prefill(tiny_teacher, hay, None, 128)
    track = nl.tracker(nl.policy("snapkv", 64, 8))
    cache, wl = nl.window_branch(tiny_teacher, base, hay, track)
    assert list(cache.positions) == list(base.positions) and cache.token_ids == base.token_ids
    assert torch.allclose(wl, logits, atol=1e-4)
    acc = cache.layer_attn()["acc"][0]
    assert acc[: len(hay) - track["window"]].sum() > 0        # the window's mass reaches the older entries


def test_table_columns_and_cells():
    rows = []
    for task, full_ok in (("niah_single", 1.0), ("vt", 0.0)):
        for pol, ok in (("full", full_ok), ("sliding", 0.0)):
            for rep in range(5):
                rows.append({"task": task, "setting": "prefill", "policy": pol, "length": 2048, "rep": rep,
                             "correct": ok if rep else 1.0, "partial": ok, "mean_cache_len": 10.0,
                             "max_cache_len": 10, "budget": 256})
    pooled, table, cells = nt.long_table(pd.DataFrame(rows), threshold=0.8)
    assert {"setting", "policy", "length", "accuracy", "n", "ci_lo", "ci_hi", "task"} <= set(pooled.columns)
    assert {"setting", "policy", "length", "accuracy", "n", "ci_lo", "ci_hi", "task"} <= set(table.columns)
    assert set(table.task) == {"niah_single"}                   # vt: the full cache fails, the cell is out
    assert len(pooled) == len(pooled.groupby(["setting", "policy", "length"]).size())   # one row per (s, p, L)
    assert pooled.task.tolist() == ["niah_single"] * 2
    assert cells.set_index("task").kept.to_dict() == {"niah_single": True, "vt": False}
    assert cells.set_index("task").accuracy["vt"] == pytest.approx(0.2)
    sl = table[table.policy == "sliding"].iloc[0]
    assert (sl.accuracy, sl.n) == (0.2, 5) and (sl.ci_lo, sl.ci_hi) == pytest.approx(nt.wilson(1, 5))
    with pytest.raises(ValueError, match="full"):
        nt.long_table(pd.DataFrame(rows).query("policy != 'full'"))


def test_cli_names_match_the_study():
    from kvlab.studies.eviction import cli_long

    assert cli_long.TASKS == ruler.TASKS and cli_long.POLICIES == nl.POLICIES


@pytest.mark.parametrize("argv, msg", [
    (["--lengths", "2048,x"], "--lengths"),
    (["--tasks", "passkey"], "--tasks"),
    (["--policies", "sliding,lru"], "--policies"),
    (["--settings", "both"], "--settings"),
    (["--n", "0"], "--n"),
    (["--n", "5,x"], "--n"),
])
def test_bad_flags_are_refused(argv, msg, capsys):
    from kvlab.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["needle-long", *argv])
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("kw, msg", [
    ({"lengths": (2048,), "budget": 4096}, "budget"),
    ({"lengths": (16384,)}, "lengths"),
    ({"threshold": 1.5}, "threshold"),
    ({"policies": ("full", "lru")}, "policies"),
    ({"n": (5, 3)}, "n"),
    ({"screen": -1}, "screen"),
])
def test_bad_grids_name_the_flag(kw, msg):
    from kvlab.studies.eviction.cli_long import grid_of

    base = dict(tasks=ruler.TASKS, lengths=(2048,), n=2, budget=256, policies=nl.POLICIES, settings=nl.SETTINGS,
                gamma=0.9, threshold=0.8, chunk=1024, seed=0, screen=5)
    with pytest.raises(SystemExit, match=msg):
        grid_of(argparse.Namespace(**{**base, **kw}))


def test_main_job_size_is_a_valid_grid(monkeypatch):
    from kvlab import cli
    from kvlab.studies.eviction import cli_long

    got = []
    monkeypatch.setattr(cli_long, "cmd_needle_long", lambda ns: got.append((cli_long.grid_of(ns), ns.out)) or [])
    args = cli.build_parser().parse_args(["all"])
    assert ("needle-long", cli_long.needle_long_small) in cli.JOBS
    cli_long.needle_long_small(args)
    grid, out = got[0]
    assert grid.lengths == (2048,) and grid.n == cli_long.ALL_SIZE["n"] and grid.policies == nl.POLICIES
    assert out == args.out / "reduced"         # the committed table is a longer run's: left as it is


def test_screen_stops_cells_the_full_cache_fails(tiny_teacher, tmp_path):
    """A random tiny model retrieves nothing: with screen=1 every cell stops after its first case; n per length."""
    from kvlab.store import RunStore

    grid = nl.LongGrid(tasks=("niah_single",), lengths=(640, 700), n=(3, 2), budget=64, chunk=256,
                       policies=("full", "sliding"), settings=("prefill",), screen=1)
    assert (grid.n_at(640), grid.n_at(700)) == (3, 2)
    runs = nl.run_grid(tiny_teacher, grid, RunStore(tmp_path), progress=False)
    assert sorted(runs.groupby("length").rep.max().items()) == [(640, 0), (700, 0)]
    unscreened = nl.LongGrid(**{**grid.__dict__, "screen": 0})
    stored = nl.run_grid(tiny_teacher, unscreened, RunStore(tmp_path), progress=False, time_limit=0)
    assert stored.groupby("length").rep.nunique().to_dict() == {640: 1, 700: 1}     # time_limit 0: stored only
    off = nl.run_grid(tiny_teacher, unscreened, RunStore(tmp_path), progress=False)
    assert off.groupby("length").rep.nunique().to_dict() == {640: 3, 700: 2}


def test_key_results_quote_retrieval_with_wilson_intervals_outside_the_difference_audit(tmp_path):
    """README's key rows for needle-long: one per setting over its lengths with n >= 2, each policy as hits/n with its
    Wilson interval under its length; a n = 1 pilot gives none (a n = 1 length leaves the row), and the audit of
    paired-difference intervals does not count them."""
    import pandas as pd

    from kvlab.harness.intervals import audit_intervals
    from kvlab.studies.eviction.quotes import _needle_long_rows

    rows = [{"setting": st, "policy": p, "length": length, "accuracy": acc, "n": 60, "ci_lo": lo, "ci_hi": hi,
             "task": "niah_single", "budget": 256}
            for st in ("prefill", "streamed") for length in (2048, 4096)
            for p, acc, lo, hi in (("full", 1.0, 0.94, 1.0), ("snapkv", 0.5, 0.38, 0.62))]
    pd.DataFrame(rows).to_csv(tmp_path / "evict_needle_long.csv", index=False)
    got = _needle_long_rows(tmp_path)
    assert [r[0] for r in got] == [f"Retrieval at 2,048 and 4,096 tokens (niah_single, at most 256 entries, n = 60 "
                                   f"cases per length), {s} setting: exact match" for s in ("prefill", "streamed")]
    cells = "full 1.00 (60/60; Wilson 0.94 to 1.00), snapkv 0.50 (30/60; Wilson 0.38 to 0.62)"
    assert got[0][1] == f"**2,048 tokens:** {cells} **4,096 tokens:** {cells}"
    table = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in got)
    assert audit_intervals(table) == []
    pilot = [{**r, "n": 1} if r["length"] == 4096 else r for r in rows]
    pd.DataFrame(pilot).to_csv(tmp_path / "evict_needle_long.csv", index=False)
    assert [r[1] for r in _needle_long_rows(tmp_path)] == [f"**2,048 tokens:** {cells}"] * 2
    pd.DataFrame([{**r, "n": 1} for r in rows]).to_csv(tmp_path / "evict_needle_long.csv", index=False)
    assert _needle_long_rows(tmp_path) == []
