"""Tables decode missing runs in batches: same rows as one run at a time, same store keys."""
from __future__ import annotations

import pytest

from kvlab.decode import DecodeConfig, Sampling
from kvlab.eviction import H2O
from kvlab.refresh.policies import Periodic
from kvlab.store import RunStore
from kvlab.harness.experiment import RunSpec, check_batch, run_policies, scored_runs

PROMPTS = ("the quick brown fox", "sky", "jumps over the lazy dog and more", "a b c d")
POLICIES = {"teacher": DecodeConfig(mode="teacher", chat=False), "overfill": DecodeConfig(mode="overfill", chat=False),
            "periodic": DecodeConfig(mode="overfill", chat=False, refresh=Periodic(4)),
            "h2o": DecodeConfig(mode="teacher", chat=False, evict=H2O(10, 3))}
SPEC = dict(prompts=PROMPTS, tokens=10, sampling=Sampling(temperature=0.8, top_p=0.9, seed=3))
QUALITY = ["tokens", "teacher_ppl", "kl", "kl_all", "repeat3", "tail_logprob", "chars", "refreshes", "spliced",
           "teacher_tokens"]


def test_batched_table_rows_equal_unbatched_and_share_keys(tiny_teacher, tiny_student, tmp_path):
    a, b = RunStore(tmp_path / "a"), RunStore(tmp_path / "b")
    batched = run_policies(tiny_teacher, tiny_student, RunSpec(**SPEC, batch=3), POLICIES, a, progress=False)
    single = run_policies(tiny_teacher, tiny_student, RunSpec(**SPEC, batch=1), POLICIES, b, progress=False)
    assert a.stats.computed == b.stats.computed == len(PROMPTS) * len(POLICIES)
    assert list(batched.policy) == list(single.policy) and list(batched.prompt_idx) == list(single.prompt_idx)
    for col in QUALITY:
        assert batched[col].tolist() == pytest.approx(single[col].tolist(), rel=1e-4, abs=1e-4), col
    assert a.ok_keys() == b.ok_keys()                       # the batch size is not part of a run's key
    again = run_policies(tiny_teacher, tiny_student, RunSpec(**SPEC, batch=1), POLICIES, a, progress=False)
    assert a.stats.computed == len(PROMPTS) * len(POLICIES) and a.stats.reused == len(again)


def test_scored_runs_mixes_stored_and_missing(tiny_teacher, tiny_student, tmp_path):
    store = RunStore(tmp_path)
    cfg = DecodeConfig(mode="overfill", chat=False, max_new_tokens=6)
    first = scored_runs(tiny_teacher, tiny_student, [(PROMPTS[1], cfg)], store, batch=1)
    both = scored_runs(tiny_teacher, tiny_student, [(p, cfg) for p in PROMPTS[:3]], store, batch=4)
    assert both[1]["text"] == first[0]["text"] and store.stats.reused == 1 and store.stats.computed == 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "8"])
def test_bad_batch_refused(bad):
    with pytest.raises(ValueError, match="--batch"):
        check_batch(bad)
    with pytest.raises(ValueError, match="--batch"):
        RunSpec(prompts=("x",), batch=bad)


def test_bench_decode_batch_rows(tiny_teacher, tiny_student):
    """The benchmark's rows (fields only: timings are never asserted)."""
    from kvlab.studies.bench.bench import bench_decode_batch

    rows = bench_decode_batch(tiny_teacher, list(PROMPTS), [1, 2], tokens=3, repeats=1, student=tiny_student,
                              variants=2)
    plain = [r for r in rows if r["mode"] == "teacher"]
    assert [r["batch"] for r in plain] == [1, 2]
    for r in plain:
        assert {"batch", "mode", "kvlab_tok_s", "hf_tok_s", "ratio", "peak_rss_mb"} <= set(r)
        assert r["ratio"] == pytest.approx(r["kvlab_tok_s"] / r["hf_tok_s"], rel=0.01)
    assert {r["mode"] for r in rows} == {"teacher", "evict:h2o", "evict:confkv", "refresh:periodic27"}
    with pytest.raises(ValueError, match="--batch 8 needs 8 prompts"):
        bench_decode_batch(tiny_teacher, list(PROMPTS), [8], tokens=2)


def test_bench_evict_batch_rows(tiny_teacher):
    from kvlab.studies.bench.bench import bench_evict_batch

    rows = bench_evict_batch(tiny_teacher, [1, 2], cache_len=64, steps=3, repeats=1)
    names = ("full", "sliding", "h2o", "scissorhands", "snapkv", "block", "confkv")
    assert {(r["batch"], r["policy"]) for r in rows} == {(b, p) for b in (1, 2) for p in names}
    assert all(r["final_len"] <= 67 for r in rows)
    for r in rows:
        for k in ("policy", "batch", "cache_len", "final_len", "tok_s", "speedup_vs_full", "bound", "frac_of_bound",
                  "evict_vs_plain"):
            assert k in r, k
        assert r["frac_of_bound"] == pytest.approx(r["speedup_vs_full"] / r["bound"], abs=2e-3)
        assert r["plain_frac_of_bound"] > 0           # the plain step's own fraction: this machine's ceiling
    # asked at every step, the policies that decide over columns run resident (kvlab.cache.resident)
    assert {r["policy"] for r in rows if r["resident"]} == {"sliding", "h2o", "scissorhands", "block", "confkv"}
    full = [r for r in rows if r["policy"] == "full"]
    assert all(r["bound"] == 1.0 for r in full)
    assert all(r["speedup_vs_full"] == 1.0 and r["full_ms"] == r["step_ms"] for r in full)
    for r in rows:                  # the full cache is timed beside each policy, in the policy's own block
        # (full_ms and step_ms are kept to 0.01 ms: on a fast CPU the tiny model's steps take about half a ms)
        slack = 0.005 / r["full_ms"] + 0.005 / r["step_ms"]
        assert r["speedup_vs_full"] == pytest.approx(r["full_ms"] / r["step_ms"], rel=0.01 + slack)
    lib = bench_evict_batch(tiny_teacher, [2], cache_len=64, steps=3, repeats=1, names=["full", "h2o"],
                            resident=False)
    assert [(r["policy"], r["resident"]) for r in lib] == [("full", False), ("h2o", False)]
    res = {r["policy"]: r for r in rows if r["batch"] == 2}
    assert lib[1]["final_len"] == res["h2o"]["final_len"] and lib[1]["mean_len"] == res["h2o"]["mean_len"]
    two = bench_evict_batch(tiny_teacher, [1], cache_len=[64, 80], steps=2, repeats=1,
                            policies={"full": __import__("kvlab").eviction.FullCache()})
    assert [r["cache_len"] for r in two] == [64, 80]
    with pytest.raises(ValueError, match="--batch"):
        bench_evict_batch(tiny_teacher, [0], cache_len=64)


@pytest.mark.parametrize("name", ["h2o", "scissorhands", "confkv", "snapkv"])
def test_bench_attention_prefill_in_chunks_measures_what_one_forward_does(tiny_teacher, name, monkeypatch):
    """bench evict's attention prefill runs in chunks (a long prompt's scores stay (H, chunk, T)) only where chunks
    compose: the statistics equal one forward's (counts exact up to a share sitting on 1/T_i); SnapKV's observation
    window is one forward's, so its prefill stays one forward."""
    import torch

    from kvlab.studies.bench.evict_batch import _settings, attention_prefill, batch_evict_policies

    pol = batch_evict_policies(64)[name]
    vocab = int(tiny_teacher.model.get_input_embeddings().weight.shape[0])
    ids = torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    from kvlab.cache import KVCache

    one = attention_prefill(tiny_teacher.model, ids, pol, chunk=len(ids))
    sizes, forward = [], KVCache.forward
    monkeypatch.setattr(KVCache, "forward", lambda self, model, tok, **kw: sizes.append(len(tok)) or forward(
        self, model, tok, **kw))
    parts = attention_prefill(tiny_teacher.model, ids, pol, chunk=7)
    monkeypatch.undo()
    window = _settings(pol)[1] is not None
    assert sizes == ([len(ids)] if window else [7] * 5 + [5])      # chunked exactly where the statistics compose
    a, b = parts.layer_attn(), one.layer_attn()
    assert set(a) == set(b) and parts.layer_lengths() == one.layer_lengths() == [len(ids)] * len(a["acc"])
    for stat in a:
        for x, y in zip(a[stat], b[stat]):
            if stat == "low":
                assert int((x != y).sum()) <= 1
            else:
                torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    if window:                                                      # a window: one forward, whatever the chunk
        assert all(torch.equal(x, y) for s in a for x, y in zip(a[s], b[s]))


def test_bench_evict_batch_interval_and_names(tiny_teacher):
    """``names`` picks policies of the default set; every row carries its paired periods and, from 3 periods on, a
    bootstrap interval of evicting / plain that holds the point estimate."""
    from kvlab.studies.bench.bench import bench_evict_batch

    rows = bench_evict_batch(tiny_teacher, [2], cache_len=64, steps=4, repeats=2, names=["full", "h2o"], every=[1, 2])
    assert [(r["policy"], r["every"]) for r in rows] == [("full", 1), ("h2o", 1), ("h2o", 2)]
    for r in rows:
        assert r["periods"] == (6 if r["every"] == 1 else 2)          # steps 2..4 per repeat; whole periods of 2
        assert r["evict_vs_plain_sum"] > 0                           # the periods' total times divided
        if r["periods"] >= 3:
            assert r["evict_vs_plain_lo"] <= r["evict_vs_plain"] <= r["evict_vs_plain_hi"]
        else:
            assert r["evict_vs_plain_lo"] is None and r["evict_vs_plain_hi"] is None
    for bad in (["h2o", "nope"], []):
        with pytest.raises(ValueError, match="--policies"):
            bench_evict_batch(tiny_teacher, [1], cache_len=64, steps=2, names=bad)
    with pytest.raises(ValueError, match="not both"):
        bench_evict_batch(tiny_teacher, [1], cache_len=64, steps=2, names=["h2o"], policies={})


def test_ratio_interval_pairs_and_bounds():
    from kvlab.studies.bench.timing import ratio_interval

    num, den = [1.1, 1.3, 1.2, 1.25, 1.15], [1.0, 1.2, 1.1, 1.1, 1.05]
    lo, hi = ratio_interval(num, den)
    point = sorted(num)[2] / sorted(den)[2]
    assert lo <= point <= hi and hi - lo < 0.2
    assert ratio_interval(num, den) == (lo, hi)                     # seeded: the same interval every time
    assert ratio_interval([1.0, 2.0], [1.0, 1.0]) is None           # under 3 pairs: no interval
    const = ratio_interval([2.0] * 4, [1.0] * 4)
    assert const == pytest.approx((2.0, 2.0))
    with pytest.raises(ValueError, match="paired"):
        ratio_interval([1.0, 2.0, 3.0], [1.0, 2.0])


def test_cli_policies_checked_before_any_model_work(capsys):
    """``--policies`` names of the default set only, and only for bench evict --batch: an error naming the flag and
    the choices, before a model loads."""
    from kvlab.cli import main

    assert main(["bench", "evict", "--batch", "8", "--policies", "h2o,nope"]) != 0
    err = capsys.readouterr().err
    assert "--policies" in err and "nope" in err and "confkv" in err
    assert main(["bench", "decode", "--policies", "h2o"]) != 0
    assert "--policies is for bench evict --batch" in capsys.readouterr().err
    assert main(["bench", "decode", "--batch", "8", "--no-resident"]) != 0
    assert "--no-resident is for bench evict --batch" in capsys.readouterr().err
