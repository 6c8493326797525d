"""Evictions of several bank rows at once (kvlab.cache.evict_rows.evict_rows, the batch's ask through
kvlab.decode.evict_phase.apply_keep_rows): the same live maps, events, statistics, keys and values as one
KVCache.evict per row, measured rows (holes) and deferring rows (filling evictions) alike, and the same steps after;
bad slots in one row raise before any row changes."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache
from kvlab.cache import evict as evict_mod
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.deferred import settle_rows
from kvlab.cache.evict_rows import evict_rows
from kvlab.decode.evict_phase import apply_keep, apply_keep_rows
from kvlab.decode.protocols import Keep
from kvlab.eviction.ranking import per_layer
from test_deferred_stats import assert_same

B = 3


@pytest.fixture(autouse=True)
def filling(monkeypatch):
    monkeypatch.setattr(evict_mod, "FILL", True)


def two_banks(lm, n=20, defer=False, seed=0):
    """Two banks of ``B`` rows holding the same caches (each row its own prompt), stepped alike."""
    model = lm.model
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    srcs = []
    for _ in range(B):
        c = KVCache()
        c.track_attention(0.8, below=True)
        c.forward(model, torch.randint(0, vocab, (n,), generator=g).tolist(), writer="teacher", attention=True)
        srcs.append(c)
    toks = torch.randint(0, vocab, (12,), generator=g).tolist()
    banks = [Bank.for_model(model, B, capacity=64) for _ in range(2)]
    rows = [[bk.adopt(b, s) for b, s in enumerate(srcs)] for bk in banks]
    return banks, rows, toks


def step(lm, banks, rows, toks, start, defer):
    for j, t in enumerate(toks):
        for bk, cs in zip(banks, rows):
            forward_rows(bk, lm.model, cs, [t] * B, writer="teacher", steps=[start + j] * B,
                         attention=[not defer] * B, defer=[defer] * B)
    for cs in rows:
        settle_rows(cs)


def same(a: KVCache, b: KVCache):
    assert a._mirror.lives == b._mirror.lives
    ea, eb = a._mirror.events, b._mirror.events
    assert (ea.tick, ea.row, ea.event, ea.layer) == (eb.tick, eb.row, eb.event, eb.layer)
    assert a.layer_lengths() == b.layer_lengths()
    assert_same(a, b)
    for i in range(a.num_layers):
        for x, y in zip(a.kv(i), b.kv(i)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("kind", ["per_layer", "uniform", "unequal"])
def test_rows_at_once_equal_row_by_row(tiny_teacher, defer, kind, monkeypatch):
    import kvlab.cache.evict_rows as er
    from kvlab.cache.stats import keep_rows

    together = []
    monkeypatch.setattr(er, "keep_stats_rows", lambda sts, keep: (together.append(len(sts)), keep_rows(sts, keep)))
    banks, rows, toks = two_banks(tiny_teacher, defer=defer)
    step(tiny_teacher, banks, rows, toks[:3], 1, defer)
    for ask in range(2):
        drops = []
        for r, c in enumerate(rows[0]):
            L, n = c.num_layers, len(c)
            if kind == "uniform":
                d = [[1, 4 + r, n - 3]] * L
            else:
                d = [[1 + (i + r) % 4, 6 + i % 3, n - 2 - r] for i in range(L)]
                if kind == "unequal" and r == 1:
                    d[0] = d[0][:2]                                    # a row's layers differ: row by row
            drops.append(d)
        for c, d in zip(rows[0], drops):
            c.evict([], layers=d)
        reps = evict_rows(rows[1], drops)
        assert [r.evicted_layers for r in reps] == [tuple(len(x) for x in d) for d in drops]
        if defer:
            assert all(c._stats.columns_deferred and not any(lay.holes for lay in c._store.layers)
                       for c in rows[1])                               # filled, as row by row
        step(tiny_teacher, banks, rows, toks[3 + 3 * ask:6 + 3 * ask], 4 + 3 * ask, defer)
    assert together == ([] if kind == "unequal" else [B, B])        # the rows edited at once where they fit
    for a, b in zip(*rows):
        same(a, b)
    logits = [forward_rows(bk, tiny_teacher.model, cs, [toks[-1]] * B, writer="teacher", steps=[20] * B)
              for bk, cs in zip(banks, rows)]
    torch.testing.assert_close(*logits, rtol=1e-5, atol=1e-5)


def test_bad_row_changes_nothing(tiny_teacher):
    banks, rows, toks = two_banks(tiny_teacher)
    step(tiny_teacher, banks, rows, toks[:2], 1, False)
    before = [(c._mirror.lives, c.layer_lengths(), len(c._mirror.events.row)) for c in rows[1]]
    L = rows[1][0].num_layers
    good = [[1, 2]] * L
    with pytest.raises(ValueError, match=r"layers\[2\]\[0\]"):
        evict_rows(rows[1], [good, good, [[1, 999]] + [[1, 2]] * (L - 1)])
    with pytest.raises(ValueError, match="one per-layer slot list each"):
        evict_rows(rows[1], [good, good])
    assert before == [(c._mirror.lives, c.layer_lengths(), len(c._mirror.events.row)) for c in rows[1]]


def test_apply_keep_rows_equals_apply_keep(tiny_teacher):
    """Decisions as the policies give them (per layer, uniform, nothing to drop, INT8 demotion) through
    apply_keep_rows and through apply_keep row by row."""
    banks, rows, toks = two_banks(tiny_teacher, n=24)
    step(tiny_teacher, banks, rows, toks[:2], 1, False)
    n, L = len(rows[0][0]), rows[0][0].num_layers
    keep_layers = [tuple(s for s in range(n) if s not in (2 + i % 3, 9)) for i in range(L)]
    decisions = [per_layer(keep_layers), Keep(tuple(s for s in range(n) if s != 5), int8_window=8, int8_group=4),
                 Keep(tuple(range(n)))]
    reps = [apply_keep(c, d, None) for c, d in zip(rows[0], decisions)]
    got = apply_keep_rows(rows[1], decisions, None)
    assert [r and r.evicted for r in reps] == [r and r.evicted for r in got] == [2, 1, None]
    assert rows[1][1].n_int8 == rows[0][1].n_int8 > 0
    for a, b in zip(*rows):
        same(a, b)
