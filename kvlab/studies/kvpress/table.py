"""The kvpress table: kvpress's presses, unchanged, beside kvlab's sliding window at matched memory, at prefill
(prompt compression) and at decode time, batched, teacher-forced KL to the full cache with paired intervals.

Definition of ``kl_forced`` — the matched-memory eviction study's (:mod:`kvlab.studies.eviction.tables`): the
teacher alone (``mode="teacher"``), first a full-cache free run per prompt (seed = base seed + prompt index), whose
tokens are the reference continuation; then every (press, mode) run teacher-forced on that continuation
(``DecodeConfig.forced``; the policy still decides at every step): the mean over the steps of
``KL(p_full ‖ p_evicted)``, ``p_full`` the teacher's uncached forward over prompt + continuation — what
:func:`kvlab.core.metrics.score` reports as ``kl`` for that forced run, with ``p_full`` computed once per prompt
rather than once per run (:func:`forced_kl_runs`; ``tests/test_kvpress_study.py`` checks the two agree). The full
runs are the harness's stored runs (:func:`kvlab.harness.experiment.scored_runs`, the eviction study's keys); the
forced results are stored under their decode config (kind ``kvpress_forced_kl``), decoded ``spec.batch`` rows at
a time, so a rerun is free.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from kvlab.decode import DecodeConfig
from kvlab.harness.experiment import RunSpec, paired_bootstrap, scored_runs, write_table
from kvlab.store import RunStore
from kvlab.studies.kvpress.presses import FULL, MODES, PRESSES, REFERENCE, study_policies

COLUMNS = ["press", "mode", "budget", "sinks", "mean_len", "peak_len", "kl_forced", "kl_forced_std", "d_kl_forced",
           "d_kl_forced_lo", "d_kl_forced_hi", "d_kl_forced_mde", "n_prompts"]


def _cfg(spec: RunSpec, i: int, evict, forced: tuple = ()) -> DecodeConfig:
    return DecodeConfig(mode="teacher", max_new_tokens=spec.tokens, sampling=spec.sampling_for(i), evict=evict,
                        forced=forced)


def _full_runs(teacher, spec: RunSpec, store: RunStore) -> list[dict]:
    return scored_runs(teacher, None, [(p, _cfg(spec, i, None)) for i, p in enumerate(spec.prompts)], store,
                       batch=spec.batch)


def references(teacher, spec: RunSpec, store: RunStore) -> list[tuple[int, ...]]:
    """The full cache's own continuation of every prompt (stored free runs, as the eviction study's ``full``)."""
    return [tuple(int(t) for t in r["steps"]["token_id"]) for r in _full_runs(teacher, spec, store)]


def forced_kl_runs(teacher, spec: RunSpec, evict, refs, store: RunStore, p_full: dict | None = None) -> list[dict]:
    """Per prompt: ``{"kl_forced", "kl_steps", "cache_len"}`` of ``evict`` teacher-forced on ``refs[i]``, decoded
    ``spec.batch`` rows at a time (:func:`kvlab.decode.run_batch` with ``DecodeConfig.forced``), each stored as
    soon as its row finishes. ``kl_forced`` is what :func:`kvlab.core.metrics.score` gives the same forced run as
    ``kl`` (mean over steps of ``kl_rows(teacher_logprobs(x, y), q)``), with ``p_full = teacher_logprobs(x, y)``
    computed once per prompt for all policies (``p_full``: a dict prompt index -> (N, V), filled as needed)
    instead of once per run: the same number at half the cost."""
    from kvlab.core.metrics import kl_rows, teacher_logprobs
    from kvlab.decode import run_batch
    from kvlab.harness.experiment import check_batch, run_config

    p_full = {} if p_full is None else p_full
    cfgs = [replace(_cfg(spec, i, evict, tuple(refs[i])), keep_dists=True) for i in range(len(spec.prompts))]
    keys = [{**run_config(teacher, None, p, c), "kind": "kvpress_forced_kl"} for p, c in zip(spec.prompts, cfgs)]
    got = [store.reused(k) for k in keys]
    miss = [i for i, g in enumerate(got) if g is None]
    batch = check_batch(spec.batch)

    def stored(i: int, trace) -> None:
        if i not in p_full:
            p_full[i] = teacher_logprobs(teacher, trace.prompt_ids, list(refs[i]))
        kl = kl_rows(p_full[i], trace.model_logprobs)
        res = {"kl_forced": float(kl.mean()), "kl_steps": kl.tolist(),
               "cache_len": [int(r.cache_len) for r in trace.records]}
        got[i] = store.get_or_run(keys[i], lambda: res)

    for k in range(0, len(miss), batch):
        chunk = miss[k:k + batch]
        run_batch(teacher, None, [spec.prompts[i] for i in chunk], [cfgs[i] for i in chunk],
                  on_row=lambda b, tr, chunk=chunk: stored(chunk[b], tr))
    return got


def kvpress_runs(teacher, spec: RunSpec, presses: Sequence[str], budget: int, store: RunStore,
                 modes=MODES, sinks: int = 4, progress: bool = False) -> tuple[pd.DataFrame, list[dict], dict]:
    """Per (press, mode, prompt): ``kl_forced``, ``mean_len`` / ``peak_len`` (live entries of layer 0 after each
    step's evict phase); the ``full`` rows are the reference runs themselves (no eviction: KL 0).
    Returns ``(per_run, skipped, policies)``."""
    import time

    pols, skipped = study_policies(presses, budget, sinks, modes)
    full = _full_runs(teacher, spec, store)
    refs = [tuple(int(t) for t in r["steps"]["token_id"]) for r in full]
    rows = [{"press": FULL, "mode": "none", "prompt_idx": i, "kl_forced": 0.0,
             "mean_len": float(np.mean(r["steps"]["cache_len"])), "peak_len": max(r["steps"]["cache_len"])}
            for i, r in enumerate(full)]
    p_full: dict = {}
    for (name, mode), pol in pols.items():
        t0 = time.time()
        got = forced_kl_runs(teacher, spec, pol, refs, store, p_full)
        if progress:
            print(f"kvpress: {name} {mode}: {time.time() - t0:.0f} s", flush=True)
        for i, r in enumerate(got):
            lens = [int(x) for x in r["cache_len"]]
            rows.append({"press": name, "mode": mode, "prompt_idx": i, "kl_forced": float(r["kl_forced"]),
                         "mean_len": float(np.mean(lens)), "peak_len": max(lens)})
    return pd.DataFrame(rows), skipped, pols


def kvpress_summary(per_run: pd.DataFrame, budget: int, sinks: int, pols: dict | None = None) -> pd.DataFrame:
    """One row per (press, mode): means, and the paired difference of ``kl_forced`` to :data:`REFERENCE` at the
    same mode (bootstrap 95 % interval over prompts, and MDE: 2.8 × SD / √n)."""
    from kvlab.core.metrics import add_mde

    out = []
    for mode, g in per_run.groupby("mode", sort=False):
        g = g.assign(policy=g["press"])
        s = g.groupby("policy", sort=False).agg(kl_forced=("kl_forced", "mean"), kl_forced_std=("kl_forced", "std"),
                                                mean_len=("mean_len", "mean"), peak_len=("peak_len", "max"),
                                                n_prompts=("prompt_idx", "nunique")).reset_index()
        if REFERENCE in set(g.policy):
            pb = add_mde(paired_bootstrap(g, REFERENCE, metrics=("kl_forced",)), g, REFERENCE, ("kl_forced",))
            s = s.merge(pb, on="policy", how="left")
        s["mode"] = mode
        out.append(s)
    t = pd.concat(out, ignore_index=True).rename(columns={"policy": "press"})
    t["budget"] = [float("nan") if m == "none" else budget for m in t["mode"]]
    t["sinks"] = [float("nan") if m == "none" else sinks for m in t["mode"]]
    return t.reindex(columns=COLUMNS)


def kvpress_table(teacher, spec: RunSpec, presses: Sequence[str] = tuple(PRESSES), budget: int = 128,
                  store: RunStore | None = None, modes=MODES, sinks: int = 4,
                  progress: bool = False) -> tuple[pd.DataFrame, pd.DataFrame, list[dict]]:
    """``(table, per_run, skipped)`` of the kvpress study (module docstring): what the CLI calls."""
    if store is None:
        raise ValueError("store is required: a kvlab.store.RunStore (e.g. RunStore('runs')) so a rerun is free")
    per_run, skipped, pols = kvpress_runs(teacher, spec, presses, budget, store, modes, sinks, progress)
    return kvpress_summary(per_run, budget, sinks, pols), per_run, skipped


def table_notes(spec: RunSpec, budget: int, sinks: int, skipped: list[dict], command: str | None = None,
                prompt_note: str = "") -> list[str]:
    """What the .md under the table says: exactly what was run."""
    notes = [
        f"Runs: the embedded teacher alone (`mode='teacher'`), {len(spec.prompts)} prompts{prompt_note}, "
        f"{spec.tokens} new tokens, sampling T={spec.sampling.temperature}, top-p={spec.sampling.top_p}, seed "
        f"{spec.sampling.seed} + prompt index; decoded {spec.batch or 'default'} rows at a time (kvlab's batched "
        "decode). kvpress itself cannot produce these rows: its pipeline runs batch 1, and its decode-time "
        "compression (DecodingPress) is experimental; here every press runs unchanged through "
        "`kvlab.ScorerPolicy(press, budget, sinks)`.",
        f"`budget`: {budget} live entries per layer (kvlab's fixed budget; a press's compression_ratio does not size "
        f"the cache); `sinks`: {sinks} first positions never evicted (kvlab's rule, for every row). `mode`: "
        "`prefill` = prompt compression (`every_step=False`: one cut when the cache holds the prompt, then the cache "
        "grows by one entry per token, kvpress's own use); `decode` = decode-time eviction (`every_step=True`: cut "
        "back to the budget at every step). Scores per KV head are averaged over heads (kvlab keeps one live set per "
        "layer; figures/evict_kvpress_heads.md measures what that costs).",
        "Press settings: kvpress's defaults, except SnapKVPress(window_size=16) (kvpress's 64 is a sixth of these "
        "prompts), StreamingLLMPress(n_sink=4) and RandomPress(seed=0) (reproducible); kvlab.studies.kvpress.presses "
        "has each press's exact constructor. Decode-time rows show a press the layer inputs of the last 128 forwarded "
        "tokens (`inputs_window`, as kvpress's DecodingPress buffers hidden states).",
        "`sliding`: kvlab's native sliding window at the same budget and sinks — `SlidingWindow(window=budget, "
        "sinks)` in decode mode; in prefill mode the same keep rule once on the prompt (`ScorerPolicy(Recency(), "
        "budget, sinks)`, score = position). `full`: no eviction (the reference continuation's run; its "
        "`kl_forced` is 0 by construction).",
        "`kl_forced`: mean over the decode steps of KL(p_full ‖ p_evicted) in nats along the FULL cache's own "
        "sampled continuation of each prompt, teacher-forced (`DecodeConfig.forced`; the policy decides at every "
        "step) — the matched-memory eviction study's definition (evict_matched.md). `mean_len`: mean over steps of "
        "the live entries (layer 0, after the evict phase), then over prompts; `peak_len`: the largest. Memory is "
        "matched within a mode (same budget); prefill rows hold more entries than decode rows (the continuation).",
        "`d_kl_forced`: mean paired difference of `kl_forced` to `sliding` at the same mode on the same prompts "
        "(negative = the press is closer to the full cache than the sliding window); `_lo`/`_hi`: paired bootstrap "
        "95 % interval over prompts (2000 resamples, kvlab.harness.experiment.paired_bootstrap); `_mde`: the "
        "smallest difference detectable at this n (2.8 × SD / √n; 80 % power, α = 0.05).",
    ]
    if skipped:
        names = sorted({s["press"] for s in skipped if s["mode"] == "decode"})
        if names:
            notes.append(f"No decode row for {', '.join(names)}: they score the prefill only (their score asserts "
                         "hidden states as long as the cache), so kvlab refuses them for decode-time eviction.")
    if command:
        notes.append(f"Command: `{command}`")
    return notes


def write_kvpress(table: pd.DataFrame, out: Path, notes: Sequence[str], name: str = "evict_kvpress") -> list[Path]:
    return write_table(table.round(5), Path(out), name, notes=list(notes))


__all__ = ["COLUMNS", "forced_kl_runs", "kvpress_runs", "kvpress_summary", "kvpress_table", "references", "table_notes",
           "write_kvpress"]
