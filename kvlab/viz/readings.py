""""How to read this" texts, computed from the tables and figures they sit under: every study's in one place.

Every function takes the numbers a notebook shows and returns Markdown: which direction is better, what
the spread or interval means at this sample size, what the paper or blog found for the same quantity,
and whether this table agrees. Nothing is hard-coded about *this* run's outcome, so a reading stays
true when the numbers change (a retrained student, another prompt set, smoke settings).

Each study's readings live in its folder (``kvlab/studies/<study>/readings.py``: baselines, refresh, eviction,
mc), built from the shared pieces of :mod:`kvlab.harness.prose`; this module gathers them for the notebooks
(``from kvlab.viz import readings``) and holds the readings that belong to no study: one decode's ledger and
steps (notebook 01), one surgery tick (notebook 04), a sweep's Pareto front (notebook 07) and the smoke banner.
"""
from __future__ import annotations

import pandas as pd

from kvlab.harness.prose import (BLOG, BLOG_SETTING, CONFKV, HOW, OPENVINO, OVERFILL, cap,  # noqa: F401
                                 interval_verdict, join, spread_sentence)
from kvlab.harness.tableview import fmt, plural, single_prompt  # noqa: F401
from kvlab.studies.baselines.readings import BLOG_BASELINES, LOOPS, read_baselines, read_regimes  # noqa: F401
from kvlab.studies.eviction.readings import (CONFKV_ABLATION, CONFKV_GAP_CLOSED, read_confidence,  # noqa: F401
                                             read_evict_matched, read_needle, read_sawtooth, read_survivors)
from kvlab.studies.mc.readings import read_firings, read_mc_trace, read_phase_summary  # noqa: F401
from kvlab.studies.refresh.readings import (BLOG_ENTROPY, BLOG_PERIODIC, BLOG_SPECULATIVE, costs_frame,  # noqa: F401
                                            read_entropy, read_forced, read_methods, read_periodic, read_provenance,
                                            read_timing, read_trace)


def smoke_banner(smoke: bool) -> str:
    """The banner a notebook prints at its top in smoke mode (empty otherwise)."""
    if not smoke:
        return ""
    return ("> ⚠️ **Smoke mode** (`KVLAB_SMOKE=1`): tiny settings that check the code runs end to end. "
            "**The numbers check the code, not findings** — the readings below still describe them, but read "
            "findings from a full run (unset `KVLAB_SMOKE`).")


# --- notebook 01: one decode --------------------------------------------------------------------------------------
def read_ledger(ledger: pd.DataFrame, prompt_len: int, mode: str = "overfill") -> str:
    """The cache ledger of one decode (``KVCache.to_frame`` + a ``text`` column): prompt rows, y₁'s writer."""
    prompt = ledger[ledger.step == -1]
    gen = ledger[ledger.step >= 0]
    writers = ", ".join(f"{w} ×{n}" for w, n in prompt.writer.value_counts().items())
    parts = [HOW + f"One row per cache entry: token, RoPE position, the model that computed its K/V (`writer`) and "
             f"the decode step that wrote it. The first {prompt_len} rows are the prompt, written in one prefill "
             f"before any token is generated, hence `step = -1` ({writers})."]
    special = [t for t in prompt.get("text", pd.Series(dtype=str)) if t.startswith("<|") and t.endswith("|>")]
    if special:
        head = "".join(prompt.text.head(3)).replace("\n", "⏎")
        tail = "".join(prompt.text.tail(3)).replace("\n", "⏎")
        system = " (with a default system message first)" if "system" in "".join(prompt.text.head(4)) else ""
        parts.append(f"The prompt starts with `{head}` and ends with `{tail}`: the tokenizer's chat template wraps your "
                     f"text in role markers{system} — {plural(len(special), 'special token')} such as `{special[0]}` — so "
                     "the model answers as the assistant. They are real tokens in the cache, written like any other.")
    if len(gen):
        y1 = gen.iloc[0]
        if mode == "overfill":
            parts.append(f"The first generated entry (y₁, step {int(y1.step)}) shows writer **{y1.writer}**: the teacher's "
                         "prefill logits *chose* y₁, but y₁'s K/V is computed when the decoder reads it back at the next "
                         "step — the cache lags the emitted token by one entry — and in OverFill that decoder is the "
                         "student.")
        n_s = int((gen.writer == "student").sum())
        parts.append(f"Of the {len(gen)} generated entries, {n_s} are student-written.")
    return join(parts)


def read_steps(records) -> str:
    """One decode's step records: how unsure the decoder was, step by step."""
    recs = list(records)
    if not recs:
        return HOW + "No steps were decoded."
    import statistics

    h = [r.entropy_bits for r in recs]
    p1 = [r.top1_prob for r in recs]
    unsure = [r.step for r in recs if r.top1_prob < 0.5]
    by = ", ".join(f"{w} ×{n}" for w, n in pd.Series([r.source for r in recs]).value_counts().items())
    return (HOW + "`H` is the entropy of the next-token distribution in bits (0 = certain; high = many plausible "
            "tokens), `p1` the probability of the most likely token, `cache` the entries after the step, `by` the "
            f"model whose logits chose the token. Over {plural(len(recs), 'step')}: median H = "
            f"{fmt(statistics.median(h), 2)} bits, median p1 = {fmt(statistics.median(p1), 2)}; "
            f"{plural(len(unsure), 'step')} had p1 < 0.5 (the decoder was unsure there). Tokens chosen by: {by}.")


# --- notebook 04: one surgery tick --------------------------------------------------------------------------------
def read_tick(frame: pd.DataFrame, before: list[int], after: list[int], positions_after: list[int]) -> str:
    """One surgery tick: the ledger (``KVCache.ledger_frame``), the live maps before and after it, and the
    cache's per-slot positions after it (``KVCache.positions``), checked against the ledger rows'."""
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before))
    pos = dict(zip(frame.row, frame.position))
    kept = [r for r in after if r in set(before)]
    moved = sum(1 for r, p in zip(after, positions_after) if r in set(before) and p != pos[r])
    shifted = sum(1 for i, r in enumerate(kept) if before.index(r) != after.index(r))
    origins = frame[frame.row.isin(new)].origin.value_counts()
    what = ", ".join(f"{n} by `{o}`" for o, n in origins.items())
    return (HOW + f"Each column of the picture is the cache before / after the tick; a line joins a slot to the ledger "
            f"row it holds. The tick retired {plural(len(gone), 'row')} and wrote {plural(len(new), 'row')} ({what}); "
            f"the cache went from {len(before)} to {len(after)} entries. {plural(shifted, 'surviving entry', 'surviving entries')} "
            f"changed slot, {moved} changed position"
            + (": positions belong to the ledger row (no re-rotation), so the model still sees each survivor at its "
               "original distance" if moved == 0 else " (re-rotated)") + f" — from position {pos[after[0]] if after else 0} "
            f"to {max(pos[r] for r in after) if after else 0} now{', with gaps where rows were deleted' if gone else ''}.")


# --- notebook 07: a sweep -----------------------------------------------------------------------------------------
def read_pareto(summary: pd.DataFrame, x: str, y: str, mask) -> str:
    """Which configs are Pareto-optimal in (x cost, y quality), both lower-is-better."""
    front = summary[list(mask)].sort_values(x)
    return (HOW + f"Left panel: down and left is better (lower `{y}` for less `{x}`); the right panel reads the same "
            f"way for teacher-PPL against in-run teacher time. Circled in the left panel: the Pareto front, configs no other "
            f"config beats on both: {', '.join(front.policy)}. Every other point is dominated. "
            + spread_sentence(summary.assign(n_prompts=summary.get("n_runs", 1))))


__all__ = ["read_baselines", "read_periodic", "read_entropy", "read_methods", "read_timing", "read_forced",
           "costs_frame", "read_trace", "read_provenance", "read_evict_matched", "read_needle", "read_survivors",
           "read_pareto", "smoke_banner", "interval_verdict", "spread_sentence"]
