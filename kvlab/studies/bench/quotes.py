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
    """The kept run of ``bench evict --batch``: per policy, batch size and context, the speed over the full cache's,
    the byte bound, the fraction of it reached, and the evicting step against a plain step at equal live length."""
    rows = jsonl(MEASURED_EVICT)
    lines = ["| policy | asked every | batch | context → mean live entries | speed-up over full | byte bound | "
             "fraction of bound | plain step's fraction | evicting / plain | asked step / plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["policy"] == "full":
            continue
        lines.append(f"| {r['policy']} | {_every(r)} | {r['batch']} | {r['cache_len']} → {fmt(r.get('mean_len'), 0)} | "
                     f"{fmt(r['speedup_vs_full'])}× | {fmt(r.get('bound'))}× | {fmt(r.get('frac_of_bound'))} | "
                     f"{fmt(plain_fraction(r, rows))} | {fmt(r.get('evict_vs_plain'))}{_interval(r)} | {_asked(r)} |")
    full = [r for r in rows if r["policy"] == "full"]
    ctrl = ", ".join(f"batch {r['batch']}: {fmt(r.get('evict_vs_plain'))}" for r in full)
    beside = all("full_ms" in r for r in rows)             # the full cache stepped beside each policy (3d000eb on)
    return ("\n".join(lines) + ("\n\n*Each row against the full cache stepped beside it in the same block (the order "
                                 "rotating per step)" if beside else "\n\n*Each row against the full cache in the same "
                                 "run") + f", {rows[0]['steps']} steps; the full "
            f"cache's own evicting / plain (the noise control): {ctrl}. The plain step's fraction: the full cache's step "
            "time over a plain step's (forward only) at the policy's mean length, divided by the bound: the fraction this "
            "machine's plain loop reaches, i.e. what an eviction costing nothing would reach. A policy asked every N "
            "steps is timed over whole N-step periods that start at an asked step (its decision and edit spread over the "
            "steps they serve); asked step / plain: the asked step alone"
            + (" (runs before commit 637b176 took the median step, which left the asked step out)" if not any(
                "asked_ms" in r for r in rows) else "") + ".* "
            + measured_note(rows, MEASURED_EVICT))


def _every(r: dict) -> str:
    """How often a row's policy was asked: ``step`` or ``N steps``, and ``(resident)`` when its rows ran resident
    (:mod:`kvlab.cache.resident`)."""
    every = r.get("every", 1)
    return ("step" if every == 1 else f"{every} steps") + (" (resident)" if r.get("resident") else "")


def _asked(r: dict) -> str:
    """A row's asked step over its plain step (– when the run timed no asked step apart)."""
    return fmt(r["asked_ms"] / r["plain_ms"]) if r.get("asked_ms") and r.get("plain_ms") else "–"


def _interval(r: dict) -> str:
    """`` [lo, hi]``: a row's bootstrap interval of evicting / plain (runs from ``1229528`` on), else nothing."""
    lo, hi = r.get("evict_vs_plain_lo"), r.get("evict_vs_plain_hi")
    return "" if lo is None or hi is None else f" [{fmt(lo)}, {fmt(hi)}]"


def plain_fraction(r: dict, rows: list[dict]) -> float | None:
    """``r``'s ``plain_frac_of_bound`` (older runs: from the same run's full-cache row, ``r``'s ``plain_ms`` and bound)."""
    if r.get("plain_frac_of_bound") is not None:
        return r["plain_frac_of_bound"]
    full = [f for f in rows if f["policy"] == "full" and (f["batch"], f["cache_len"]) == (r["batch"], r["cache_len"])]
    if not full or not r.get("plain_ms") or not r.get("bound"):
        return None
    return full[0]["step_ms"] / r["plain_ms"] / r["bound"]


MEASURED_EVICT_CI = "docs/measured/evict_vs_plain_ci.jsonl"
# the kept interval runs before it, shown under it: path -> the machine and packing library, for runs made before
# bench rows recorded theirs (the bench's ratios differ between CPU models and libraries: the per-step eager attention
# costs more than SDPA on one CPU and less on the other; oneDNN's products made the EPYC's plain step a third shorter)
EARLIER_EVICT_CI = {
    "docs/measured/evict_vs_plain_ci_zen5_63848bf.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 26's first run, asked at every step, before resident "
        "Conf-KV's decision took fewer passes; its +dirty: docs)",
    "docs/measured/evict_vs_plain_ci_zen5_ee5425f.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 25's run, asked every 16 steps, before resident rows)",
    "docs/measured/evict_vs_plain_ci_zen5_7d936d8_run2.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 24's second run, the plain step's attention eager; "
        "before the views stopped copying the live maps)",
    "docs/measured/evict_vs_plain_ci_zen5_7d936d8.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 24's first run, the same code in an earlier process; "
        "there the bench's timing chose SDPA for the plain step's attention)",
    "docs/measured/evict_vs_plain_ci_zen5_957a0a6_run1.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 23's first run, before a batch's rows evicted at once)",
    "docs/measured/evict_vs_plain_ci_zen5_957a0a6.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 23's second run, a later process on the same code)",
    "docs/measured/evict_vs_plain_ci_zen5_fda6698.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 22's first run, before block eviction's rows filled "
        "their evictions and Scissorhands' measured steps counted their low queries at once)",
    "docs/measured/evict_vs_plain_ci_zen5_a265585.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 22's second run, a later process on the same library "
        "code as the first: its +dirty was an edit made after the run had loaded its modules)",
    "docs/measured/evict_vs_plain_ci_zen5_4ee9708.jsonl":
        "cpu AMD EPYC (family 26 model 2) ×2 · onednn (session 21's run, before the column sums and their fold took "
        "every layer at once)",
    "docs/measured/evict_vs_plain_ci_epyc_1484f8a.jsonl":
        "cpu AMD EPYC ×2 · onednn (session 20's VM; its CPU family was not recorded, its plain step about 1.8 times "
        "session 21's)",
    "docs/measured/evict_vs_plain_ci_epyc_180c259.jsonl":
        "cpu AMD EPYC ×2 · mkl (session 20's run before the packing library was timed and rows named their machine)",
    "docs/measured/evict_vs_plain_ci_xeon.jsonl":
        "cpu Intel Xeon ×2 · mkl (a 2-core VM, named in session 19's note: the run predates the machine field)"}
LINE = 1.05                 # issue 36's line for evicting / plain at batch 8


def _machine(r: dict, fallback: str | None = None) -> str:
    """A kept row's CPU in short (``AMD EPYC ×2``): its ``machine`` field up to the first comma, and its packing
    library (``· onednn``) where the row names one; else ``fallback`` up to its parenthesis."""
    if not r.get("machine"):
        return (fallback or "?").split(" (")[0].removeprefix("cpu ").removeprefix("gpu ")
    m = r["machine"].split(",")[0].removeprefix("cpu ").removeprefix("gpu ")
    attn = (r.get("decode_attention") or "").removeprefix("auto: ")
    return m + "".join(f" · {x}" for x in (r.get("packed"), attn and f"{attn} attention") if x)


def _where(r: dict) -> str:
    """A kept row's device, with its CPU in short where the run recorded it (``cpu, AMD EPYC ×2``)."""
    dev = r.get("device", "?")
    return f"{dev}, {_machine(r)}" if r.get("machine") and dev == "cpu" else dev


def evict_ci_table(figures: Path) -> str:
    """The kept longer runs of ``bench evict --batch`` (more repeats, fewer policies), one per machine: each policy's
    evicting / plain with its bootstrap interval over paired periods, and where the interval sits against the 1.05
    line."""
    runs = [(MEASURED_EVICT_CI, None), *EARLIER_EVICT_CI.items()]
    lines = ["| policy | machine | asked every | batch | context → mean live entries | periods | evicting / plain "
             "[95 % interval] | totals | asked step / plain | against 1.05 |", "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for path, fallback in runs:
        rows = [r for r in jsonl(path) if r["policy"] != "full"]
        for r in rows:
            lo, hi = r.get("evict_vs_plain_lo"), r.get("evict_vs_plain_hi")
            side = "–" if lo is None else ("above" if lo > LINE else "below" if hi <= LINE else "the interval holds it")
            lines.append(f"| {r['policy']} | {_machine(r, fallback)} | {_every(r)} | {r['batch']} | {r['cache_len']} → "
                         f"{fmt(r.get('mean_len'), 0)} | {r.get('periods', '–')} | {fmt(r.get('evict_vs_plain'))} "
                         f"[{fmt(lo)}, {fmt(hi)}] | {fmt(r.get('evict_vs_plain_sum'))} | {_asked(r)} | {side} |")
        notes.append(measured_note(rows, path) + ("" if fallback is None or rows[0].get("machine") else
                                                   f" *Machine: {fallback}.*"))
    return ("\n".join(lines) + "\n\n*Evicting / plain: the policy's whole periods (asked step included) against the "
            "plain step at its mean live length stepped beside it, median over periods; the interval: 95 % percentile "
            "bootstrap over the paired periods (`kvlab.studies.bench.timing.ratio_interval`); totals: the same periods' "
            "summed times divided (a cost paid in one period of several, such as a compaction, counts in full; – where "
            "the run predates the field). Above: the whole interval is over 1.05. Between two runs on one machine "
            "the point moves by about 0.05 (docs/measured/decode_attn), more than one run's interval says.* " + " ".join(notes))


VIEWS = {
    "bench_decode": decode_table,
    "bench_evict": evict_table,
    "bench_evict_ci": evict_ci_table,
}


def _kept(row: dict, distinct: int) -> str:
    """`` [~N]``: a row's mean live entries, when the rows of its (batch, context) keep different numbers."""
    return f" [~{round(float(row['mean_len']))}]" if distinct > 1 and row.get("mean_len") is not None else ""


def key_results(figures: Path) -> list[tuple[str, str, str]]:
    """README's key results: the speed each eviction policy gives where the cache dominates (the kept run of
    ``bench evict --batch``: speed-up over the full cache and the fraction of the byte bound, per batch and context)."""
    rows = [r for r in jsonl(MEASURED_EVICT) if r["policy"] != "full"]
    out = []
    for batch, ctx, every in dict.fromkeys((r["batch"], r["cache_len"], r.get("every", 1)) for r in rows):
        part = [r for r in rows if (r["batch"], r["cache_len"], r.get("every", 1)) == (batch, ctx, every)]
        lens = sorted({round(float(r["mean_len"])) for r in part if r.get("mean_len") is not None})
        kept = (f"cut to ~{lens[0]}" if len(lens) == 1 else "cut to the mean live entries in brackets")
        asked = "" if every == 1 else f", each policy asked every {every} steps"
        out.append((f"Eviction speed, batch {batch}, {ctx:,} entries {kept}{asked} "
                    f"({_where(part[0])}): speed-up over the full cache (fraction of the byte bound)",
                    ", ".join(f"{r['policy']}{_kept(r, len(lens))} {fmt(r['speedup_vs_full'], 2)}× "
                              f"({fmt(r.get('frac_of_bound'), 2)})" for r in part), "docs/benchmarks.md"))
    return out


__all__ = ["VIEWS", "key_results", "MEASURED_BENCH", "MEASURED_EVICT", "MEASURED_EVICT_CI", "decode_table", "evict_table",
           "evict_ci_table"]
