"""Evictions that fill their dead columns (kvlab.cache.buffer.BufferLayer.drop with ``fill``; kvlab.cache.evict.FILL,
turned on here whatever the default): a bank row whose statistics wait in bank columns (deferred) leaves no holes
when it evicts; its last survivors move into the freed columns and its columns leave slot order (``order``). The row
then holds the same entries, statistics and logits as a row that kept holes; every read in slot order (``kv``) puts
it back in order first, a pooled deferred step pools in slot order over the permuted columns. A measured row fills
too when ``FILL_MEASURED`` is on (off by default, see there; the tests here turn it on where they compare both):
a one-query measured step reads its mass in column order and puts it in slot order; a measured step of several
tokens puts the row back in order first."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import evict as evict_mod
from kvlab.cache.batch import Bank, forward_rows
from test_column_stats import SETTINGS, base, columns_zero, measured_and_deferred, steps
from test_deferred_stats import assert_same


@pytest.fixture(autouse=True)
def filling(monkeypatch):
    """Filling evictions on (``kvlab.cache.evict.FILL``; on by default since session 21, see there; set here so the
    tests hold whatever the default); measured rows keep holes (``FILL_MEASURED`` off) unless a test turns it on."""
    monkeypatch.setattr(evict_mod, "FILL", True)
    monkeypatch.setattr(evict_mod, "FILL_MEASURED", False)


def same_entries(a, b):
    """The two caches hold the same live entries with the same keys and values (read in slot order; entries written
    after a fill come from an attention summed in another order: equal within float rounding)."""
    assert a._mirror.lives == b._mirror.lives
    for i in range(a.num_layers):
        for x, y in zip(a.kv(i), b.kv(i)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def permuted(c) -> bool:
    lays = c._store.layers
    return any(lay.order is not None and not torch.equal(lay.live_offsets(), torch.arange(lay.n)) for lay in lays) \
        and not any(lay.holes for lay in lays)


@pytest.mark.parametrize("setting", SETTINGS[:2])
@pytest.mark.parametrize("per_layer", [None, "equal", "unequal"])
def test_filled_rows_equal_rows_with_holes(tiny_teacher, setting, per_layer):
    """Row 1 defers (its evictions fill), row 0 is measured every step (its evictions leave holes): after evictions
    of the oldest, middle and newest entries, uniform or per layer (equal counts: one pass; unequal: per layer),
    and more steps, both hold the same entries and statistics; the filled row's columns are out of order."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, setting, n=24)
    steps(tiny_teacher, banks, caches, toks[:4], 1)
    L = caches[0].num_layers
    for r, c in enumerate(caches):
        n = len(c)
        if per_layer is None:
            c.evict([1, 3, n - 6, n - 2])
        else:
            layers = [[1 + i % 3, n - 3 - i % 2] + ([n - 1] if per_layer == "unequal" and i % 2 else [])
                      for i in range(L)]
            c.evict([], layers=layers)
    assert permuted(caches[1]) and caches[1]._stats.columns_deferred
    assert not permuted(caches[0]) and any(lay.holes for lay in caches[0]._store.layers)
    steps(tiny_teacher, banks, caches, toks[4:9], 5)
    assert permuted(caches[1])                                    # steps append after the permuted entries
    assert_same(*caches)
    assert columns_zero(banks[1])
    for c in caches:                                              # a second eviction of a permuted row
        c.evict([0, 2, min(c.layer_lengths()) - 1])
    steps(tiny_teacher, banks, caches, toks[9:12], 10)
    assert_same(*caches)
    same_entries(*caches)                                         # (reading in slot order puts it back in order)
    assert not any(lay.order is not None for lay in caches[1]._store.layers)


def test_filled_rows_decode_the_same_logits(tiny_teacher):
    """One bank, two rows from the same prompt, both deferring: one evicts with fill (default), the other by marking
    holes (fill off): every later step's logits agree within float tolerance (the attention reads the same entries
    in another column order)."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[0], n=20)
    bank = banks[1]
    other = bank.adopt(0, caches[1])
    rows = [other, caches[1]]
    for j, t in enumerate(toks[:3]):
        forward_rows(bank, tiny_teacher.model, rows, [t, t], writer="teacher", steps=[j + 1] * 2, defer=[True] * 2)
    rows[1].evict([2, 4, 9, len(rows[1]) - 1])
    evict_mod.FILL = False                                        # (the fixture restores it)
    rows[0].evict([2, 4, 9, len(rows[0]) - 1])
    assert permuted(rows[1]) and any(lay.holes for lay in rows[0]._store.layers)
    for j, t in enumerate(toks[3:9]):
        logits = forward_rows(bank, tiny_teacher.model, rows, [t, t], writer="teacher", steps=[j + 4] * 2,
                              defer=[True] * 2)
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert_same(*rows)


def test_permuted_rows_step_in_order(tiny_teacher):
    """A measured step (its mass is picked in column order) on a permuted row puts the row back in slot order first;
    the statistics stay those of the row with holes."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[0], n=20)
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    for c in caches:
        c.evict([1, 5, len(c) - 2])
    assert permuted(caches[1])
    forward_rows(banks[1], tiny_teacher.model, [None, caches[1]], [None, toks[3]], writer="teacher",
                 steps=[0, 4], attention=[False, True])
    forward_rows(banks[0], tiny_teacher.model, [caches[0], None], [toks[3], None], writer="teacher",
                 steps=[4, 0], attention=[True, False])
    assert not any(lay.order is not None for lay in caches[1]._store.layers)
    assert_same(*caches)


@pytest.mark.parametrize("per_layer", [False, True])
def test_pooled_permuted_rows_pool_in_slot_order(tiny_teacher, per_layer):
    """A pooling row (a max-pool over each entry and its next ones, block eviction's scores) whose statistics wait in
    bank columns fills its evictions too: its deferred steps pool in slot order over the permuted columns
    (``ColumnSink``'s ``slots``), so it stays permuted, moves no more than it evicts, and holds the statistics of the
    same row measured at every step (which keeps holes and picks its mass in slot order)."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[2], n=24)
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    L = caches[0].num_layers
    for k, c in enumerate(caches):
        if per_layer:                                       # each layer its own slots (equally many)
            c.evict([], layers=[[i % 3, 7 + i, len(c) - 4 + i % 2] for i in range(L)])
        else:
            c.evict([2, 3, 9, len(c) - 3])
    assert permuted(caches[1])
    assert_same(*caches)
    for j in range(2):                                      # two asks' worth: steps, an eviction, steps
        steps(tiny_teacher, banks, caches, toks[3 + 4 * j:7 + 4 * j], 4 + 4 * j)
        assert permuted(caches[1]) and caches[1]._stats.pending               # not put back in order, deferred
        assert_same(*caches)
        for c in caches:
            c.evict([0, 4, len(c) - 6])
    steps(tiny_teacher, banks, caches, toks[11:14], 12)
    assert permuted(caches[1])
    assert_same(*caches)


def test_swap_and_copy_keep_a_permuted_row(tiny_teacher):
    """A permuted row swapped to another slot, and a copy of it, hold the same entries as the row with holes."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[0], n=20)
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    for c in caches:
        c.evict([0, 6, len(c) - 3])
    assert permuted(caches[1])
    banks[1].swap(0, 1)
    assert permuted(caches[1])
    same_entries(caches[0], caches[1].copy())
    same_entries(*caches)


def test_queued_moves_of_several_rows(tiny_teacher):
    """Filling evictions queue their column moves in the bank; the next forward does every row's at once. Three rows
    of one bank from one prompt: rows 0 and 1 fill (row 0 twice before the forward: the queued moves are done before
    its second eviction), row 2 evicts row 0's slots leaving holes; rows 0 and 2 then decode the same logits and hold
    the same statistics and entries."""
    from kvlab.cache.batch import Bank

    _, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[1], n=24)
    big = Bank.for_model(tiny_teacher.model, 3, capacity=64)
    rows = [big.adopt(b, caches[1]) for b in range(3)]
    for j, t in enumerate(toks[:3]):
        forward_rows(big, tiny_teacher.model, rows, [t] * 3, writer="teacher", steps=[j + 1] * 3, defer=[True] * 3)
    first, second = [1, 4, 20, 25], [0, 3, 21]
    rows[0].evict(first)
    rows[1].evict([2, 7, 8, 26])
    assert len(big.moves) == 2
    rows[0].evict(second)
    assert [r for r, _, _, _ in big.moves] == [0]                # the queue was done before row 0's second eviction
    evict_mod.FILL = False
    rows[2].evict(first)
    rows[2].evict(second)
    assert permuted(rows[0]) and permuted(rows[1]) and any(lay.holes for lay in rows[2]._store.layers)
    for j, t in enumerate(toks[3:8]):
        logits = forward_rows(big, tiny_teacher.model, rows, [t] * 3, writer="teacher", steps=[j + 4] * 3,
                              defer=[True] * 3)
        assert not big.moves
        torch.testing.assert_close(logits[0], logits[2], rtol=1e-5, atol=1e-5)
    assert_same(rows[2], rows[0])
    same_entries(rows[2], rows[0])


def two_measured(lm, setting, n=20, rows=1):
    """The same prefill in two banks, ``rows`` rows each, every row measured at every step."""
    src, toks = base(lm, setting, n)
    banks = [Bank.for_model(lm.model, rows + 1, capacity=64) for _ in range(2)]
    return banks, [[bank.adopt(b, src) for b in range(rows)] for bank in banks], toks


def measured_steps(lm, banks, rows, toks, start, tokens=1):
    """Every row of both banks measured at each step (``tokens`` at a time); returns each step's logits per bank."""
    out = []
    for j in range(0, len(toks), tokens):
        got = []
        for bank, cs in zip(banks, rows):
            k = len(cs)
            t = toks[j] if tokens == 1 else toks[j:j + tokens]
            got.append(forward_rows(bank, lm.model, cs + [None], [t] * k + [None], writer="teacher",
                                    steps=[start + j] * k + [0], attention=[True] * k + [False])[:k])
        out.append(got)
    return out


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("per_layer", [None, "equal", "unequal"])
def test_measured_rows_fill_and_read_their_mass_in_slot_order(tiny_teacher, monkeypatch, setting, per_layer):
    """Bank 1's measured rows fill their evictions (``FILL_MEASURED``), bank 0's leave holes: after evictions of old,
    middle and newest entries (uniform or per layer; two rows evicting alike: one pass for both, ``evict_rows``) and
    more one-token measured steps, the filled rows stay permuted (no compaction) and hold the same statistics, and
    every step's logits agree; a second eviction, and a measured step of two tokens (back in order first) too."""
    from kvlab.cache.evict_rows import evict_rows

    banks, rows, toks = two_measured(tiny_teacher, setting, n=24, rows=2)
    measured_steps(tiny_teacher, banks, rows, toks[:3], 1)
    L = rows[0][0].num_layers

    def cut(c, extra=0):
        n = min(c.layer_lengths())
        if per_layer is None:
            return [[1, 3 + extra, n - 6, n - 2]] * L
        return [[1 + i % 3, n - 3 - i % 2] + ([n - 1] if per_layer == "unequal" and i % 2 else []) for i in range(L)]

    for fill, cs in ((False, rows[0]), (True, rows[1])):
        monkeypatch.setattr(evict_mod, "FILL_MEASURED", fill)
        evict_rows(cs, [cut(c) for c in cs])
    assert all(permuted(c) for c in rows[1]) and not any(permuted(c) for c in rows[0])
    assert all(any(lay.holes for lay in c._store.layers) for c in rows[0])
    for got in measured_steps(tiny_teacher, banks, rows, toks[3:8], 4):
        torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)
    assert all(permuted(c) for c in rows[1])                     # measured one token at a time: still permuted
    for a, b in zip(*rows):
        assert_same(a, b)
    for fill, cs in ((False, rows[0]), (True, rows[1])):         # a second eviction of the permuted rows
        monkeypatch.setattr(evict_mod, "FILL_MEASURED", fill)
        for c in cs:
            c.evict([], layers=cut(c, 1))
    for got in measured_steps(tiny_teacher, banks, rows, toks[8:12], 9):
        torch.testing.assert_close(got[0], got[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(*rows):
        assert_same(a, b)
    measured_steps(tiny_teacher, banks, rows, toks[12:14], 13, tokens=2)    # several tokens: in order first
    assert not any(lay.order is not None for c in rows[1] for lay in c._store.layers)
    for a, b in zip(*rows):
        assert_same(a, b)
        same_entries(a, b)


def test_measured_rows_with_and_without_fill_pick_by_order(tiny_teacher, monkeypatch):
    """The slot-order pick is what makes a filled measured row right: picking its mass in column order (the pick's
    order left out) gives other statistics than the row with holes."""
    import kvlab.cache.batch as batch_mod

    banks, rows, toks = two_measured(tiny_teacher, SETTINGS[0], n=24)
    for fill, cs in ((False, rows[0]), (True, rows[1])):
        monkeypatch.setattr(evict_mod, "FILL_MEASURED", fill)
        cs[0].evict([1, 4, 9])
    monkeypatch.setattr(batch_mod, "_slot_index", lambda *a: None)
    measured_steps(tiny_teacher, banks, rows, toks[:2], 1)
    with pytest.raises(AssertionError):
        assert_same(rows[0][0], rows[1][0])
