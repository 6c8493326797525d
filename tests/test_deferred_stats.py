"""Deferred attention statistics (kvlab.cache.deferred): a row whose steps keep their queries and fold them in when
the statistics are read (or the cache edited) ends with the statistics of a row measured at every step — acc, ema,
count and low, every tracking setting, across evictions (per layer too) and INT8 storage in between."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows

SETTINGS = [dict(ema_decay=0.9), dict(ema_decay=0.8, window=4, pool=2, below=True, ema_prefill="sum"),
            dict(ema_decay=0.5, window=3, pool=1, below=True, ema_prefill="query")]
TOL = 1e-5


def pair(lm, setting, n_prompt=12):
    model = lm.model
    base = KVCache()
    base.track_attention(**setting)
    g = torch.Generator().manual_seed(0)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    base.forward(model, torch.randint(0, vocab, (n_prompt,), generator=g).tolist(), writer="teacher", attention=True)
    bank = Bank.for_model(model, 2, capacity=64)
    return bank, [bank.adopt(b, base) for b in range(2)], torch.randint(0, vocab, (40,), generator=g).tolist()


def steps(lm, bank, caches, toks, start):
    for j, t in enumerate(toks):
        forward_rows(bank, lm.model, caches, [t, t], writer="teacher", steps=[start + j] * 2, attention=[True, False],
                     defer=[False, True])


def assert_same(a: KVCache, b: KVCache):
    x, y = a.layer_attn(), b.layer_attn()
    assert not b._stats.pending                                  # the read settled it
    assert x.keys() == y.keys()
    for name in x:
        for l, (u, v) in enumerate(zip(x[name], y[name])):
            assert u.shape == v.shape, (name, l)
            assert float((u - v).abs().max()) <= TOL * max(1.0, float(u.abs().max())), (name, l)


@pytest.mark.parametrize("setting", SETTINGS)
def test_deferred_equals_measured_every_step(tiny_teacher, setting):
    bank, caches, toks = pair(tiny_teacher, setting)
    steps(tiny_teacher, bank, caches, toks[:7], 1)
    assert len(caches[1]._stats.pending) == 7 and not caches[0]._stats.pending
    assert_same(*caches)
    steps(tiny_teacher, bank, caches, toks[7:10], 8)              # a second round after a settle
    assert_same(*caches)


@pytest.mark.parametrize("setting", SETTINGS[:2])
def test_edits_settle_first(tiny_teacher, setting):
    """An eviction (uniform, then per layer), INT8 storage and a copy between deferred steps: each settles the
    pending queries against the keys they saw, so the two rows stay equal."""
    bank, caches, toks = pair(tiny_teacher, setting)
    steps(tiny_teacher, bank, caches, toks[:4], 1)
    for c in caches:
        c.evict([1, 3, 5])
    assert not caches[1]._stats.pending
    steps(tiny_teacher, bank, caches, toks[4:8], 5)
    L = caches[0].num_layers
    per_layer = [[0, 2 + (l % 3)] for l in range(L)]
    for c in caches:
        c.evict([], layers=per_layer)
    steps(tiny_teacher, bank, caches, toks[8:12], 9)
    for c in caches:
        c.quantize_older(4, group=2)
    steps(tiny_teacher, bank, caches, toks[12:15], 13)
    copy = caches[1].copy()
    assert not caches[1]._stats.pending and not copy._stats.pending
    assert_same(caches[0], copy)
    assert_same(*caches)


def test_defer_needs_tracking_and_one_token(tiny_teacher):
    model = tiny_teacher.model
    bank = Bank.for_model(model, 1, capacity=32)
    c = bank.row_cache(0)
    c_plain = bank.row_cache(0)
    with pytest.raises(ValueError, match="defer=True"):
        forward_rows(bank, model, [c_plain], [[1, 2]], writer="teacher", steps=[0], defer=[True])
    c.track_attention(0.9)
    with pytest.raises(ValueError, match="defer=True"):
        forward_rows(bank, model, [c], [[1, 2]], writer="teacher", steps=[0], defer=[True])
    assert len(c) == 0 and not c._stats.pending                  # refused before anything changed


def test_measured_append_refuses_pending():
    from kvlab.cache.stats import AttnStats

    st = AttnStats(0.9, [3, 3], "cpu")
    st.defer(torch.zeros(2, 1, 4, 8), 0, [3, 3], [1.0, 1.0])
    with pytest.raises(RuntimeError, match="pending"):
        st.keep([torch.tensor([0, 1]), torch.tensor([0, 1])])
    with pytest.raises(RuntimeError, match="pending"):
        st.append(1, [torch.zeros(4), torch.zeros(4)])


@pytest.mark.parametrize("setting", SETTINGS)
def test_rows_settled_together_equal_each_alone(tiny_teacher, setting):
    """settle_rows: rows with the same pending steps share one pass per layer (softmax, pooling, sums over the
    rows at once); a row of another length settles alone. Every row ends with what its own settle gives."""
    from kvlab.cache.deferred import settle_rows

    model = tiny_teacher.model
    g = torch.Generator().manual_seed(1)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    bases = []
    for n in (12, 12, 12, 9):                                     # three alike (different tokens), one shorter
        c = KVCache()
        c.track_attention(**setting)
        c.forward(model, torch.randint(0, vocab, (n,), generator=g).tolist(), writer="teacher", attention=True)
        bases.append(c)
    toks = torch.randint(0, vocab, (5,), generator=g).tolist()
    banks = [Bank.for_model(model, 4, capacity=64) for _ in range(2)]
    rows = [[bk.adopt(b, bases[b]) for b in range(4)] for bk in banks]
    for bk, cs in zip(banks, rows):
        for j, t in enumerate(toks):
            forward_rows(bk, model, cs, [t] * 4, writer="teacher", steps=[1 + j] * 4, defer=[True] * 4)
    settle_rows(rows[0])                                          # together
    for c in rows[1]:
        c._settle()                                               # one by one
    for a, b in zip(rows[0], rows[1]):
        assert not a._stats.pending
        assert_same(b, a)


def test_rows_view_joins_a_banks_rows_without_copy():
    """Rows of one buffer at equal steps of its row stride settle with one matmul (a view, no copy); rows that are not
    (out of order, another buffer, other columns) fall back to one matmul per row."""
    from kvlab.cache.deferred import _rows_view

    buf = torch.randn(4, 3, 20, 8)                                # (B, H_kv, cap, D)
    keys = [buf[b:b + 1, :, 2:11] for b in range(1, 4)]          # rows 1..3, columns 2..10
    v = _rows_view(keys)
    assert v is not None and v.shape == (3, 3, 9, 8) and v.data_ptr() == keys[0].data_ptr()
    assert torch.equal(v, torch.cat(keys))
    assert _rows_view([keys[1], keys[0]]) is None                 # out of order
    assert _rows_view([keys[0], buf.clone()[2:3, :, 2:11]]) is None   # another storage
    assert _rows_view([keys[0], buf[2:3, :, 3:12]]) is None        # other columns
    assert _rows_view(keys[:1]) is None                           # one row: nothing to join


def test_statistics_follow_the_storage_device_when_layers_arrive():
    """A cache that starts tracking before it has layers does not know its device yet: the statistics move to the
    storage's device with the layers (on a GPU they were left on the CPU, and a deferred fold then mixed devices)."""
    from kvlab.cache.stats import AttnStats

    st = AttnStats(0.9, [], torch.device("cpu"))
    st.set_layers(3, 5, torch.device("meta"))
    assert st.device == torch.device("meta")
    assert all(t.device.type == "meta" and t.shape == (5,) for ts in st.data.values() for t in ts)
    st.set_layers(3, 5)                                  # layers already there: nothing moves
    assert st.device == torch.device("meta")
