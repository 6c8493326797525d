"""Refresh as a cache operation: alignment, cost accounting, policies, the probe protocol, tables."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import pytest
import torch

from kvlab.decode import DecodeConfig, Decoding, Sampling, StepRecord, run
from kvlab.core.metrics import kl_rows, teacher_logprobs
from kvlab.refresh.policies import EntropyGate, Periodic, ProbeKL, Speculative
from kvlab.refresh.base import PROBES, ProbeResult, tau_for_budget, tau_from_percentile
from kvlab.harness.costs import run_costs

PROMPT = "the quick brown fox"
NEXT = ("rerun", "student", "teacher")


def _cfg(policy, nxt="rerun", n=24, **kw):
    return DecodeConfig(mode="overfill", max_new_tokens=n, refresh=policy, refresh_next=nxt, **kw)


def _kv_at(cache, positions):
    """Per layer (keys, values) at the given absolute positions, (1, H_kv, n, D)."""
    slot = {p: s for s, p in enumerate(cache.positions)}
    idx = torch.tensor([slot[p] for p in positions])
    return [(k[:, :, idx], v[:, :, idx]) for k, v in (cache.kv(i) for i in range(cache.num_layers))]


def _writers_at(cache, positions):
    by = dict(zip(cache.positions, cache.writers))
    return [by[p] for p in positions]


# ------------------------------------------------------------------ alignment


@pytest.mark.parametrize("nxt", NEXT)
@pytest.mark.parametrize("W", [None, 2])
def test_refresh_rewrites_exactly_the_span_with_teacher_entries(tiny_teacher, tiny_student, nxt, W):
    d = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(Periodic(6, W=W), nxt, n=20))
    L = len(d.prompt_ids)
    frontier, seen = 0, 0
    for rec in d:
        d.cache.check()
        if not rec.refreshed:
            continue
        seen += 1
        t = rec.step
        end = t - 1 if nxt == "rerun" else t                # rerun: y_t's entry comes from the next step
        first = frontier + 1 if W is None else max(frontier + 1, end - W + 1)
        span = list(range(L + first - 1, L + end))          # positions of y_first .. y_end
        assert d.teacher_cache.next_position == L + t      # teacher holds x, y_<=t
        assert d.teacher_cache.token_ids[L:] == d.tokens
        assert len(d.cache) == (L + t - 1 if nxt == "rerun" else L + t)
        assert rec.spliced == len(span)
        for (sk, sv), (tk, tv) in zip(_kv_at(d.cache, span), _kv_at(d.teacher_cache, span)):
            assert torch.equal(sk, tk) and torch.equal(sv, tv)
        assert _writers_at(d.cache, span) == ["teacher"] * len(span)
        # stale entries the window left alone stay the student's
        rest = list(range(L + frontier, L + first - 1))
        assert set(_writers_at(d.cache, rest)) <= {"student"}
        frontier = end
    assert seen == 3


def _generated_writers(d):
    """Writer of every generated entry in the student cache, as a string (T = teacher, s = student)."""
    L = len(d.prompt_ids)
    return "".join("T" if w == "teacher" else "s" for w in d.cache.writers[L:])


@pytest.mark.parametrize("nxt", NEXT)
@pytest.mark.parametrize("policy", [Periodic(6), Speculative(1), Periodic(1), Periodic(4, W=2)],
                         ids=["periodic6", "speculative1", "periodic1", "periodic4_W2"])
def test_every_slot_up_to_the_frontier_is_teacher_written(tiny_teacher, tiny_student, nxt, policy):
    """Seed 000: C_t <- Prefill_T([x; y<=t]) (or its last W entries). After a refresh with an unbounded
    window every generated entry the student cache holds up to the refresh's end is the teacher's; the
    entry "rerun" leaves to the student at one boundary is rewritten at the next; k = 1 splices."""
    d = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(policy, nxt, n=19))
    L = len(d.prompt_ids)
    W = policy.window
    refreshes = last_end = 0
    for rec in d:
        if not rec.refreshed:
            continue
        refreshes += 1
        t = rec.step
        end = last_end = t - 1 if nxt == "rerun" else t
        writers = _generated_writers(d)
        assert len(writers) == (t - 1 if nxt == "rerun" else t)
        if W is None:
            assert writers[:end] == "T" * end, (t, writers)
        else:
            assert writers[max(0, end - W):end] == "T" * min(W, end), (t, writers)
        if t >= 2:
            assert rec.spliced >= 1, f"refresh at step {t} spliced nothing but spent {rec.teacher_tokens} teacher tokens"
    assert refreshes >= 3
    if W is None:     # the final cache: everything the last refresh covered is teacher-written
        final = _generated_writers(d)
        assert "s" not in final[:last_end]


def test_periodic6_writer_pattern_has_no_student_boundary_entries(tiny_teacher, tiny_student):
    """Regression: "rerun" must not leave every boundary entry student-written (TTTTTsTTTTTs)."""
    pats = {}
    for nxt in NEXT:
        d = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(Periodic(6), nxt, n=19))
        list(d)
        pats[nxt] = _generated_writers(d)
    assert pats["teacher"][:18] == "T" * 18 and pats["student"][:18] == "T" * 18
    assert pats["rerun"][:17] == "T" * 17          # y_18's entry belongs to the next (never-run) refresh


@pytest.mark.parametrize("nxt", NEXT)
def test_refresh_with_student_as_teacher_changes_nothing(tiny_teacher, nxt):
    base = run(tiny_teacher, tiny_teacher, PROMPT, _cfg(None, n=20, keep_dists=True))
    d = Decoding(tiny_teacher, tiny_teacher, PROMPT, _cfg(Periodic(5), nxt, n=20, keep_dists=True))
    recs = list(d)
    assert sum(r.refreshed for r in recs) == 3
    assert [r.token_id for r in recs] == base.tokens
    assert torch.allclose(torch.stack(d.dists), base.model_logprobs, atol=1e-4)
    ref = Decoding(tiny_teacher, tiny_teacher, PROMPT, _cfg(None, n=20))
    list(ref)
    n = min(len(ref.cache), len(d.cache))
    for (a, b), (c, e) in zip(_kv_at(d.cache, range(n)), _kv_at(ref.cache, range(n))):
        assert torch.allclose(a, c, atol=1e-5) and torch.allclose(b, e, atol=1e-5)


@pytest.mark.parametrize("nxt", NEXT)
def test_periodic_T_W_k_equals_speculative_k(tiny_teacher, tiny_student, nxt):
    k = 4
    samp = Sampling(temperature=0.8, top_p=0.95, seed=3)
    a = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(Periodic(k, W=k), nxt, n=22, sampling=samp))
    b = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(Speculative(k), nxt, n=22, sampling=samp))
    L = len(a.prompt_ids)
    n_ref = 0
    for ra, rb in zip(a, b):
        assert (ra.token_id, ra.refreshed, ra.spliced, ra.teacher_tokens) == (rb.token_id, rb.refreshed, rb.spliced, rb.teacher_tokens)
        if ra.refreshed:
            n_ref += 1
            last = list(range(L + ra.step - k, len(a.cache)))
            for (x, y), (u, v) in zip(_kv_at(a.cache, last), _kv_at(b.cache, last)):
                assert torch.equal(x, u) and torch.equal(y, v)
    assert n_ref == 5


# ------------------------------------------------------------------ cost accounting


def _expected_teacher_work(recs, M=None):
    """Replay the cost model from the records' flags alone: the teacher's sync point s starts at 0;
    a probe at t catches it up to t-1, a refresh at t to t. Returns per-step (tokens, probe tokens)."""
    s, out = 0, []
    for r in recs:
        probe = 0
        if r.probed:
            probe = max(0, r.step - 1 - s)
            s = max(s, r.step - 1)
        delta = 0
        if r.refreshed:
            delta = r.step - s
            s = r.step
        out.append((probe + delta, probe))
    return out, s


@pytest.mark.parametrize("policy", [Periodic(5), Periodic(7, W=3), Speculative(4), EntropyGate(6.9, min_gap=2),
                                    ProbeKL(3, 0.0), ProbeKL(4, 1e9), ProbeKL(5, 0.02)])
@pytest.mark.parametrize("nxt", NEXT)
def test_teacher_tokens_are_sum_of_deltas_plus_probes(tiny_teacher, tiny_student, policy, nxt):
    n = 26
    d = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(policy, nxt, n=n))
    recs = list(d)
    L = len(d.prompt_ids)
    expected, sync = _expected_teacher_work(recs)
    assert [(r.teacher_tokens, r.probe_tokens) for r in recs] == expected
    c = run_costs(recs)
    assert c["teacher_tokens"] == c["delta_tokens"] + c["probe_tokens"] == sync
    assert len(d.teacher_cache) == L + sync and len(d.teacher_cache.ledger) == L + sync   # never re-prefilled
    assert c["teacher_tokens"] < n                      # never the whole sequence (no refresh after y_N)
    assert c["refreshes"] == sum(r.refreshed for r in recs)
    if getattr(policy, "probe", None):
        assert [r.step for r in recs if r.probed] == list(range(policy.M, n + 1, policy.M))
        assert c["probe_teacher_tokens"] == c["probe_tokens"]


def test_no_refresh_run_costs_nothing(tiny_teacher, tiny_student):
    recs = list(Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(None, n=8)))
    c = run_costs(recs)
    assert (c["refreshes"], c["teacher_tokens"], c["teacher_s"]) == (0, 0, 0.0)


def test_entropy_gate_costs_nothing_until_it_fires(tiny_teacher, tiny_student):
    recs = list(Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(EntropyGate(1e6), n=16)))
    assert run_costs(recs)["teacher_tokens"] == 0 and not any(r.probed for r in recs)


# ------------------------------------------------------------------ policies


def _rec(step, entropy, since, signals=()):
    from kvlab.decode import Signals

    return StepRecord(step=step, token_id=0, token="", position=step, logprob=0.0, entropy_bits=entropy,
                      top1_prob=0.0, margin=0.0, cache_len=0, source="student", refreshed=False, evicted=0,
                      wall_s=0.0, elapsed_s=0.0, since_refresh=since, signals=Signals(signals))


def test_entropy_gate_fires_exactly_above_tau_respecting_min_gap():
    gate = EntropyGate(4.0, min_gap=2)
    script = [1, 5, 6, 2, 7, 7, 7, 1, 9, 4.0]
    fired, last = [], 0
    for t, h in enumerate(script, 1):
        if gate.should_refresh(_rec(t, h, t - last)):
            fired.append(t)
            last = t
    assert fired == [2, 5, 7, 9]                       # 4.0 is not > 4.0


def test_entropy_gate_in_the_loop_matches_the_entropy_trace(tiny_teacher, tiny_student):
    probe = run(tiny_teacher, tiny_student, PROMPT, _cfg(None, n=30))
    tau = sorted(r.entropy_bits for r in probe.records[1:])[15]
    d = Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(EntropyGate(tau, min_gap=3), "student", n=30))
    recs = list(d)
    expect, last = [], 0
    for r in recs[:-1]:                                  # no refresh after the last token
        if r.entropy_bits > tau and r.step - last >= 3:
            expect.append(r.step)
            last = r.step
    assert [r.step for r in recs if r.refreshed] == expect and expect


def test_probe_kl_signal_is_the_teacher_student_kl(tiny_teacher, tiny_student):
    tr = run(tiny_teacher, tiny_student, PROMPT, _cfg(ProbeKL(3, 0.0), n=15, keep_dists=True))
    t_logp = teacher_logprobs(tiny_teacher, tr.prompt_ids, tr.tokens)
    kl = kl_rows(t_logp, tr.model_logprobs)
    probed = [r for r in tr.records if r.probed]
    assert [r.step for r in probed] == [3, 6, 9, 12, 15]
    for r in probed:
        assert r.signals["kl"] == pytest.approx(float(kl[r.step - 1]), rel=1e-3, abs=1e-6)
    assert [r.step for r in tr.records if r.refreshed] == [3, 6, 9, 12]    # kappa = 0: every probe but the last


def test_probe_protocol_is_generic(tiny_teacher, tiny_student, monkeypatch):
    calls = []

    def dummy(ctx):
        assert len(ctx.tokens) == ctx.step and ctx.logits.shape == (tiny_student.config.vocab_size,)
        calls.append(ctx.step)
        return ProbeResult(signals={"u": float(ctx.step)}, cost={"student_passes": 2})

    monkeypatch.setitem(PROBES, "dummy", dummy)

    @dataclass(frozen=True)
    class Gate:                                          # not a kvlab policy class: the loop must not care
        probe: str = "dummy"
        probe_every: int = 3

        def should_refresh(self, record):
            return record.signals.get("u", 0.0) >= 9

    recs = list(Decoding(tiny_teacher, tiny_student, PROMPT, _cfg(Gate(), n=13)))
    assert calls == [3, 6, 9, 12]
    assert [r.step for r in recs if r.refreshed] == [9, 12]
    assert recs[5].signals.to_dict() == {"u": 6.0} and recs[4].signals == ()
    c = run_costs(recs)
    assert c["probe_student_passes"] == 8 and c["probe_tokens"] == 0


@pytest.mark.parametrize("make, name", [
    (lambda: Periodic(0), "T"), (lambda: Periodic(-3), "T"), (lambda: Periodic(2.5), "T"),
    (lambda: Periodic(8, W=0), "W"), (lambda: Periodic(8, W=1.5), "W"),
    (lambda: Speculative(0), "k"), (lambda: Speculative(True), "k"),
    (lambda: EntropyGate(-1.0), "tau_bits"), (lambda: EntropyGate(float("nan")), "tau_bits"),
    (lambda: EntropyGate(5.0, min_gap=0), "min_gap"),
    (lambda: ProbeKL(0, 0.1), "M"), (lambda: ProbeKL(8, -0.1), "kappa"), (lambda: ProbeKL(8, math.inf), "kappa"),
    (lambda: DecodeConfig(refresh_next="oracle"), "refresh_next"),
    (lambda: DecodeConfig(mode="student", refresh=Periodic(4)), "refresh"),
    (lambda: DecodeConfig(refresh=object()), "refresh"),
    (lambda: DecodeConfig(refresh=ProbeKL(4, 0.1, probe="nope")), "refresh.probe"),
    (lambda: tau_from_percentile([1.0, 2.0], 100), "percentile"),
    (lambda: tau_for_budget([1.0, 2.0], 0), "per_1k"),
])
def test_bad_parameters_raise_value_error_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_calibration_helpers():
    vals = list(range(1, 1001))
    assert tau_from_percentile(vals, 95) == pytest.approx(950.05)
    tau = tau_for_budget(vals, per_1k=3)
    assert sum(v > tau for v in vals) == 3
    assert sum(v > tau_for_budget(vals, per_1k=3, probe_every=10) for v in vals) == 30


def test_config_dict_names_the_policy():
    a = _cfg(Periodic(8, W=8)).to_dict()["refresh"]
    b = _cfg(Speculative(8)).to_dict()["refresh"]
    assert a == {"policy": "Periodic", "T": 8, "W": 8} and b["policy"] == "Speculative" and a != b
    assert _cfg(None).to_dict()["refresh"] is None


# ------------------------------------------------------------------ cache operations


def test_append_from_and_splice_positions_check_tokens(tiny_teacher, tiny_student):
    from kvlab.cache import KVCache

    ids = [5, 6, 7, 8, 9]
    t, _ = KVCache.prefill(tiny_teacher.model, ids, writer="teacher")
    s, _ = KVCache.prefill(tiny_student.model, ids[:3], writer="student")
    rows = len(s.ledger)
    assert s.append_from(t, 2) == [3, 4] and s.next_position == 5 and s.writers[-2:] == ["teacher"] * 2
    assert len(s.ledger) == rows + 2
    s.check()
    for (a, b), (c, d) in zip(_kv_at(s, [3, 4]), _kv_at(t, [3, 4])):
        assert torch.equal(a, c) and torch.equal(b, d)
    with pytest.raises(ValueError, match="position 5"):
        s.append_from(t, 1)
    other, _ = KVCache.prefill(tiny_teacher.model, [5, 6, 1, 8, 9], writer="teacher")
    before = s.kv(0)[0].clone()
    with pytest.raises(ValueError, match="same tokens"):
        s.splice_positions(other, [1, 2])
    assert torch.equal(s.kv(0)[0], before)
    assert s.splice_positions(t, [0, 1]) == [0, 1] and s.writers[:2] == ["teacher"] * 2


# ------------------------------------------------------------------ tables


def test_refresh_tables_on_tiny_pair(tiny_teacher, tiny_student, tmp_path):
    from kvlab.harness.experiment import RunSpec
    from kvlab.viz.figures import render
    from kvlab.studies.refresh.tables import TIME_COLUMNS, periods_for, refresh_tables, write_refresh
    from kvlab.store import RunStore

    samp = Sampling(0.7, 0.9, 0)
    spec = RunSpec(prompts=("hello there", "a b c d", "third prompt"), tokens=24, sampling=samp)
    calib = RunSpec(prompts=("calib one",), tokens=24, sampling=samp)
    store = RunStore(tmp_path / "runs")
    tabs = refresh_tables(tiny_teacher, tiny_student, spec, store, calib, progress=False, timing_prompts=2,
                          timing_repeats=2)
    write_refresh(tabs, tmp_path)
    assert render("refresh_pareto", tmp_path).is_file()
    for name in ("refresh_periodic", "refresh_entropy", "refresh_methods"):
        assert (tmp_path / f"{name}.csv").is_file() and (tmp_path / f"{name}.md").is_file()
        # teacher-PPL rewards loops: every table shows KL and repeat@3 beside it, with spread
        assert {"teacher_ppl", "kl", "kl_std", "repeat3", "repeat3_std"} <= set(tabs[name].columns)
        assert tabs[name][["kl", "repeat3"]].notna().all().all()
    for name in ("refresh_periodic", "refresh_entropy", "refresh_methods", "refresh_all", "refresh_runs"):
        # machine-dependent times stay out of the quality tables
        assert not set(TIME_COLUMNS) & set(tabs[name].columns), name
        assert not any(c.startswith("overhead") for c in tabs[name].columns), name
    per = tabs["refresh_periodic"].set_index("policy")
    assert list(per.index) == ["none"] + [f"periodic_T{T}" for T in periods_for(24)]
    assert per.loc["none", "teacher_tokens"] == 0
    # the forced path's own costs (issue 37): a periodic schedule fires at the same steps on both paths
    assert (per["refreshes_forced"] == per["refreshes"]).all()
    assert (per["teacher_tokens_forced"] == per["teacher_tokens"]).all() and per.loc["none", "teacher_tokens_forced"] == 0
    assert {"refreshes_forced", "teacher_tokens_forced"} <= set(tabs["refresh_entropy"].columns)
    assert (tabs["refresh_all"]["kl_forced_step1"] == 0).all()    # every row is OverFill: step 1 is the teacher's
    # overhead: every policy timed against no refresh side by side, 2 prompts × 2 repeats
    timing = tabs["refresh_timing"].set_index("policy")
    assert list(timing.index) == list(tabs["refresh_all"].policy)
    assert (timing["pairs"] == 4).all() and (timing["timing_prompts"] == 2).all()
    assert (timing["overhead_pct_q25"] <= timing["overhead_pct"]).all()
    assert (timing["overhead_pct"] <= timing["overhead_pct_q75"]).all()
    pairs = tabs["refresh_timing_runs"]
    assert len(pairs) == 4 * len(timing) and set(pairs["first"]) == {"ref", "pol"}   # order alternates
    assert pairs["ratio"].to_numpy() == pytest.approx((pairs["total_s"] / pairs["ref_total_s"]).to_numpy())
    assert (pairs["tokens"] == 24).all()
    # the timed runs are the stored runs' decodes: same refresh count on the same prompt and seed
    stored = tabs["refresh_runs"].set_index(["policy", "prompt_idx"])["refreshes"]
    for r in pairs.itertuples():
        assert r.refreshes == stored[r.policy, r.prompt_idx]
    assert "back to back in one process" in (tmp_path / "refresh_timing.md").read_text()
    runs = tabs["refresh_runs"]
    assert (runs.teacher_tokens < 24).all()
    meth = tabs["refresh_methods"].set_index("policy")
    assert meth.loc["speculative_k8", "max_delta"] == 8          # constant teacher work per refresh
    n_runs = len(store)
    again = refresh_tables(tiny_teacher, tiny_student, spec, store, calib, progress=False, timing_repeats=0)
    assert len(store) == n_runs                                   # a rerun reuses every stored run
    assert "refresh_timing" not in again
    pd.testing.assert_frame_equal(again["refresh_all"], tabs["refresh_all"])   # quality: deterministic


def test_provenance_table_and_figure(tiny_teacher, tiny_student, tmp_path):
    from kvlab.harness.experiment import RunSpec
    from kvlab.viz.figures import render
    from kvlab.studies.refresh.tables import provenance_table

    spec = RunSpec(prompts=("hello there",), tokens=12, sampling=Sampling(0.7, 0.9, 0))
    df = provenance_table(tiny_teacher, tiny_student, spec, T=4)
    assert df["condition"].nunique() == 3 and len(df) == 3 * 12
    L = int(df["prompt_len"].iloc[0])
    first = df.groupby("condition", sort=False).first()
    assert all(w == "T" * L for w in first["writers"])              # step 1: the teacher's prefill only
    last = df.groupby("condition", sort=False).last()
    none, full, window = last["writers"]
    assert set(none[L:]) == {"S"}                                   # OverFill: the student writes the rest
    assert full[L:L + 8] == "T" * 8                                 # re-prefilled at steps 4, 8
    assert window[L:L + 2] == "SS" and window[L + 2:L + 4] == "TT"  # W=2 < T=4 leaves older student entries
    assert full.count("T") > window.count("T") > none.count("T") == L
    df.to_csv(tmp_path / "refresh_provenance.csv", index=False)
    assert render("refresh_provenance", tmp_path).is_file()


@pytest.mark.integration
def test_real_pair_refresh_alignment(real_pair):
    teacher, student = real_pair
    d = Decoding(teacher, student, "ELI5: why is the sky blue?", _cfg(Periodic(8), "teacher", n=17))
    L = len(d.prompt_ids)
    recs = list(d)
    assert [r.step for r in recs if r.refreshed] == [8, 16]
    span = list(range(L, L + 16))
    for (sk, sv), (tk, tv) in zip(_kv_at(d.cache, span), _kv_at(d.teacher_cache, span)):
        assert torch.equal(sk, tk) and torch.equal(sv, tv)
    assert recs[8].source == "teacher" and run_costs(recs)["teacher_tokens"] == 16
