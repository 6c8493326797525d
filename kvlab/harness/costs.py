"""What a run cost, from its records: refreshes, teacher and probe tokens, teacher time and its share of the run
(:func:`run_costs`), and which model wrote each slot over a run (:func:`provenance`). Part of the experiment
harness: every study's cost columns come from here."""
from __future__ import annotations

import numpy as np



def run_costs(records) -> dict:
    """Per-run refresh cost from a trace's records.

    ``teacher_tokens`` = Σ|Δ_r| (refresh prefills) + probe tokens; ``teacher_s`` the teacher's
    compute time; ``teacher_pct`` = teacher time / the rest of the run's time (in-run overhead).
    """
    recs = list(records)
    out = {
        "refreshes": sum(1 for r in recs if r.refreshed),
        "teacher_tokens": sum(r.teacher_tokens for r in recs),
        "probe_tokens": sum(r.probe_tokens for r in recs),
        "delta_tokens": sum(r.teacher_tokens - r.probe_tokens for r in recs),
        "spliced": sum(r.spliced for r in recs),
        "teacher_s": sum(r.teacher_s for r in recs),
        "probes": sum(1 for r in recs if r.probed),
    }
    extra: dict[str, float] = {}
    for r in recs:
        for k, v in r.probe_cost:
            extra[f"probe_{k}"] = extra.get(f"probe_{k}", 0.0) + float(v)
    out.update(extra)
    total = recs[-1].elapsed_s if recs else 0.0
    rest = total - out["teacher_s"]
    out["teacher_pct"] = 100.0 * out["teacher_s"] / rest if rest > 0 else float("nan")
    return out


def provenance(decoding, every: int = 1):
    """Step a :class:`~kvlab.decode.Decoding` to the end, snapshotting which model wrote each slot.

    Returns ``(records, matrix)``: ``matrix[i, s]`` is 1 if slot ``s`` held a teacher-written entry
    after the ``i``-th snapshot (every ``every`` steps), 0 student, -1 empty.
    """
    records, rows = [], []
    for rec in decoding:
        records.append(rec)
        if rec.step % every == 0:
            rows.append([1 if w == "teacher" else 0 for w in decoding.cache.writers])
    width = max((len(r) for r in rows), default=0)
    mat = np.full((len(rows), width), -1, dtype=np.int8)
    for i, r in enumerate(rows):
        mat[i, :len(r)] = r
    return records, mat
