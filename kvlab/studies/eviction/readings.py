""""How to read this" texts of the eviction study (notebook 05): matched memory against the Conf-KV paper, the
needle, the sawtooth, one Conf-KV run's confidence and the survivors of one eviction. Computed from the
tables, so a reading stays true when the numbers change.
"""
from __future__ import annotations

import pandas as pd

from kvlab.harness.prose import CONFKV, HOW, OPENVINO, cap, interval_verdict, join, row_of, spread_sentence
from kvlab.harness.tableview import fmt, plural, single_prompt

# --- what the Conf-KV paper reports (quoted from the source) -----------------------------------------------------
CONFKV_GAP_CLOSED = 0.74          # Conf-KV-L closes 74 % of the sliding-window → full-cache PPL gap (GPT-2)
CONFKV_ABLATION = {"random_rate": 36.54, "confkv_recency": 32.08, "confkv_attention": 31.47, "confkv": 30.92}


def read_evict_matched(table: pd.DataFrame) -> str:
    """``evict_matched``: ``full``, ``confkv``, ablations and fixed-budget rows at matched memory."""
    one = single_prompt(table)
    full, ck = row_of(table, "full"), row_of(table, "confkv")
    if full is None or ck is None:
        raise ValueError("read_evict_matched needs rows 'full' and 'confkv'")
    parts = [HOW + "Every row decodes the same prompts with the same seeds. Lower teacher-PPL and lower KL to the "
             "full cache are better; Δ PPL vs full is the paired difference (0 = as good as keeping everything). "
             "Memory is matched: each fixed-budget family's budget was solved so its mean KV memory equals "
             "Conf-KV's (`memory vs target` ≈ 1). " + spread_sentence(table)]
    parts.append(f"Conf-KV keeps {fmt(float(ck.mean_mb) / float(full.mean_mb) * 100, 0)} % of the full cache's mean "
                 f"memory; its Δ PPL vs full: {interval_verdict(ck.d_teacher_ppl_vs_full, ck.d_teacher_ppl_vs_full_lo, ck.d_teacher_ppl_vs_full_hi, one)}.")
    fixed = table[table.matched_by == "solved budget"]
    if len(fixed):
        order = ", ".join(f"{r.policy} {fmt(r.teacher_ppl, 2)}" for r in fixed.sort_values("teacher_ppl").itertuples())
        beats = [r.policy for r in fixed.itertuples() if r.teacher_ppl > ck.teacher_ppl]
        parts.append(f"At the same memory, fixed budgets score (PPL, best first): {order}; Conf-KV "
                     f"({fmt(ck.teacher_ppl, 2)}) beats {len(beats)} of {len(fixed)}"
                     f"{' (' + ', '.join(beats) + ')' if beats else ''}.")
    sl = row_of(table, "sliding")
    if sl is not None and sl.teacher_ppl > full.teacher_ppl:
        closed = (sl.teacher_ppl - ck.teacher_ppl) / (sl.teacher_ppl - full.teacher_ppl)
        parts.append(f"Conf-KV closes {fmt(100 * closed, 0)} % of the sliding-window → full-cache PPL gap here; "
                     f"{CONFKV} reports {CONFKV_GAP_CLOSED:.0%} for Conf-KV-L on GPT-2.")
    abl = {p: row_of(table, p) for p in CONFKV_ABLATION}
    have = {p: float(r.teacher_ppl) for p, r in abl.items() if r is not None}
    if len(have) > 1:
        here = " > ".join(f"{p} {fmt(v, 2)}" for p, v in sorted(have.items(), key=lambda kv: -kv[1]))
        paper = " > ".join(f"{p} {CONFKV_ABLATION[p]}" for p in sorted(have, key=lambda p: -CONFKV_ABLATION[p]))
        same = sorted(have, key=have.get) == sorted(have, key=CONFKV_ABLATION.get)
        parts.append(f"Same schedule, other ranking (the paper's matched-rate ablation): here {here}; the paper: {paper}"
                     f" — {'the same order' if same else 'a different order'}.")
    off = table[(table.mem_vs_target - 1).abs() > 0.1]
    off = off[~off.policy.isin(["full"])]
    if len(off):
        parts.append("Not matched within 10 %: " + ", ".join(f"{r.policy} (×{fmt(r.mem_vs_target, 2)})"
                                                             for r in off.itertuples()) + " — compare those with care.")
    return join(parts)


def read_needle(table: pd.DataFrame) -> str:
    """The long needle table (``policy``, ``length``, ``depth``, ``accuracy``)."""
    acc = table.groupby("policy", sort=False)["accuracy"].mean()
    full = acc.get("full", float("nan"))
    n = int(table.groupby("policy")["n"].sum().max()) if "n" in table else len(table)
    parts = [HOW + "1.00 = every hidden passkey retrieved exactly; higher is better. Depth 0 hides the key at the "
             f"start of the haystack (oldest entries), 1 at the end. {plural(n, 'case')} per policy"
             f"{' — a handful: one miss moves a cell a lot' if n < 10 else ''}."]
    if full < 1:
        parts.append(f"The full cache itself retrieves only {fmt(full, 2)}: misses here are partly the model's, not "
                     "the eviction policy's.")
    else:
        parts.append("The full cache retrieves every key, so each miss below is the eviction policy's.")
    rest = acc.drop("full", errors="ignore").sort_values(ascending=False)
    parts.append("Mean accuracy: " + ", ".join(f"{p} {fmt(v, 2)}" for p, v in rest.items()) + ".")
    d0 = table[table.depth == table.depth.min()]
    deep = d0.groupby("policy", sort=False)["accuracy"].mean()
    lost = [p for p, v in deep.drop("full", errors="ignore").items() if v == 0]
    if lost and deep.get("full", 0) == 1:
        parts.append(f"At depth {fmt(float(table.depth.min()), 2)} (the oldest entries), where the full cache always "
                     f"retrieves the key, {', '.join(lost)} never do: they evicted it.")
    parts.append(f"{cap(CONFKV)} reports that Conf-KV preserves needle-in-a-haystack retrieval at matched memory; "
                 f"{OPENVINO} keeps a never-evicted start area and evicts whole blocks by accumulated attention.")
    return join(parts)


def read_survivors(frame: pd.DataFrame, live: list[int], prompt_len: int) -> str:
    """After eviction: how many of the prompt's ledger rows are still in the cache, and which."""
    alive = sorted(i for i in live if i < prompt_len)
    total = len(live)
    if not alive:
        what = "none of the prompt's entries survive: the cache holds only generated tokens"
    else:
        first = [i for i in alive if i < 8]
        what = (f"{len(alive)} of the prompt's {prompt_len} entries survive ({fmt(100 * len(alive) / prompt_len, 0)} %)"
                f"{f', {len(first)} of them among the first 8 (the attention sinks)' if first else ''}")
    return (HOW + f"Each column is a cache snapshot; a line joins a slot to the ledger row it holds. At the end the "
            f"cache holds {plural(total, 'entry', 'entries')}; {what}. Survivors keep their RoPE positions (lower panel).")


def read_confidence(records, gamma: float) -> str:
    """A Conf-KV run's records: how often it was confident (tight budget) and what the cache did."""
    recs = [r for r in records if r.signals.get("confidence") is not None]   # signals: a read-only mapping
    if not recs:
        return HOW + "No step carried a Conf-KV confidence (no eviction policy ran)."
    conf = [r for r in recs if r.signals.get("confidence") >= gamma]
    cut = [r for r in recs if r.evicted]
    lens = [r.cache_len for r in records]
    return (HOW + f"The upper line is Conf-KV's confidence per step (higher = surer), γ = {fmt(gamma, 2)} the dashed "
            "line: at or above it the tight budget applies, below it the loose one; the lower panel is the cache "
            f"length. {len(conf)} of {len(recs)} steps were confident; the cache was cut at "
            f"{plural(len(cut), 'step')}, and its length ranged {min(lens)}–{max(lens)} entries. "
            "Conf-KV's premise (from the paper): a confident step needs less context, so the cache can shrink "
            "there and grow back while the model is unsure — a sawtooth.")


def read_sawtooth(saw: pd.DataFrame) -> str:
    """``evict_sawtooth``: per-policy cache length per step on one prompt."""
    g = saw.groupby("policy", sort=False)["cache_len"]
    stats = ", ".join(f"{p} {int(lo)}–{int(hi)}" for p, (lo, hi) in g.agg(["min", "max"]).iterrows())
    ck = saw[saw.policy == "confkv"]
    ups = int((ck.cache_len.diff() > 0).sum()) if len(ck) else 0
    downs = int((ck.cache_len.diff() < 0).sum()) if len(ck) else 0
    return (HOW + f"Cache length per step on one prompt (lower = less memory; quality is in the table below). "
            f"Range per policy: {stats}. Conf-KV's cache grew at {plural(ups, 'step')} and was cut at "
            f"{plural(downs, 'step')}: {'a sawtooth' if ups and downs else 'no sawtooth on this run'}.")


__all__ = ["read_evict_matched", "read_needle", "read_survivors", "read_confidence", "read_sawtooth"]
