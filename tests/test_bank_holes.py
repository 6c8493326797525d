"""Evictions in a bank row leave holes instead of moving memory: the batched forward masks the dead columns, the
row compacts once they pass ``compact_at()``, and every reader of ``keys`` / ``values`` sees a dense layer. The
decision side names its few drops (:class:`kvlab.decode.protocols.Kept`) instead of a tuple of a thousand slots."""
from __future__ import annotations

import pytest
import torch

from conftest import make_tiny_lm
from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.decode.protocols import Keep, Kept
from kvlab.eviction.ranked import _bottom_rows, _top_rows

IDS = [3, 17, 5, 9, 22, 41, 8, 13, 2, 30, 11, 6, 27, 19, 4, 35, 12, 7, 44, 1]


@pytest.fixture(autouse=True)
def holes(monkeypatch):
    """The holes path (``kvlab.cache.evict.FILL`` off; on by default since session 21, see there): rows whose
    statistics wait in bank columns would otherwise fill instead of leaving holes."""
    import kvlab.cache.evict as evict_mod

    monkeypatch.setattr(evict_mod, "FILL", False)


@pytest.fixture(scope="module")
def lm():
    return make_tiny_lm(seed=3)


def _rows(lm, drops):
    """A 2-row bank, both rows the prefill of IDS; row 0 drops ``drops`` (per layer), and so does a single cache."""
    src, _ = KVCache.prefill(lm.model, IDS, writer="teacher")
    bank = Bank.for_model(lm.model, 2, capacity=64)
    rows = [bank.adopt(b, src) for b in range(2)]
    ref = src.copy()
    for c in (rows[0], ref):
        c.evict([], model=lm.model, layers=drops)
    return bank, rows, ref


def test_drops_leave_holes_that_the_batched_forward_masks(lm):
    L = lm.model.config.num_hidden_layers
    drops = [[2, 7], [5], [0, 3, 9]][:L] + [[1]] * max(0, L - 3)
    bank, rows, ref = _rows(lm, drops)
    lays = bank.rows[0]
    assert [len(x.holes) for x in lays] == [len(d) for d in drops]              # nothing moved ...
    assert [x.n for x in lays] == [len(IDS) - len(d) for d in drops]
    assert rows[0].layer_lengths() == ref.layer_lengths()
    logits = forward_rows(bank, lm.model, rows, [9, 9], writer="teacher", steps=[1, 1])
    want = ref.forward(lm.model, [9], writer="teacher")
    torch.testing.assert_close(logits[0], want.reshape(-1), rtol=1e-4, atol=1e-4)  # ... and the forward skips them
    assert [len(x.holes) for x in lays] == [len(d) for d in drops]              # the step appended after them
    for i in range(L):                                                          # a reader sees the dense layer
        torch.testing.assert_close(rows[0].kv(i)[0], ref.kv(i)[0])
    assert not any(x.holes for x in lays)                                       # (reading compacted it)
    rows[0].check()


def test_holes_compact_once_they_pass_the_threshold(lm):
    bank, rows, _ = _rows(lm, [[0]] * lm.model.config.num_hidden_layers)
    lay = bank.rows[0][0]
    keys = rows[0].kv(0)[0].clone()                                             # compacts (1 hole)
    for _ in range(lay.compact_at() + 1):
        if not lay.n:
            break
        rows[0].evict([0])
    assert len(lay.holes) <= lay.compact_at()
    assert rows[0].kv(0)[0].shape[2] == keys.shape[2] - min(len(IDS) - 1, lay.compact_at() + 1)


def test_kept_reads_as_its_tuple_and_names_its_drops():
    k = Kept(6, (1, 4))
    assert tuple(k) == (0, 2, 3, 5) and k == (0, 2, 3, 5) and (0, 2, 3, 5) == k and len(k) == 4 and k[1] == 2
    assert k.dropped(6) == [1, 4] and k.dropped(7) == [1, 4, 6]
    keep = Keep(k, layers=(k, (0, 1, 2)))
    assert keep.dropped(6) == [1, 4] and keep.dropped_layers([6, 4]) == [[1, 4], [3]]


@pytest.mark.parametrize("seed", range(6))
def test_bottom_rows_is_the_complement_of_top_rows_ties_included(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (5, 23), generator=g).float()                        # many ties
    for d in (1, 3, 11):
        top = _top_rows(x, 23 - d)
        bottom = _bottom_rows(x, d)
        for r in range(5):
            assert sorted(set(range(23)) - set(top[r].tolist())) == bottom[r].tolist()


def test_live_positions_read_as_the_positions_and_stay_as_taken(lm):
    c, _ = KVCache.prefill(lm.model, IDS, writer="teacher")
    c.evict([], model=lm.model, layers=[[1, 4]] + [[2]] * (c.num_layers - 1))
    lp = c.live_positions()
    assert [tuple(p) for p in lp] == [tuple(p) for p in c.layer_positions()]
    assert lp[0] == c.layer_positions()[0] and len(lp[1]) == len(IDS) - 1 and lp[0][:3] == (0, 2, 3)
    before = tuple(lp[0])
    c.evict([0])                                                                # the view does not follow the cache
    assert tuple(lp[0]) == before and lp[0] != c.live_positions()[0]


def test_the_step_reads_from_the_first_column_a_row_uses(lm, monkeypatch):
    """Evicting a row's oldest entries moves its start column up (the few entries before the cut move, not the
    rest): a batched step then reads each layer from the first column any row uses, not from column 0, and computes
    what a single cache does."""
    import kvlab.cache.batch as cb

    src, _ = KVCache.prefill(lm.model, IDS, writer="teacher")
    bank = Bank.for_model(lm.model, 2, capacity=64)
    rows = [bank.adopt(b, src) for b in range(2)]
    refs = [src.copy(), src.copy()]
    for c, ref, cut in zip(rows, refs, (4, 6)):
        for x in (c, ref):
            x.evict(list(range(cut)))
        c.kv(0)                                                                 # reading compacts: the start moves
    assert [bank.rows[b][0].s for b in range(2)] == [4, 6]
    seen = []
    orig = cb._StepLayer.__init__

    def spy(self, bank, i, cols, width, lo=0):
        seen.append((i, lo, width))
        orig(self, bank, i, cols, width, lo)

    monkeypatch.setattr(cb._StepLayer, "__init__", spy)
    logits = forward_rows(bank, lm.model, rows, [9, 5], writer="teacher", steps=[1, 1])
    assert seen[0][1] == 4                                                      # layer 0: from row 0's start
    for b, (ref, tok) in enumerate(zip(refs, (9, 5))):
        want = ref.forward(lm.model, [tok], writer="teacher")
        torch.testing.assert_close(logits[b], want.reshape(-1), rtol=1e-4, atol=1e-4)
        rows[b].check()


def test_hole_index_is_kept_until_the_holes_change(lm):
    """A batched step between evictions masks the same holes: the bank keeps its (layer, row, column) index of every
    row layer's holes (their lists, replaced at each edit), rebuilt only when a row's holes or start change."""
    L = lm.model.config.num_hidden_layers
    bank, rows, ref = _rows(lm, [[2, 7]] * L)
    lay = bank.rows[0][0]
    holes = lay.holes
    columns = lambda: [lay.s + o for lay in bank.rows[0] for o in lay.holes]   # noqa: E731 every hole's column
    dead = [(i, 0, bank.rows[0][i].holes, bank.rows[0][i].s) for i in range(L)]
    idx = bank.dead_index(dead)
    assert bank.dead_index([tuple(x) for x in dead]) is idx                       # same holes: the same index
    assert idx[0].tolist() == [i for i in range(L) for _ in range(2)] and set(idx[1].tolist()) == {0}
    assert idx[2].tolist() == columns()
    rows[0].evict([0])
    ref.evict([0])
    assert lay.holes is not holes and len(lay.holes) == 3                          # a new list: the index follows
    idx2 = bank.dead_index([(i, 0, bank.rows[0][i].holes, bank.rows[0][i].s) for i in range(L)])
    assert idx2 is not idx and idx2[2].shape[0] == 3 * L
    assert idx2[2].tolist() == columns()
    for tok in (9, 4):                                                          # the step masks them: as a single
        logits = forward_rows(bank, lm.model, rows, [tok, tok], writer="teacher", steps=[1, 1])
        want = ref.forward(lm.model, [tok], writer="teacher")
        torch.testing.assert_close(logits[0], want.reshape(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["front", "back", "spread"])
def test_rows_compacted_together_equal_one_by_one(where):
    """:meth:`Bank.compact_rows` (every row layer's holes in a few ops per layer) leaves each row layer as its own
    :meth:`~kvlab.cache.buffer.BufferLayer.compact` does: the same used columns, the same ``s``, K/V and per-column
    statistics (the columns left behind zero); holes near the front move the head up, near the back the tail down."""
    B, L, H, D, n = 3, 4, 2, 4, 40
    g = torch.Generator().manual_seed(0)

    def bank():
        bk = Bank(B, L, H, D, dtype=torch.float32, device="cpu", capacity=64)
        for t in bk.k + bk.v:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel() + len(bk.k))))
        cols = bk.column_stats(["acc", "ema"])
        gg = torch.Generator().manual_seed(1)
        for b in range(B):
            bk.summed[b] = b != 1                               # row 1's sums are all zero (nothing to move)
            for i in range(L):
                lay = bk.rows[b][i]
                s = 3 * b + i
                pick = {"front": torch.arange(2 + b, 6 + b), "back": torch.arange(n - 8 + i, n - 3 + i),
                        "spread": torch.randperm(n, generator=gg)[:5 + b]}[where]
                lay.s, lay.n, lay.holes, lay.order = s, n - len(pick), sorted(pick.tolist()), None
                lay._views()
                for ts in cols.values():
                    ts[i][b].zero_()
                    if bk.summed[b]:
                        ts[i][b, s:s + n] = torch.rand(n, generator=gg)
                        ts[i][b, torch.tensor(lay.holes) + s] = 0.0     # hole columns hold nothing
        return bk

    one, many = bank(), bank()
    for b in range(B):
        for lay in one.rows[b]:
            lay.compact()
    many.compact_rows([lay for row in many.rows for lay in row])
    for b in range(B):
        for i in range(L):
            x, y = one.rows[b][i], many.rows[b][i]
            assert (x.s, x.n, x.holes) == (y.s, y.n, y.holes) == (x.s, x.n, [])
            torch.testing.assert_close(y.keys, x.keys, rtol=0, atol=0)
            torch.testing.assert_close(y.values, x.values, rtol=0, atol=0)
            for name in one.cols:
                torch.testing.assert_close(many.cols[name][i][b], one.cols[name][i][b], rtol=0, atol=0)
