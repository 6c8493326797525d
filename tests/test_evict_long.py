"""The long-context eviction study (``evict-long``, issue 36 item 5) on tiny random models: end to end, one prefill
per prompt, branches from copies, the table's columns, Conf-KV's frac_at_loose, bad flags; the shipped texts."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlab.store import RunStore
from kvlab.studies.eviction.long import Prompt, forced_branch, prefill_bases, run_prompt, stat_key
from kvlab.studies.eviction.long_policies import long_policies
from kvlab.studies.eviction.long_tables import COLS, LongStudy, long_runs, long_table

ROOT = Path(__file__).resolve().parents[1]


def _docs(n=5, chars=700, seed=0):
    rng = random.Random(seed)
    return [{"id": f"d{i}", "text": "".join(rng.choice("abcdefghij klmnop.") for _ in range(chars))} for i in range(n)]


def _study(**kw):
    return LongStudy(**{"contexts": (200,), "prompts": 5, "tokens": 6, "budgets": (96,), "gap": 4, **kw})


@pytest.fixture(scope="module")
def tiny3():
    from kvlab.core.tiny import make_tiny_lm

    with torch.random.fork_rng():
        return make_tiny_lm(seed=0, layers=3)


def test_end_to_end_table_and_resume(tiny3, tmp_path):
    study = _study()
    calls = []
    per_run = long_runs(tiny3, study, RunStore(tmp_path / "runs"), docs=_docs(), progress=False,
                        on_forward=calls.append)
    table = long_table(per_run)
    assert list(table.columns) == COLS
    names = set(table.policy)
    assert {"full", "sliding_b96", "streamingllm_b96", "h2o_b96", "scissorhands_b96", "snapkv_b96", "pyramidkv_b96",
            "block_b96", "confkv_l_b96", "confkv_int8_b96", "confkv_l_fixed_b96"} == names
    assert (table.n_prompts == 5).all() and (table.context == 200).all()
    full = table[table.policy == "full"].iloc[0]
    assert full.kl_forced == 0.0 and full.gap_closed == pytest.approx(1.0)
    ev = table[table.policy != "full"]
    assert (ev.kl_forced > 0).all() and (ev.mean_len < full.mean_len).all()
    conf = table.family.str.startswith("confkv")
    assert table.loc[conf & (table.family != "confkv_l_fixed"), "frac_at_loose"].between(0, 1).all()
    assert table.loc[~conf | (table.family == "confkv_l_fixed"), "frac_at_loose"].isna().all()
    h2o = table[table.policy == "h2o_b96"].iloc[0]
    assert h2o.baseline == "sliding_b96" and h2o.d_kl_forced_lo <= h2o.d_kl_forced <= h2o.d_kl_forced_hi
    assert h2o.d_kl_forced_mde > 0 and h2o.partner == "confkv_l_b96"
    # the control holds Conf-KV-L's mean length on every prompt (one fixed budget, same memory)
    ctl = per_run[per_run.policy == "confkv_l_fixed_b96"].set_index("prompt_idx").mean_len
    ckv = per_run[per_run.policy == "confkv_l_b96"].set_index("prompt_idx").mean_len
    assert (ctl - ckv).abs().max() <= 1.0
    # a rerun reuses every stored row: no forward at all
    calls.clear()
    again = long_runs(tiny3, study, RunStore(tmp_path / "runs"), docs=_docs(), progress=False, on_forward=calls.append)
    assert calls == [] and len(again) == len(per_run)
    assert long_table(again).kl_forced.tolist() == pytest.approx(table.kl_forced.tolist())
    # --stored-only: more prompts asked than stored: only the stored ones count, nothing runs
    more = long_runs(tiny3, _study(prompts=6), RunStore(tmp_path / "runs"), docs=_docs(6), progress=False,
                     on_forward=calls.append, stored_only=True)
    assert calls == [] and (long_table(more).n_prompts == 5).all()
    # the figure to pick a policy from: mean length on x without a bench timing, tok/s with one
    from kvlab.studies.eviction.long_plots import _draw, add_speed, bench_speed

    assert bench_speed(tmp_path) == {}
    (tmp_path / "evict_batch_bench_timing.jsonl").write_text(
        "\n".join(json.dumps({"policy": p, "batch": 8, "cache_len": 200, "tok_s": t})
                  for p, t in (("full", 10.0), ("sliding", 20.0), ("h2o", 15.0))) + "\n")
    sped = add_speed(table, bench_speed(tmp_path))
    assert sped.set_index("policy").tok_s_b8["sliding_b96"] == 20.0 and sped.tok_s_b8.isna().sum() > 0
    for t in (table, sped):
        fig = _draw({"evict_long": t}, 200)
        assert fig.axes and fig.axes[0].get_ylabel().startswith("KL")
    assert _draw({"evict_long": table}, 4096) is None          # a context the table lacks: no figure


def test_prefill_once_per_prompt_whatever_the_policies(tiny3):
    """Long forwards (more than the observation window) per prompt: the shared plain prefix and one prefill per
    whole-context statistics setting; adding policies of present settings adds none, and each branch runs
    one-token steps only."""
    case = Prompt("d0", 200, tuple(3 + i % 120 for i in range(200)), tuple(range(10, 17)))
    few = {"full": None, **long_policies(96, tokens=6, families=("sliding", "h2o"))}
    many = {"full": None, **long_policies(96, tokens=6, gap=4)}
    counts = []
    for pols in (few, many):
        calls = []
        run_prompt(tiny3.model, case, pols, on_forward=calls.append)
        counts.append([n for n in calls if n > 32])
        assert all(n == 1 or n > 1 for n in calls)
        steps = [n for n in calls if n == 1]
        assert len(steps) >= (len(pols) - 1) * (len(case.cont) - 2)
    assert len(counts[0]) == 2 and len(counts[1]) == 2          # plain prefix + whole-context statistics prefill
    assert all(max(c) == 200 and sum(c) <= 2 * 200 for c in counts)     # the prefix: the context less the window


def _snapshot(cache):
    k, v = cache.kv(0)
    return len(cache), cache.layer_lengths(), k.clone(), v.clone()


def test_branches_copy_and_leave_the_base_unchanged(tiny3):
    ctx = [3 + i % 120 for i in range(200)]
    pols = long_policies(96, tokens=6, gap=4)
    bases = prefill_bases(tiny3.model, ctx, pols)
    before = {k: _snapshot(c) for k, c in bases.items()}
    cont = list(range(10, 17))
    key = stat_key(pols["h2o_b96"])
    c1 = bases[key].copy()
    logits = c1.forward(tiny3.model, [cont[0]], writer="teacher", step=1, attention=True)
    snap1 = _snapshot(c1)
    res = forced_branch(tiny3.model, None, (c1, logits), pols["h2o_b96"], cont, torch.zeros(6, logits.shape[-1]),
                        None)
    assert res["mean_len"] < 100
    for k, c in bases.items():
        n, lens, kk, vv = _snapshot(c)
        assert (n, lens) == before[k][:2] and torch.equal(kk, before[k][2]) and torch.equal(vv, before[k][3])
    assert _snapshot(c1)[:2] == snap1[:2] and torch.equal(_snapshot(c1)[2], snap1[2])


def test_shared_prefills_give_each_policy_its_own_statistics(tiny3):
    """The windowed settings finish a shared plain prefix with the last W queries; the whole-context setting
    tracks ``below`` for Scissorhands: both equal a cache prefilled alone with the policy's own settings."""
    from kvlab.cache import KVCache
    from kvlab.studies.bench.evict_batch import _track

    ctx = [3 + i % 120 for i in range(200)]
    pols = long_policies(96, tokens=6, gap=4)
    bases = prefill_bases(tiny3.model, ctx, pols)
    for name in ("snapkv_b96", "block_b96", "h2o_b96", "confkv_l_b96"):
        alone = KVCache()
        _track(alone, pols[name])
        alone.forward(tiny3.model, ctx, writer="teacher", attention=True)
        got, want = bases[stat_key(pols[name])].layer_attn(), alone.layer_attn()
        for stat in ("acc", "ema", "count"):
            for a, b in zip(got[stat], want[stat]):
                assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-4), (name, stat)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="8,192"):
        LongStudy(contexts=(9000,))
    with pytest.raises(ValueError, match="budgets"):
        LongStudy(contexts=(256,), budgets=(256,))
    with pytest.raises(ValueError, match="confkv-gap"):
        LongStudy(gap=400)
    with pytest.raises(ValueError, match="families"):
        long_policies(256, tokens=32, families=("nope",))
    with pytest.raises(ValueError, match="prompts"):
        LongStudy(prompts=0)


@pytest.mark.parametrize("flags, needle", [(["--contexts", "2k"], "--contexts"), (["--families", "h2o,bogus"], "bogus"),
                                           (["--budgets", "0"], "--budgets")])
def test_cli_flags_give_clear_errors(flags, needle):
    r = subprocess.run([sys.executable, "-m", "kvlab", "evict-long", *flags], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 2 and needle in r.stderr


def test_shipped_texts_are_long_and_disjoint_from_the_prompt_sets():
    from kvlab.studies.eviction.long_texts import load_texts

    docs = load_texts()
    assert len(docs) >= 32 and len({d["id"] for d in docs}) == len(docs)
    try:
        from transformers import AutoTokenizer

        from kvlab.core.models import teacher_path

        tok = AutoTokenizer.from_pretrained(teacher_path(), local_files_only=True)
    except Exception:                                                  # noqa: BLE001 - no embedded model here
        tok = None
    if tok is not None:
        assert min(len(tok(d["text"])["input_ids"]) for d in docs) >= 8192 + 33
    words = lambda t: re.findall(r"\w+", t.lower())                    # noqa: E731
    grams = set()
    for name in ("prompts.jsonl", "train_prompts.jsonl", "calibration.jsonl"):
        for line in (ROOT / "data" / name).read_text().splitlines():
            if line.strip():
                w = words(json.dumps(json.loads(line)))
                grams |= {tuple(w[i:i + 12]) for i in range(len(w) - 11)}
    for d in docs:
        w = words(d["text"])
        assert not any(tuple(w[i:i + 12]) in grams for i in range(len(w) - 11)), d["id"]


def test_batched_rows_equal_rows_one_by_one(tiny3):
    """The full-precision rows step together in one batched forward (Bank + forward_rows): the same numbers as
    each row alone (INT8 rows run alone either way)."""
    case = Prompt("d0", 200, tuple(3 + (7 * i) % 120 for i in range(200)), tuple(range(10, 17)))
    pols = {"full": None, **long_policies(96, tokens=6, gap=4)}
    a = run_prompt(tiny3.model, case, pols, batch=True)
    b = run_prompt(tiny3.model, case, pols, batch=False)
    assert set(a) == set(b)
    for name in a:
        ra, rb = a[name][1], b[name][1]
        assert ra["mean_len"] == rb["mean_len"], name
        assert ra["kl_forced"] == pytest.approx(rb["kl_forced"], rel=1e-3, abs=1e-7), name
        assert ra["nll"] == pytest.approx(rb["nll"], rel=1e-5), name


def test_main_job_writes_its_smaller_run_under_reduced(monkeypatch):
    """`kvlab all` runs evict-long below the committed table's size: under OUT/reduced, its speed columns read from
    OUT's bench timing, so make figures leaves figures/evict_long.csv (the longer run's) as it is."""
    from kvlab import cli
    from kvlab.studies.eviction import long_cli

    seen = {}
    monkeypatch.setattr(long_cli, "cmd_evict_long", lambda ns: seen.update(vars(ns)) or [])
    args = cli.build_parser().parse_args(["all"])
    assert ("evict-long", long_cli.evict_long_small) in cli.JOBS
    long_cli.evict_long_small(args)
    assert seen["out"] == args.out / "reduced" and seen["bench"] == args.out
    assert seen["contexts"] == long_cli.ALL_CONTEXTS and seen["prompts"] == long_cli.ALL_PROMPTS


def test_a_context_the_table_lacks_draws_no_figure(tmp_path):
    """The figures step renders every registered figure: evict_long_<context> for a context the table does not hold
    writes nothing (it used to write an empty evict_long_8192.png beside a 2,048/4,096-token table)."""
    import pandas as pd

    from kvlab.harness.figures import render
    from kvlab.studies.eviction import long_plots  # noqa: F401  (registers the figures)

    pd.DataFrame([{"context": 2048, "policy": "full", "family": "full", "budget": 0}]).to_csv(
        tmp_path / "evict_long.csv", index=False)
    assert render("evict_long_8192", tmp_path) is None and not (tmp_path / "evict_long_8192.png").exists()
