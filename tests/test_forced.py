"""Teacher-forced refresh study: caches built as described, KL 0 when student := teacher."""
from __future__ import annotations

import pytest
import torch

from kvlab.studies.refresh.forced import condition_caches, forced_kl, forced_table
from kvlab.store import RunStore


def test_condition_caches_provenance(tiny_teacher, tiny_student):
    ctx = list(range(5, 25))
    caches = condition_caches(tiny_teacher, tiny_student, ctx, n_prompt=8, window=4)
    assert caches["student"].writers == ["student"] * 20
    assert caches["overfill"].writers == ["teacher"] * 8 + ["student"] * 12
    assert caches["window"].writers == ["teacher"] * 8 + ["student"] * 8 + ["teacher"] * 4
    assert caches["refreshed"].writers == ["teacher"] * 20
    for c in caches.values():
        assert c.token_ids == ctx and c.positions == list(range(20))
        c.check()


def test_student_equal_teacher_gives_zero_kl(tiny_teacher):
    out = forced_kl(tiny_teacher, tiny_teacher, "some prompt", tokens=12, split=6, window=2)
    assert set(out) == {"student", "overfill", "window", "refreshed"}
    assert all(abs(v) < 1e-5 for v in out.values())


def test_forced_table_rows_and_store(tiny_teacher, tiny_student, tmp_path):
    table, per = forced_table(tiny_teacher, tiny_student, ["abc", "xyz q"], RunStore(tmp_path), tokens=12, split=6,
                              window=2)
    assert list(table["condition"]) == ["student", "overfill", "window", "refreshed"]
    assert len(per) == 2 and len(RunStore(tmp_path).ok_keys()) == 2
    rows = RunStore(tmp_path).load()
    assert set(rows.kind) == {"forced_kl"} and len(rows) == 2        # other kinds of runs are rows of the same store
    row = table.set_index("condition")
    assert row.loc["overfill", "d_kl_vs_overfill"] == 0.0
    assert (per[["student", "overfill", "window", "refreshed"]] > 0).all().all()


@pytest.mark.parametrize("kw, name", [({"tokens": 3}, "tokens"), ({"split": 1}, "split"),
                                      ({"split": 12}, "split"), ({"window": 0}, "window"), ({"window": 6}, "window")])
def test_bad_parameters(tiny_teacher, kw, name):
    args = {"tokens": 12, "split": 6, "window": 2, **kw}
    with pytest.raises(ValueError, match=name):
        forced_kl(tiny_teacher, tiny_teacher, "p", **args)


# --------------------------------------------------------------------------- teacher-forced scores

from kvlab.decode import DecodeConfig, Sampling, run  # noqa: E402
from kvlab.harness.forced import (ForcedDecoding, distinct_n, forced_columns, forced_dists, forced_scores,  # noqa: E402
                                   reference_tokens)
from kvlab.harness.forced import _forced_run, forced_costs  # noqa: E402
from kvlab.refresh.policies import EntropyGate, Periodic  # noqa: E402

FORCED_CONFIGS = {
    "teacher": DecodeConfig(mode="teacher", max_new_tokens=14),
    "student": DecodeConfig(mode="student", max_new_tokens=14),
    "overfill": DecodeConfig(mode="overfill", max_new_tokens=14),
    "periodic_T4": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(4)),
    "periodic_T1": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(1)),
    "periodic_T13": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(13)),
}


@pytest.fixture(scope="module")
def reference(tiny_teacher):
    return run(tiny_teacher, None, "a fixed prompt", mode="teacher", max_new_tokens=14,
               sampling=Sampling(temperature=1.0, seed=3)).tokens


@pytest.mark.parametrize("name", list(FORCED_CONFIGS))
def test_forced_scorer_matches_step_by_step_forced_decode(tiny_teacher, tiny_student, reference, name):
    """The batched scorer equals the decode loop forced onto the same tokens: same q_t, same KL, every step."""
    from kvlab.core.metrics import kl_rows, teacher_logprobs

    cfg = FORCED_CONFIGS[name]
    q_fast, src_fast = forced_dists(tiny_teacher, tiny_student, "a fixed prompt", cfg, reference)
    d = ForcedDecoding(tiny_teacher, tiny_student, "a fixed prompt", cfg, reference)
    recs = list(d)
    q_loop = torch.stack(d.dists)
    assert d.tokens == list(reference) and [r.token_id for r in recs] == list(reference)
    assert src_fast == [r.source for r in recs]
    if cfg.refresh is not None:
        assert [r.step for r in recs if r.refreshed] == [t for t in range(1, 14) if t % cfg.refresh.T == 0]
    assert _forced_run(tiny_teacher, tiny_student, "a fixed prompt", cfg, reference)[2] == forced_costs(recs)
    p = teacher_logprobs(tiny_teacher, d.prompt_ids, reference)
    torch.testing.assert_close(q_fast, q_loop, atol=2e-5, rtol=0)
    torch.testing.assert_close(kl_rows(p, q_fast), kl_rows(p, q_loop), atol=2e-5, rtol=0)


def test_forced_decoding_equals_free_run_on_its_own_tokens(tiny_teacher, tiny_student):
    """Forced onto a free-running decode's own tokens, the loop sees the same distributions (refresh included)."""
    cfg = DecodeConfig(mode="overfill", max_new_tokens=12, refresh=EntropyGate(0.5), keep_dists=True,
                       sampling=Sampling(temperature=1.0, seed=1))
    free = run(tiny_teacher, tiny_student, "p q r", cfg)
    d = ForcedDecoding(tiny_teacher, tiny_student, "p q r", cfg, free.tokens)
    recs = list(d)
    assert [r.refreshed for r in recs] == [r.refreshed for r in free.records]
    torch.testing.assert_close(torch.stack(d.dists), free.model_logprobs, atol=1e-5, rtol=0)


def test_forced_scores_fallback_policy_and_zero_for_teacher(tiny_teacher, tiny_student, reference):
    t = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS["teacher"], reference)
    assert abs(t["kl_forced"]) < 1e-6 and t["forced_steps"] == 13 and t["nll_forced"] > 0
    of = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS["overfill"], reference)
    assert of["forced_steps"] == 13 and of["kl_forced"] > 0 and of["kl_forced_steps"][0] == 0.0
    assert of["kl_forced_step1"] == 0.0 and of["nll_forced_step1"] == pytest.approx(t["nll_forced_step1"], abs=1e-5)
    # windowed refresh is not on the fast path: the forced loop scores it
    w = forced_scores(tiny_teacher, tiny_student, "a fixed prompt",
                      DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(4, 2)), reference)
    assert w["forced_steps"] == 13 and w["kl_forced"] > 0
    # the student as its own teacher: KL 0 in every mode
    same = forced_scores(tiny_teacher, tiny_teacher, "a fixed prompt", FORCED_CONFIGS["periodic_T4"], reference)
    assert abs(same["kl_forced"]) < 1e-5


def test_forced_scores_refuse_a_short_reference(tiny_teacher, tiny_student):
    with pytest.raises(ValueError, match="reference holds 3 tokens"):
        forced_scores(tiny_teacher, tiny_student, "x", FORCED_CONFIGS["overfill"], [1, 2, 3])


def test_distinct_n_sees_loops():
    assert distinct_n([1, 2, 3, 4]) == 1.0
    assert distinct_n([1, 2, 1, 2, 1, 2]) == 2 / 5
    assert distinct_n([1]) != distinct_n([1])   # NaN: no bigram


def test_forced_columns_store_reference_once(tiny_teacher, tiny_student, tmp_path):
    from kvlab.harness.experiment import RunSpec

    store = RunStore(tmp_path)
    spec = RunSpec(prompts=("abc", "xyz q"), tokens=8, sampling=Sampling(temperature=0.7, top_p=0.9, seed=0))
    pol = {k: FORCED_CONFIGS[k] for k in ("teacher", "overfill", "periodic_T4")}
    cols = forced_columns(tiny_teacher, tiny_student, spec, pol, store)
    assert list(cols.columns) == ["policy", "prompt_idx", "kl_forced", "nll_forced", "kl_forced_step1",
                                  "nll_forced_step1", "refreshes_forced", "teacher_tokens_forced", "distinct2"]
    assert len(cols) == 6 and cols.set_index("policy").loc["teacher", "kl_forced"].abs().max() < 1e-6
    ref = reference_tokens(tiny_teacher, "abc", 8, spec.sampling_for(0), store)
    teacher_run = run(tiny_teacher, None, "abc", mode="teacher", max_new_tokens=8, sampling=spec.sampling_for(0))
    assert ref == teacher_run.tokens                                   # the teacher's own sampled continuation
    kinds = RunStore(tmp_path).load().kind.value_counts()
    assert kinds["reference"] == 2 and kinds["forced_score"] == 6
    again = forced_columns(tiny_teacher, tiny_student, spec, pol, RunStore(tmp_path))
    assert again.equals(cols)


def test_every_row_of_a_table_averages_the_same_steps(tiny_teacher, tiny_student, reference):
    """Issue 37: an OverFill row (step 1 is the teacher's prefill) and a student row (step 1 is its own) average
    the same steps 2..N; step 1 is reported apart. Recomputed here from the per-step KL and the distributions."""
    from kvlab.core.metrics import kl_rows, teacher_logprobs

    rows = {name: forced_scores(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS[name], reference)
            for name in ("overfill", "student", "teacher", "periodic_T4")}
    rows["entropy"] = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", SLOW_CONFIGS["entropy"], reference)
    assert {r["forced_steps"] for r in rows.values()} == {13}            # 14 tokens, steps 2..14 in every row
    x = tiny_teacher.encode_prompt("a fixed prompt", chat=True)
    p = teacher_logprobs(tiny_teacher, x, reference)
    for name in ("overfill", "student"):
        q, _ = forced_dists(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS[name], reference)
        kl = kl_rows(p, q)
        if name == "overfill":
            kl[0] = 0.0                                                  # step 1 is the teacher's own distribution
        nll = -q[torch.arange(14), torch.tensor(reference)]
        assert rows[name]["kl_forced"] == pytest.approx(float(kl[1:].mean()), abs=1e-5)
        assert rows[name]["nll_forced"] == pytest.approx(float(nll[1:].mean()), abs=1e-5)
        assert rows[name]["kl_forced_step1"] == pytest.approx(float(kl[0]), abs=1e-5)
        assert rows[name]["nll_forced_step1"] == pytest.approx(float(nll[0]), abs=1e-5)
    assert rows["student"]["kl_forced_step1"] > 0 and rows["overfill"]["kl_forced_step1"] == 0.0


def test_forced_columns_rows_share_steps_and_a_new_definition_is_recomputed(tiny_teacher, tiny_student, tmp_path,
                                                                          monkeypatch):
    """Every row of a table's forced columns averages steps 2..N, and a stored score of another definition
    (another FORCED_SCORE_VERSION) is not reused: the version is part of its key."""
    from dataclasses import replace

    import kvlab.harness.forced as forced
    from kvlab.harness.experiment import RunSpec

    spec = RunSpec(prompts=("abc",), tokens=8, sampling=Sampling(temperature=0.7, top_p=0.9, seed=0))
    pol = {k: FORCED_CONFIGS[k] for k in ("overfill", "student")}
    store = RunStore(tmp_path)
    cols = forced_columns(tiny_teacher, tiny_student, spec, pol, store).set_index("policy")
    ref = reference_tokens(tiny_teacher, "abc", 8, spec.sampling_for(0), store)
    for name in pol:
        cfg = replace(FORCED_CONFIGS[name], max_new_tokens=8)
        one = forced_scores(tiny_teacher, tiny_student, "abc", cfg, ref)
        assert one["forced_steps"] == 7
        assert cols.loc[name, "kl_forced"] == pytest.approx(one["kl_forced"], abs=1e-5)
        assert cols.loc[name, "kl_forced_step1"] == pytest.approx(one["kl_forced_step1"], abs=1e-5)
    assert len(RunStore(tmp_path).load().query("kind == 'forced_score'")) == 2
    monkeypatch.setattr(forced, "FORCED_SCORE_VERSION", forced.FORCED_SCORE_VERSION + 1)
    forced_columns(tiny_teacher, tiny_student, spec, pol, RunStore(tmp_path))
    assert len(RunStore(tmp_path).load().query("kind == 'forced_score'")) == 4       # recomputed, not reused


def test_forced_path_records_its_own_refresh_costs(tiny_teacher, tiny_student, reference, tmp_path):
    """Issue 37: ``refreshes_forced`` / ``teacher_tokens_forced`` are the refreshes the policy's own schedule fires
    on the reference text and the teacher tokens it reads there — the forced loop's records, fast path or not."""
    from dataclasses import replace

    from kvlab.harness.experiment import RunSpec

    t4 = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS["periodic_T4"], reference)
    assert t4["refreshes_forced"] == 3 and t4["teacher_tokens_forced"] == 12      # after steps 4, 8, 12 of 14
    none = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", FORCED_CONFIGS["overfill"], reference)
    assert none["refreshes_forced"] == 0 and none["teacher_tokens_forced"] == 0
    ent = forced_scores(tiny_teacher, tiny_student, "a fixed prompt", SLOW_CONFIGS["entropy"], reference)
    d = ForcedDecoding(tiny_teacher, tiny_student, "a fixed prompt", SLOW_CONFIGS["entropy"], reference)
    fired = [r.step for r in d if r.refreshed]
    assert fired and ent["refreshes_forced"] == len(fired) and ent["teacher_tokens_forced"] == max(fired)
    # the batched forced loop counts the same
    many = forced_scores_many(tiny_teacher, tiny_student, [("a fixed prompt", SLOW_CONFIGS["entropy"], reference),
                                                          ("x", SLOW_CONFIGS["entropy"], reference)], batch=2)
    assert many[0]["refreshes_forced"] == ent["refreshes_forced"]
    assert many[0]["teacher_tokens_forced"] == ent["teacher_tokens_forced"]
    # and forced_columns carries them per run
    spec = RunSpec(prompts=("abc",), tokens=8, sampling=Sampling(temperature=0.7, top_p=0.9, seed=0))
    store = RunStore(tmp_path)
    cols = forced_columns(tiny_teacher, tiny_student, spec, {"p": FORCED_CONFIGS["periodic_T4"],
                                                             "e": SLOW_CONFIGS["entropy"]}, store).set_index("policy")
    assert cols.loc["p", "refreshes_forced"] == 1 and cols.loc["p", "teacher_tokens_forced"] == 4   # step 4 of 8
    ref8 = reference_tokens(tiny_teacher, "abc", 8, spec.sampling_for(0), store)
    alone = forced_scores(tiny_teacher, tiny_student, "abc", replace(SLOW_CONFIGS["entropy"], max_new_tokens=8), ref8)
    assert cols.loc["e", "refreshes_forced"] == alone["refreshes_forced"]
    assert cols.loc["e", "teacher_tokens_forced"] == alone["teacher_tokens_forced"]


def test_forced_scores_need_a_second_step(tiny_teacher, tiny_student):
    with pytest.raises(ValueError, match="max_new_tokens >= 2"):
        forced_scores(tiny_teacher, tiny_student, "x", DecodeConfig(mode="overfill", max_new_tokens=1), [5])


# --------------------------------------------------------------------------- batched forced scores and references

from kvlab.harness.forced import forced_scores_many, reference_tokens_many  # noqa: E402

SLOW_CONFIGS = {   # off the fast path: the forced loop runs them step by step (batched in forced_scores_many)
    "entropy": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=EntropyGate(0.5)),
    "periodic_window": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(4, 2)),
    "periodic_student_next": DecodeConfig(mode="overfill", max_new_tokens=14, refresh=Periodic(4),
                                          refresh_next="student"),
}


def test_forced_scores_many_equals_one_at_a_time(tiny_teacher, tiny_student):
    """A batch of forced scores (prompts of different lengths, fast- and slow-path configs, two modes) gives
    each item what forced_scores gives it alone: same steps counted, KL and NLL within float tolerance."""
    from kvlab.eviction import H2O

    prompts = ["a fixed prompt", "x", "a much longer prompt with many more tokens in it than the others"]
    refs = [run(tiny_teacher, None, p, mode="teacher", max_new_tokens=14, sampling=Sampling(temperature=1.0, seed=i)).tokens
            for i, p in enumerate(prompts)]
    cfgs = [*SLOW_CONFIGS.values(), FORCED_CONFIGS["periodic_T4"],
            DecodeConfig(mode="teacher", max_new_tokens=14, evict=H2O(budget=8, recent=2))]
    items = [(p, c, r) for c in cfgs for p, r in zip(prompts, refs)]
    seen = {}
    many = forced_scores_many(tiny_teacher, tiny_student, items, batch=4, on_result=seen.__setitem__)
    assert sorted(seen) == list(range(len(items))) and all(seen[j] is many[j] for j in seen)   # each as it is scored
    for (p, c, r), got in zip(items, many):
        one = forced_scores(tiny_teacher, tiny_student, p, c, r)
        assert got["forced_steps"] == one["forced_steps"]
        assert got["kl_forced"] == pytest.approx(one["kl_forced"], abs=2e-5)
        assert got["nll_forced"] == pytest.approx(one["nll_forced"], abs=2e-5)
        torch.testing.assert_close(torch.tensor(got["kl_forced_steps"]), torch.tensor(one["kl_forced_steps"]),
                                   atol=2e-5, rtol=0)
    # batch=1 is the one-at-a-time path itself
    assert forced_scores_many(tiny_teacher, tiny_student, items[:2], batch=1)[0]["kl_forced"] == \
        forced_scores(tiny_teacher, tiny_student, *items[0])["kl_forced"]


def test_forced_scores_many_refuses_a_short_reference(tiny_teacher, tiny_student):
    items = [("x", SLOW_CONFIGS["entropy"], list(range(5, 19))), ("y z", SLOW_CONFIGS["entropy"], [1, 2, 3])]
    with pytest.raises(ValueError, match=r"items\[1\]: reference holds 3 tokens"):
        forced_scores_many(tiny_teacher, tiny_student, items, batch=2)


def test_reference_tokens_many_equals_one_at_a_time_and_shares_the_store(tiny_teacher, tmp_path):
    prompts = ["abc", "xyz q", "a longer prompt than the others"]
    samplings = [Sampling(temperature=0.7, top_p=0.9, seed=i) for i in range(3)]
    store = RunStore(tmp_path / "batched")
    many = reference_tokens_many(tiny_teacher, prompts, 10, samplings, store, batch=3)
    alone = RunStore(tmp_path / "alone")
    assert many == [reference_tokens(tiny_teacher, p, 10, s, alone) for p, s in zip(prompts, samplings)]
    assert len(store.ok_keys()) == 3 and store.ok_keys() == alone.ok_keys()   # same keys: the batch is not in them
    assert reference_tokens(tiny_teacher, "xyz q", 10, samplings[1], store) == many[1]   # read back, not recomputed
    assert len(store.ok_keys()) == 3
    again = RunStore(tmp_path / "batched")
    assert reference_tokens_many(tiny_teacher, prompts, 10, samplings, again, batch=3) == many
    assert again.stats.summary().startswith("3 reused, 0 computed")   # a rerun counts them as reused
    with pytest.raises(ValueError, match="samplings has 2 entries for 3 prompts"):
        reference_tokens_many(tiny_teacher, prompts, 10, samplings[:2], store)
