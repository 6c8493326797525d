"""What README.md and docs/*.md quote from the benchmarks (``kvlab.viz.docs`` renders it): the kept runs of
``bench decode --batch`` and ``bench evict --batch`` under ``docs/measured/``.
"""
from __future__ import annotations

from pathlib import Path

from kvlab.harness.quotes import jsonl, measured_note
from kvlab.harness.tableview import fmt


MEASURED_BENCH = "docs/measured/decode_bench_batch.jsonl"
MEASURED_EVICT = "docs/measured/evict_bench_batch.jsonl"


def decode_table(figures: Path) -> str:
    """The kept run of ``bench decode --batch``: kvlab vs HF ``generate`` per batch size, and the batch-8 variants
    against the plain batched loop."""
    rows = jsonl(MEASURED_BENCH)
    lines = ["| batch | mode | kvlab tok/s | HF tok/s | kvlab / HF | gain over batch 1: kvlab / HF | vs the plain "
             "batched loop |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ratio" in r:
            gain = (f"{fmt(r['kvlab_gain_vs_b1'], 2)}× / {fmt(r['hf_gain_vs_b1'], 2)}×"
                    if "kvlab_gain_vs_b1" in r else "–")
            lines.append(f"| {r['batch']} | {r['mode']} | {fmt(r['kvlab_tok_s'], 1)} | {fmt(r['hf_tok_s'], 1)} | "
                         f"{fmt(r['ratio'])} | {gain} | – |")
        else:
            lines.append(f"| {r['batch']} | {r['mode']} | {fmt(r['kvlab_tok_s'], 1)} | – | – | – | "
                         f"{fmt(r['vs_plain'])} (plain {r.get('plain_mode', '?')}: {fmt(r['plain_tok_s'], 1)} tok/s) |")
    return "\n".join(lines) + "\n\n" + measured_note(rows, MEASURED_BENCH)


def evict_table(figures: Path) -> str:
    """The kept run of ``bench evict --batch``: each policy's decode speed over the full cache's, per batch size."""
    rows = jsonl(MEASURED_EVICT)
    batches = sorted({r["batch"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "full"))
    sp = {(r["policy"], r["batch"]): r["speedup_vs_full"] for r in rows}
    lines = ["| policy | " + " | ".join(f"batch {b}" for b in batches) + " |", "|---" * (len(batches) + 1) + "|"]
    lines += [f"| {p} | " + " | ".join(f"{fmt(sp[(p, b)])}×" if (p, b) in sp else "–" for b in batches) + " |"
              for p in policies]
    r = rows[0]
    return ("\n".join(lines) + f"\n\n*Speed over the full cache's in the same run, a {r['cache_len']}-entry cache "
            f"evicted to about {min(x['final_len'] for x in rows)} entries, {r['steps']} steps.* " + measured_note(rows, MEASURED_EVICT))


VIEWS = {
    "bench_decode": decode_table,
    "bench_evict": evict_table,
}


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: none from the benchmarks (its numbers are quoted in its own pages)."""
    return []


__all__ = ["VIEWS", "key_results", "MEASURED_BENCH", "MEASURED_EVICT", "decode_table", "evict_table"]
