"""README's eviction-speed row (kvlab.studies.bench.quotes.key_results): each policy's speed-up over the full cache
and fraction of the byte bound, read from the kept bench run, saying how many entries each row kept when the
policies of one (batch, context) keep different numbers (Conf-KV keeps twice the others in `bench evict`)."""
from __future__ import annotations

import json

from kvlab.studies.bench import quotes


def _row(policy, mean_len, speedup, frac):
    return {"policy": policy, "batch": 8, "cache_len": 4096, "mean_len": mean_len, "speedup_vs_full": speedup,
            "frac_of_bound": frac, "device": "cpu"}


def test_the_speed_row_names_each_policys_kept_entries_when_they_differ(tmp_path, monkeypatch):
    path = tmp_path / "evict.jsonl"
    rows = [_row("full", 4105.0, 1.0, 1.0), _row("sliding", 1025.0, 1.49, 0.666), _row("confkv", 2049.0, 0.981, 0.619)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(quotes, "MEASURED_EVICT", str(path))
    (what, text, where), = quotes.key_results(tmp_path)
    assert "4,096 entries cut to the mean live entries in brackets" in what
    assert text == "sliding [~1025] 1.49× (0.67), confkv [~2049] 0.98× (0.62)" and where == "docs/benchmarks.md"

    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))          # one kept length: said once
    (what, text, _), = quotes.key_results(tmp_path)
    assert "cut to ~1025 (cpu)" in what and text == "sliding 1.49× (0.67)"

    rows = [{**r, "machine": "cpu AMD EPYC ×2, torch 2.13.0, transformers 5.23.0"} for r in rows[:2]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))              # the run named its machine
    (what, _, _), = quotes.key_results(tmp_path)
    assert "cut to ~1025 (cpu, AMD EPYC ×2)" in what


def test_the_interval_table_places_each_interval_against_the_line(tmp_path, monkeypatch):
    """bench_evict_ci: above when the whole interval is over 1.05, below when it is all at or under it, else the
    interval holds it; no interval (under 3 periods) says so with a dash."""
    def row(policy, point, lo, hi):
        return {"policy": policy, "every": 16, "batch": 8, "cache_len": 4096, "mean_len": 1032.4, "periods": 18,
                "evict_vs_plain": point, "evict_vs_plain_lo": lo, "evict_vs_plain_hi": hi, "asked_ms": 150.0,
                "plain_ms": 100.0, "device": "cpu", "dtype": "torch.float32", "command": "c", "commit": "abc"}

    path = tmp_path / "ci.jsonl"
    rows = [row("h2o", 1.1, 1.07, 1.12), row("sliding", 1.03, 1.0, 1.04), row("snapkv", 1.04, 1.0, 1.06),
            row("block", 1.1, None, None), row("full", 1.0, 0.99, 1.01)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(quotes, "MEASURED_EVICT_CI", str(path))
    monkeypatch.setattr(quotes, "EARLIER_EVICT_CI", {})
    table = quotes.evict_ci_table(tmp_path)
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in table.splitlines() if ln.startswith("| ")}
    assert lines["h2o"].endswith("| above |") and "1.100 [1.070, 1.120]" in lines["h2o"]
    assert lines["sliding"].endswith("| below |") and lines["snapkv"].endswith("| the interval holds it |")
    assert lines["block"].endswith("| – |") and "full" not in lines
    assert "| ? | 16 steps | 8 | 4096 → 1032 | 18 |" in lines["h2o"] and "| 1.500 |" in lines["h2o"]


def test_the_interval_table_shows_each_machines_run(tmp_path, monkeypatch):
    """Runs on two CPUs: one row per (run, policy), each naming its machine (the row's own field, or the label kept
    for a run made before rows recorded it), and a note under the table for each run."""
    def row(policy, machine=None):
        r = {"policy": policy, "every": 16, "batch": 8, "cache_len": 4096, "mean_len": 1032.4, "periods": 18,
             "evict_vs_plain": 1.03, "evict_vs_plain_lo": 1.01, "evict_vs_plain_hi": 1.04, "device": "cpu",
             "dtype": "torch.float32", "command": "c", "commit": "abc"}
        return {**r, "machine": machine} if machine else r

    new, old = tmp_path / "new.jsonl", tmp_path / "old.jsonl"
    new.write_text(json.dumps({**row("h2o", "cpu AMD EPYC ×2, torch 2.13.0, transformers 5.23.0"), "packed": "onednn"})
                   + "\n")
    old.write_text(json.dumps(row("h2o")) + "\n")
    monkeypatch.setattr(quotes, "MEASURED_EVICT_CI", str(new))
    monkeypatch.setattr(quotes, "EARLIER_EVICT_CI", {str(old): "cpu Intel Xeon ×2 (a VM)"})
    table = quotes.evict_ci_table(tmp_path)
    rows = [ln for ln in table.splitlines() if ln.startswith("| h2o |")]
    assert [ln.split(" | ")[1] for ln in rows] == ["AMD EPYC ×2 · onednn", "Intel Xeon ×2"]
    assert "(cpu AMD EPYC ×2, torch 2.13.0" in table and "*Machine: cpu Intel Xeon ×2 (a VM).*" in table
    assert [ln.split(" | ")[7] for ln in rows] == ["–", "–"]                    # no totals before the field
    new.write_text(json.dumps({**row("h2o", "cpu AMD EPYC (family 26 model 2) ×2, torch 2.13.0"), "packed": "onednn",
                               "decode_attention": "auto: eager", "evict_vs_plain_sum": 1.046}) + "\n")
    got = [ln for ln in quotes.evict_ci_table(tmp_path).splitlines() if ln.startswith("| h2o |")][0].split(" | ")
    assert got[1] == "AMD EPYC (family 26 model 2) ×2 · onednn · eager attention" and got[7] == "1.046"
