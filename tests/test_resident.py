"""Resident eviction (kvlab.cache.resident): rows that evict one entry per layer at every step, their state held as
bank-wide tensors, decide and decode as the batched loop does (forward_rows, keep_rows, apply_keep_rows): the same
logits at every step, and once closed the same live maps, events, statistics, keys and values; the closed caches go
on decoding as the loop's. Bad input and use of a resident row raise and change nothing."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache
from kvlab.cache.batch import Bank, forward_rows
from kvlab.cache.resident import Resident
from kvlab.decode.evict_phase import apply_keep_rows, evict_view
from kvlab.decode.protocols import evict_attr, keep_rows, measures_at
from kvlab.eviction.block import BlockEvict
from kvlab.eviction.confkv import ConfKV, pyramid_budgets
from kvlab.eviction.every import Every
from kvlab.eviction.h2o import H2O
from kvlab.eviction.scissorhands import Scissorhands
from kvlab.eviction.sliding import SlidingWindow
from kvlab.eviction.snapkv import SnapKV
from kvlab.studies.bench.evict_batch import attention_prefill
from test_deferred_stats import assert_same

B = 3
POLICIES = {
    "h2o": H2O(budget=12, recent=4),
    "h2o_sinks": H2O(budget=12, recent=3, sinks=2),
    "scissorhands": Scissorhands(budget=12, recent=4),
    "sliding": SlidingWindow(window=12, sinks=2),
    "block": BlockEvict(block_size=2, start_blocks=1, evictable_blocks=3, recent_blocks=1),      # max 10, pool 7
}


def same(a: KVCache, b: KVCache):
    """The same live maps, events, lengths, statistics (fp32 tolerance; none on both) and keys and values."""
    assert a._mirror.lives == b._mirror.lives
    ea, eb = a._mirror.events, b._mirror.events
    assert (ea.tick, ea.row, ea.event, ea.layer) == (eb.tick, eb.row, eb.event, eb.layer)
    assert a.layer_lengths() == b.layer_lengths()
    if a._stats is None:
        assert b._stats is None
    else:
        assert_same(a, b)
    for i in range(a.num_layers):
        for x, y in zip(a.kv(i), b.kv(i)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def two_banks(lm, pol, n=24, seed=0):
    """Two banks of ``B`` rows (each its own prompt of ``n`` tokens), each stepped once by the batched loop (the
    cut to the budget)."""
    model = lm.model
    g = torch.Generator().manual_seed(seed)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    need = bool(evict_attr(pol, "needs_attention"))
    srcs = []
    for _ in range(B):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        if need:
            srcs.append(attention_prefill(model, ids, pol))
        else:
            c = KVCache()
            c.forward(model, ids, writer="teacher")
            srcs.append(c)
    toks = torch.randint(0, vocab, (16,), generator=g).tolist()
    banks = [Bank.for_model(model, B, capacity=64) for _ in range(2)]
    rows = [[bk.adopt(b, s) for b, s in enumerate(srcs)] for bk in banks]
    for bk, cs in zip(banks, rows):
        loop_step(lm, bk, cs, pol, toks[0], 1)
    return banks, rows, toks[1:], vocab


def loop_step(lm, bank, caches, pol, tok, step):
    vocab = int(lm.model.get_input_embeddings().weight.shape[0])
    logits = forward_rows(bank, lm.model, caches, [tok] * B, writer="teacher", steps=[step] * B,
                          attention=[measures_at(pol, step)] * B)
    views = [evict_view(c, step, None, vocab, first=step == 1) for c in caches]
    apply_keep_rows(caches, keep_rows(pol, views), lm.model)
    return logits


@pytest.mark.parametrize("name", list(POLICIES))
def test_resident_decodes_as_the_batched_loop(tiny_teacher, name):
    pol = POLICIES[name]
    assert evict_attr(pol, "decides_columns")
    (bank_a, bank_b), (loop, rows), toks, _ = two_banks(tiny_teacher, pol)
    n = len(rows[0])
    cap = evict_attr(pol, "column_capacity")
    res = Resident(bank_b, rows, cap(bank_b.num_layers) if callable(cap) else None,
                   slots=evict_attr(pol, "column_slots"))
    for j, tok in enumerate(toks[:10], start=2):
        want = loop_step(tiny_teacher, bank_a, loop, pol, tok, j)
        got = res.step(tiny_teacher.model, [tok] * B, writer="teacher", steps=[j] * B)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        res.evict(pol.column_drop(res.view(j)))
    closed = res.close()
    assert closed == rows and [len(c) for c in rows] == [len(c) for c in loop]
    for a, b in zip(loop, rows):
        same(a, b)
        assert a.next_position == b.next_position
        assert list(a.ledger.token_id) == list(b.ledger.token_id)
        b.check()
    for j, tok in enumerate(toks[10:], start=12):                   # the closed caches go on as the loop's
        want = loop_step(tiny_teacher, bank_a, loop, pol, tok, j)
        got = loop_step(tiny_teacher, bank_b, rows, pol, tok, j)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for a, b in zip(loop, rows):
        same(a, b)


def test_confkv_resident_follows_its_sawtooth(tiny_teacher, monkeypatch):
    """Conf-KV's budget from each row's confidence (patched to a schedule by step and row: confident steps cut to
    tight, a bulk drop of many entries; uncertain ones grow towards loose, no drop), pyramidal layers: the same logits
    and caches as the batched loop, through cuts, growth and a packing of the freed columns."""
    from kvlab.studies.bench.evict_batch import _Signals

    monkeypatch.setattr(ConfKV, "confidence", lambda self, r, v: 1.0 if r is not None and (r.step + r._b) % 5 == 0 else 0.0)
    pol = ConfKV(tight=8, loose=16, protect=3, pyramidal=True, pyramid_ratio=0.5)
    assert pol.decides_columns and pol.column_capacity(2) == max(pyramid_budgets(16, 2, 0.5)) + 1
    (bank_a, bank_b), (loop, rows), toks, vocab = two_banks(tiny_teacher, pol, n=30)
    model = tiny_teacher.model
    with Resident(bank_b, rows, pol.column_capacity(bank_b.num_layers)) as res:
        masks = 0
        for j, tok in enumerate(toks[:14], start=2):
            logits = forward_rows(bank_a, model, loop, [tok] * B, writer="teacher", steps=[j] * B,
                                  attention=[True] * B)
            sig = _Signals(logits)
            views = [evict_view(c, j, sig.row(j, b), vocab) for b, c in enumerate(loop)]
            apply_keep_rows(loop, keep_rows(pol, views), model)
            got = res.step(model, [tok] * B, writer="teacher", steps=[j] * B)
            torch.testing.assert_close(got, logits, rtol=1e-4, atol=1e-5)
            sig = _Signals(got)
            drop = pol.column_drop(res.view(j, [sig.row(j, b) for b in range(B)], vocab))
            masks += drop.dtype == torch.bool and int(drop.sum(-1).max()) > 1
            res.evict(drop)
            assert res.live.sum(-1).T.tolist() == [c.layer_lengths() for c in loop]
        assert masks >= 2                                       # bulk cuts happened
    for a, b in zip(loop, rows):
        same(a, b)


def test_resident_rows_refuse_use_and_bad_input(tiny_teacher):
    pol = POLICIES["h2o"]
    (_, bank), (_, rows), toks, _ = two_banks(tiny_teacher, pol)
    model = tiny_teacher.model
    with pytest.raises(ValueError, match="rows of its width"):
        Resident(bank, rows[:2])
    with pytest.raises(ValueError, match="caches\\[1\\] is not row 1"):
        Resident(bank, [rows[0], rows[2], rows[1]])
    with pytest.raises(ValueError, match="capacity=12 must be an int >= the longest layer \\+ 1 \\(13\\)"):
        Resident(bank, rows, capacity=12)
    assert rows[0]._mirror.lives[0] is not None and len(rows[0]) == 12     # nothing was taken

    (_, bank), (_, rows), toks, _ = two_banks(tiny_teacher, pol, seed=1)
    with Resident(bank, rows) as res:
        with pytest.raises(ValueError, match="resident in a kvlab.cache.resident.Resident"):
            len(rows[0])
        with pytest.raises(ValueError, match="resident"):
            forward_rows(bank, model, rows, [toks[0]] * B, writer="teacher", steps=[2] * B)
        with pytest.raises(ValueError, match="one entry per row"):
            res.step(model, [toks[0]] * 2, writer="teacher", steps=[2] * 2)
        res.step(model, [toks[0]] * B, writer="teacher", steps=[2] * B)
        with pytest.raises(ValueError, match="not evicted yet"):
            res.step(model, [toks[1]] * B, writer="teacher", steps=[3] * B)
        with pytest.raises(ValueError, match=r"\(L, B\) = "):
            res.evict(torch.zeros(B, dtype=torch.long))
        with pytest.raises(ValueError, match="must lie in"):
            res.evict(torch.full((model.config.num_hidden_layers, B), 99))
        res.evict(pol.column_drop(res.view(2)))
        with pytest.raises(ValueError, match="evicts once"):
            res.evict(pol.column_drop(res.view(2)))
        got = H2O(budget=10, recent=4).column_drop(res.view(2))     # a lower budget: a mask, 12 -> 10 entries
        assert got.dtype == torch.bool and got.sum(-1).tolist() == [[2] * B] * model.config.num_hidden_layers
    assert len(rows[0]) == 12 and rows[0].next_position == 26       # closed on exit: caches again
    with pytest.raises(ValueError, match="closed"):
        res.step(model, [toks[1]] * B, writer="teacher", steps=[3] * B)


def test_unmeasured_steps_append_zeros_as_the_loop(tiny_teacher):
    """Rows that track statistics under a policy that reads none (the sliding window here): ``measure=False`` steps
    append the new entries' zeros and nothing else, as the batched loop's unmeasured step."""
    pol = SlidingWindow(window=12, sinks=2)
    h2o = POLICIES["h2o"]                                           # its prefill: the rows track statistics
    (bank_a, bank_b), (loop, rows), toks, _ = two_banks(tiny_teacher, h2o)
    with Resident(bank_b, rows) as res:
        for j, tok in enumerate(toks[:6], start=2):
            want = loop_step(tiny_teacher, bank_a, loop, pol, tok, j)
            got = res.step(tiny_teacher.model, [tok] * B, writer="teacher", steps=[j] * B, measure=False)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
            res.evict(pol.column_drop(res.view(j)))
    for a, b in zip(loop, rows):
        same(a, b)


def test_a_step_without_its_eviction_closes_one_longer(tiny_teacher):
    pol = POLICIES["h2o"]
    (_, bank), (_, rows), toks, _ = two_banks(tiny_teacher, pol)
    res = Resident(bank, rows)
    res.step(tiny_teacher.model, [toks[0]] * B, writer="teacher", steps=[2] * B)
    res.close()
    for c in rows:
        assert c.layer_lengths() == [13] * c.num_layers
        assert c.live[-1] == len(c.ledger) - 1
        c.check()


def test_which_policies_decide_columns():
    h2o = POLICIES["h2o"]
    assert h2o.decides_columns and POLICIES["scissorhands"].decides_columns
    assert evict_attr(SlidingWindow(window=8), "decides_columns")
    assert not H2O(budget=12, recent=4, per_layer=False).decides_columns       # one live set: not per layer
    assert not evict_attr(Every(h2o, every=4), "decides_columns")             # asked every 4th step
    assert not evict_attr(SnapKV.from_budget(64), "decides_columns")          # one cut, at the first step
    assert evict_attr(ConfKV.from_budget(64), "decides_columns")              # its budgets from each row's record
    assert not ConfKV.from_budget(64, int8_window=16).decides_columns         # INT8 entries
    assert not ConfKV(tight=32, loose=64, protect=8, confidence_from="drawn").decides_columns    # the sampler's nucleus
    assert evict_attr(BlockEvict(), "decides_columns") and evict_attr(BlockEvict(), "column_slots")
    assert not BlockEvict(kvcrush=1).decides_columns and not BlockEvict(rerotate=True).decides_columns
    with pytest.raises(ValueError, match="does not decide over"):
        H2O(budget=12, recent=4, per_layer=False).column_drop(None)
