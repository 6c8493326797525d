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
