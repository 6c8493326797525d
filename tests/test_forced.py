"""Teacher-forced refresh study: caches built as described, KL 0 when student := teacher."""
from __future__ import annotations

import pytest

from kvlab.refresh.forced import condition_caches, forced_kl, forced_table
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
