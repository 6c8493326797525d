"""Deferred statistics kept in bank columns (kvlab.cache.deferred.ColumnSink): a batched step whose rows all defer
computes its attention once, eagerly, and adds each layer's head-mean probabilities into the bank's per-column
sums; the rows' next read folds them in. The statistics equal a row measured at every step (acc, ema, count, low),
also when the row's columns move mid-way (the bank grows, the row moves to the front, rows swap slots), across
evictions and INT8 storage, and a forward that fails adds nothing."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache
from kvlab.cache import evict as evict_mod
from kvlab.cache.batch import Bank, forward_rows
from test_deferred_stats import assert_same

SETTINGS = [dict(ema_decay=0.9), dict(ema_decay=0.5, window=3, pool=1, below=True, ema_prefill="query"),
            dict(ema_decay=0.8, window=4, pool=2, below=True, ema_prefill="sum")]


def base(lm, setting, n, seed=0):
    model = lm.model
    c = KVCache()
    c.track_attention(**setting)
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    c.forward(model, torch.randint(0, vocab, (n,), generator=g).tolist(), writer="teacher", attention=True)
    return c, torch.randint(0, vocab, (40,), generator=g).tolist()


def measured_and_deferred(lm, setting, n=12, capacity=64):
    """Row 0 of one bank measured at every step, row 1 of another deferring (the other row a dummy in both)."""
    src, toks = base(lm, setting, n)
    banks = [Bank.for_model(lm.model, 2, capacity=capacity) for _ in range(2)]
    return banks, [banks[0].adopt(0, src), banks[1].adopt(1, src)], toks


def steps(lm, banks, caches, toks, start):
    for j, t in enumerate(toks):
        forward_rows(banks[0], lm.model, [caches[0], None], [t, None], writer="teacher", steps=[start + j, 0],
                     attention=[True, False])
        forward_rows(banks[1], lm.model, [None, caches[1]], [None, t], writer="teacher", steps=[0, start + j],
                     defer=[False, True])


def columns_zero(bank: Bank):
    return all(float(t.abs().max()) == 0.0 for ts in bank.cols.values() for t in ts)


@pytest.mark.parametrize("setting", SETTINGS)
def test_columns_equal_measured_every_step(tiny_teacher, setting):
    banks, caches, toks = measured_and_deferred(tiny_teacher, setting)
    steps(tiny_teacher, banks, caches, toks[:7], 1)
    pend = caches[1]._stats.pending
    assert len(pend) == 7 and all(q is None for q, _, _ in pend)     # in the bank's columns, no queries kept
    assert set(banks[1].cols) == ({"acc", "ema", "high"} if setting.get("below") else {"acc", "ema"})
    assert_same(*caches)
    assert columns_zero(banks[1])                                  # folded: nothing left behind
    steps(tiny_teacher, banks, caches, toks[7:10], 8)
    assert_same(*caches)


def test_pooled_rows_step_without_holes(tiny_teacher, monkeypatch):
    """A max-pool over live neighbours is a pool over neighbouring columns only without holes: a pooling row's holes
    are compacted before its deferred step (a plain row keeps them). (Rows not yet deferring evict with holes here:
    ``FILL_MEASURED`` off.)"""
    monkeypatch.setattr(evict_mod, "FILL_MEASURED", False)
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[2])
    for c in caches:
        c.evict([2, 5])
    lay = banks[1].rows[1][0]
    assert lay.holes
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    assert not lay.holes and all(q is None for q, _, _ in caches[1]._stats.pending)
    assert_same(*caches)


def test_columns_follow_growth_and_moves_to_the_front(tiny_teacher, monkeypatch):
    """The row's start moved up by an eviction (holes compacted: ``FILL_MEASURED`` off), then deferred steps fill the
    buffer: it grows and moves to the front while steps are pending; the sums move with their entries."""
    monkeypatch.setattr(evict_mod, "FILL_MEASURED", False)
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[1], n=40, capacity=64)
    for c in caches:
        c.evict(list(range(4, 16)))
        c.kv(0)                                                   # (reading compacts)
    lay = banks[1].rows[1][0]
    s0, cap0 = lay.s, banks[1].capacity(0)
    steps(tiny_teacher, banks, caches, toks[:30], 1)
    assert s0 > 0 and banks[1].capacity(0) > cap0 and lay.s == 0 and len(caches[1]._stats.pending) == 30
    assert_same(*caches)


@pytest.mark.parametrize("setting", SETTINGS[:2])
def test_columns_follow_a_swap(tiny_teacher, setting):
    """Two rows of different lengths (the shorter one's step masks columns past its end: below counts kept as
    their complement must not count them), swapped mid-pending."""
    model = tiny_teacher.model
    (a, toks), (b, _) = base(tiny_teacher, setting, 12, seed=1), base(tiny_teacher, setting, 9, seed=2)
    ref = [a.copy(), b.copy()]
    bank = Bank.for_model(model, 2, capacity=64)
    rows = [bank.adopt(0, a), bank.adopt(1, b)]
    for j, t in enumerate(toks[:3]):
        forward_rows(bank, model, rows, [t, t], writer="teacher", steps=[1 + j] * 2, defer=[True, True])
    bank.swap(0, 1)
    rows = rows[::-1]                                             # slot 0 now holds b's cache
    for j, t in enumerate(toks[3:6]):
        forward_rows(bank, model, rows, [t, t], writer="teacher", steps=[4 + j] * 2, defer=[True, True])
    for c in ref:
        for j, t in enumerate(toks[:6]):
            c.forward(model, [t], writer="teacher", step=1 + j, attention=True)
    assert_same(ref[0], rows[1])
    assert_same(ref[1], rows[0])


@pytest.mark.parametrize("setting", SETTINGS[1:])
def test_edits_and_int8_settle_first(tiny_teacher, setting):
    """Evictions (uniform, per layer: holes), INT8 storage (its rows keep queries) and a copy between deferred steps."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, setting)
    steps(tiny_teacher, banks, caches, toks[:4], 1)
    for c in caches:
        c.evict([1, 3, 5])
    steps(tiny_teacher, banks, caches, toks[4:8], 5)
    per_layer = [[0, 2 + (l % 3)] for l in range(caches[0].num_layers)]
    for c in caches:
        c.evict([], layers=per_layer)
    steps(tiny_teacher, banks, caches, toks[8:12], 9)
    assert all(q is None for q, _, _ in caches[1]._stats.pending)
    for c in caches:
        c.quantize_older(4, group=2)
    steps(tiny_teacher, banks, caches, toks[12:15], 13)
    assert all(q is not None for q, _, _ in caches[1]._stats.pending)   # INT8 rows keep their queries
    copy = caches[1].copy()
    assert_same(caches[0], copy)
    assert_same(*caches)


def test_a_failed_forward_adds_nothing(tiny_teacher):
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[0])
    steps(tiny_teacher, banks, caches, toks[:2], 1)
    before = {k: [t.clone() for t in ts] for k, ts in banks[1].cols.items()}
    pend = len(caches[1]._stats.pending)
    layers = tiny_teacher.model.model.layers

    def boom(*_):
        raise RuntimeError("boom")

    h = layers[-1].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            forward_rows(banks[1], tiny_teacher.model, [None, caches[1]], [None, 7], writer="teacher",
                         steps=[0, 3], defer=[False, True])
    finally:
        h.remove()
    assert len(caches[1]._stats.pending) == pend
    assert all(torch.equal(x, y) for k in before for x, y in zip(before[k], banks[1].cols[k]))
    steps(tiny_teacher, banks, caches, toks[2:4], 3)
    assert_same(*caches)


def test_pooled_sums_read_past_the_end_as_the_padded_pool(tiny_teacher):
    """A pooled step reads ``pool - 1`` masked columns past the last used one when the bank has them (``spare``):
    its max-pool then needs no padding and gives the padded pool's sums (masked columns are 0, probabilities >= 0)."""
    from kvlab.cache.deferred import ColumnSink

    bank = Bank.for_model(tiny_teacher.model, 2, capacity=64)
    L = bank.num_layers
    a = torch.rand(2, 1, 20, generator=torch.Generator().manual_seed(0))
    a[0, 0, 12:] = 0.0                                             # row 0 ends at 12, row 1 at 14: masked after
    a[1, 0, 14:] = 0.0
    got = []
    for spare, x in ((6, a), (0, a[..., :14])):
        for b in range(2):
            bank.clear_cols(b)
        sink = ColumnSink(bank, [3] * L, 0.9, False, pool=7, spare=[spare] * L)
        for i in range(L):
            sink.take(i, x, None)
        sink.apply(L)
        got.append([t.clone() for t in bank.cols["acc"] + bank.cols["ema"]])
    assert all(torch.equal(u, v) for u, v in zip(*got))
    assert float(got[0][0][:, 3:17].abs().sum()) > 0 and float(got[0][0][:, 17:].abs().sum()) == 0


def test_rows_whose_sums_are_zero_skip_column_moves(tiny_teacher):
    """``Bank.summed``: set for a row by its deferred steps, cleared by its fold (every sum zero then), swapped with
    the row; a move of a row whose sums are zero (an edit right after its read) moves nothing and leaves zeros."""
    banks, caches, toks = measured_and_deferred(tiny_teacher, SETTINGS[1])
    bank = banks[1]
    assert bank.summed == [False, False]
    steps(tiny_teacher, banks, caches, toks[:3], 1)
    assert bank.summed == [False, True]
    caches[1].layer_attn()                                         # the read folds: zeros again
    assert bank.summed == [False, False] and columns_zero(bank)
    for c in caches:
        c.evict(list(range(2, 14)))                                # a keep moving entries: no sums to move
    assert columns_zero(bank)
    steps(tiny_teacher, banks, caches, toks[3:6], 4)
    assert bank.summed == [False, True]
    bank.swap(0, 1)
    assert bank.summed == [True, False]
    assert_same(caches[0], caches[1])


@pytest.mark.parametrize("below, pool, spare, rows, lows", [
    (False, 1, 0, None, "same"), (True, 1, 0, [True, False, True], "same"), (True, 2, 0, None, "alternate"),
    (False, 3, 4, [False, True, True], "alternate"), (True, 1, 0, None, "runs")])
def test_all_layers_at_once_equal_per_layer(below, pool, spare, rows, lows):
    """A step whose layers are one width adds into the bank's ``(L, B, capacity)`` blocks in one op per statistic
    and group of layers reading from the same column (``Bank.col_block``; a run of layers through views, others
    gathered and put back); the sums are bitwise those of one add per layer (the same elementwise ops)."""
    from kvlab.cache.deferred import ColumnSink

    L = 5
    lows = {"same": [5] * L, "alternate": [5, 9] * (L // 2) + [5] * (L % 2), "runs": [5, 5, 9, 9, 9]}[lows]
    g = torch.Generator().manual_seed(1)
    steps_a = [torch.rand(3, 1, 20, generator=g) for _ in range(3 * L)]
    seen = torch.tensor([14, 20, 17], dtype=torch.float32).view(1, 3, 1).expand(L, 3, 1)
    got = []
    for blocked in (True, False):
        bank = Bank(3, L, 1, 4, dtype=torch.float32, device="cpu", capacity=64)
        if not blocked:
            bank.col_block = lambda name: None                     # the per-layer path
        for k in range(3):
            sink = ColumnSink(bank, lows, 0.8, below, None if rows is None else torch.tensor(rows), pool=pool,
                              seen=seen if below else None, spare=[spare] * L)
            for i in range(L):
                sink.take(i, steps_a[k * L + i], None)
            sink.apply(L)
        assert bool(bank._blocks) == blocked
        got.append({k: [t.clone() for t in ts] for k, ts in bank.cols.items()})
    assert got[0].keys() == got[1].keys()
    assert all(torch.equal(x, y) for k in got[0] for x, y in zip(got[0][k], got[1][k]))
    assert float(got[0]["acc"][0].abs().sum()) > 0


def test_col_block_views_the_layers_and_follows_growth(tiny_teacher):
    """``Bank.col_block``'s layers are the statistics' tensors (an edit of one is an edit of the other); a layer's
    growth leaves it (None while capacities differ) and it is made again, contents kept, once they agree."""
    bank = Bank.for_model(tiny_teacher.model, 2, capacity=64)
    L = bank.num_layers
    bank.column_stats(["acc"])
    block = bank.col_block("acc")
    assert block.shape == (L, 2, 64)
    block[L - 1, 0, 3] = 2.5
    assert float(bank.cols["acc"][L - 1][0, 3]) == 2.5
    bank.grow(0, 100)
    assert bank.col_block("acc") is None
    for i in range(1, L):
        bank.grow(i, 100)
    block = bank.col_block("acc")
    assert block.shape == (L, 2, 128) and float(block[L - 1, 0, 3]) == 2.5
    bank.cols["acc"][L - 1][1, 7] = 1.0
    assert float(block[L - 1, 1, 7]) == 1.0


@pytest.mark.parametrize("setting", SETTINGS[:2])
@pytest.mark.parametrize("fill", [False, True])
def test_settle_all_layers_at_once_equal_per_layer(tiny_teacher, setting, fill, monkeypatch):
    """A read folding bank columns of rows whose layers hold equally many entries without holes gathers every layer
    at once from the bank's blocks (``deferred._settle_blocks``; permuted rows after filling evictions each their own
    columns); the statistics are bitwise those of the fold layer by layer, and the rows' columns are zero after."""
    import kvlab.cache.evict as kev
    from kvlab.cache import deferred

    monkeypatch.setattr(kev, "FILL", fill)
    model = tiny_teacher.model
    src, toks = base(tiny_teacher, setting, 14)
    L = src.num_layers
    got, used = [], []
    real = deferred._settle_blocks
    for blocked in (True, False):
        bank = Bank.for_model(model, 3, capacity=64)
        if not blocked:
            bank.col_block = lambda name: None
        rows = [bank.adopt(b, src) for b in range(3)]
        calls = []
        monkeypatch.setattr(deferred, "_settle_blocks", lambda *a: calls.append(real(*a)) or calls[-1])
        for j, t in enumerate(toks[:3]):
            forward_rows(bank, model, rows, [t] * 3, writer="teacher", steps=[1 + j] * 3, defer=[True] * 3)
        for b, c in enumerate(rows):                              # per layer, each row its own drops
            c.evict([], layers=[[(b + l) % 5, 6 + (b * l) % 4] for l in range(L)])
        for j, t in enumerate(toks[3:6]):
            forward_rows(bank, model, rows, [t] * 3, writer="teacher", steps=[4 + j] * 3, defer=[True] * 3)
        assert fill == (bank.rows[0][0].order is not None)
        from kvlab.cache.deferred import settle_rows
        settle_rows(rows)
        used.append(calls)
        got.append([{k: [x.clone() for x in v] for k, v in c.layer_attn().items()} for c in rows])
        assert columns_zero(bank)
    assert used[0][0] and used[0][-1] == fill and not any(used[1])   # holes (no filling): layer by layer
    for a, b in zip(*got):
        assert a.keys() == b.keys()
        assert all(torch.equal(x, y) for k in a for x, y in zip(a[k], b[k]))
