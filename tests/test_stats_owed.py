"""Deferring rows owe their statistics' zero columns (kvlab.cache.stats.AttnStats._pad_stacked): a deferred step
appends no column to the row's matrices; lengths, the per-step check and every read count the owed columns, and the
first read (the fold, a copy, a rollback) pays them. The statistics equal a row measured at every step."""
from __future__ import annotations

import torch

from kvlab.cache.batch import forward_rows
from test_column_stats import SETTINGS, measured_and_deferred, steps
from test_deferred_stats import assert_same


def test_deferred_steps_owe_columns_until_a_read(tiny_teacher):
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[1])
    st = caches[1]._stats
    steps(tiny_teacher, banks, caches, toks[:5], 1)
    assert st._owed == 4                                       # the first deferred step padded; four owed since
    widths = {int(m.shape[1]) for m in (st._matrix(k, pay=False) for k in st._data)}
    assert widths == {len(caches[1]) - 4}
    assert st._lengths() == caches[1].layer_lengths()           # lengths count what is owed
    caches[1].check()                                           # the invariant holds with columns owed
    copy = caches[1].copy()                                     # a copy reads: it pays
    assert st._owed == 0 and copy._stats._owed == 0
    assert_same(caches[0], copy)
    assert_same(*caches)


def test_a_failed_step_leaves_owed_columns_consistent(tiny_teacher):
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[0])
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    n = len(caches[1])
    layers = tiny_teacher.model.model.layers

    def boom(*_):
        raise RuntimeError("boom")

    h = layers[-1].register_forward_hook(boom)
    try:
        try:
            forward_rows(banks[1], tiny_teacher.model, [None, caches[1]], [None, 5], writer="teacher",
                         steps=[0, 4], defer=[False, True])
        except RuntimeError:
            pass
    finally:
        h.remove()
    assert len(caches[1]) == n and caches[1]._stats._lengths() == caches[1].layer_lengths()
    caches[1].check()
    steps(tiny_teacher, banks, caches, toks[3:6], 4)
    assert_same(*caches)
    assert torch.equal(caches[1].layer_attn()["count"][0], caches[0].layer_attn()["count"][0])
