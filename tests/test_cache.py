"""The cache module: ledger invariant, parity, splice, crop, copy, rollback."""
from __future__ import annotations

import pytest
import torch

from kvlab.cache import KVCache


def _ids(n, start=5):
    return list(range(start, start + n))


def test_prefill_and_append_keep_ledger_in_step(tiny_teacher):
    m = tiny_teacher.model
    cache, logits = KVCache.prefill(m, _ids(7), writer="teacher")
    assert logits.shape == (m.config.vocab_size,)
    assert cache.layer_lengths() == [7] * m.config.num_hidden_layers
    assert cache.positions == list(range(7)) and cache.writers == ["teacher"] * 7
    cache.forward(m, [9], writer="student", step=1)
    assert len(cache) == 8 and cache.layer_lengths() == [8, 8]
    assert cache.token_ids[-1] == 9 and cache.positions[-1] == 7 and cache.writers[-1] == "student"
    assert cache.next_position == 8
    cache.check()


def test_cached_logits_equal_uncached(tiny_teacher):
    """TransformerLens-style parity: stepwise cached logits == one uncached forward."""
    m = tiny_teacher.model
    ids = _ids(12)
    cache, _ = KVCache.prefill(m, ids[:5], writer="t")
    stepped = [cache.forward(m, [t], writer="t") for t in ids[5:]]
    with torch.inference_mode():
        full = m(input_ids=torch.tensor([ids]), use_cache=False).logits[0, 5:]
    torch.testing.assert_close(torch.stack(stepped), full, rtol=1e-4, atol=1e-5)


def test_explicit_positions_are_used(tiny_teacher):
    """Positions come from the caller/ledger, not from the cache length."""
    m = tiny_teacher.model
    a, _ = KVCache.prefill(m, _ids(4), writer="t")
    b = a.copy()
    la = a.forward(m, [9], writer="t")                      # position 4
    lb = b.forward(m, [9], writer="t", positions=[40])      # same slot, position 40
    assert a.positions[-1] == 4 and b.positions[-1] == 40 and b.next_position == 41
    assert not torch.allclose(la, lb)


def test_splice_own_entries_leaves_logits_exactly_equal(tiny_teacher):
    m = tiny_teacher.model
    cache, _ = KVCache.prefill(m, _ids(10), writer="teacher")
    twin = cache.copy()
    twin.splice_last(cache, 6)
    assert twin.writers[-6:] == ["teacher"] * 6
    assert len(twin.ledger) == 16 and twin.live[-6:] == list(range(10, 16))
    a = cache.forward(m, [3], writer="t")
    b = twin.forward(m, [3], writer="t")
    assert torch.equal(a, b)


def test_splice_rewrites_tensors_and_provenance(tiny_teacher, tiny_student):
    t, s = tiny_teacher.model, tiny_student.model
    tc, _ = KVCache.prefill(t, _ids(8), writer="teacher")
    sc, _ = KVCache.prefill(s, _ids(8), writer="student")
    before = len(sc.ledger)
    slots = sc.splice_last(tc, 3)
    assert slots == [5, 6, 7]
    assert sc.writers == ["student"] * 5 + ["teacher"] * 3
    for layer in range(sc.num_layers):
        (sk, sv), (tk, tv) = sc.kv(layer), tc.kv(layer)
        assert torch.equal(sk[:, :, -3:], tk[:, :, -3:]) and torch.equal(sv[:, :, -3:], tv[:, :, -3:])
        assert not torch.equal(sk[:, :, :5], tk[:, :, :5])
    # ledger is append-only: the student's original rows are still there, unchanged
    assert len(sc.ledger) == before + 3 and sc.ledger.writer[:8] == ["student"] * 8
    sc.check()


def test_splice_refuses_mismatched_tokens_without_change(tiny_teacher):
    m = tiny_teacher.model
    a, _ = KVCache.prefill(m, _ids(6), writer="a")
    b, _ = KVCache.prefill(m, _ids(6, start=20), writer="b")
    k0 = a.kv(0)[0]
    with pytest.raises(ValueError, match="entries differ"):
        a.splice_last(b, 2)
    assert torch.equal(a.kv(0)[0], k0) and a.writers == ["a"] * 6 and len(a.ledger) == 6
    with pytest.raises(ValueError, match="k="):
        a.splice_last(b, -1)


def test_crop_copy_nbytes(tiny_teacher):
    m = tiny_teacher.model
    cache, _ = KVCache.prefill(m, _ids(9), writer="t")
    cfg = m.config
    per_entry = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert cache.nbytes() == 9 * per_entry
    twin = cache.copy()
    cache.crop(4)
    assert len(cache) == 4 and cache.layer_lengths() == [4, 4] and cache.nbytes() == 4 * per_entry
    assert len(twin) == 9 and twin.nbytes() == 9 * per_entry   # the copy is independent
    assert cache.next_position == 9                            # crop never rewinds positions
    with pytest.raises(ValueError, match="n="):
        cache.crop(5)
    cache.check()
    twin.check()


def test_failed_forward_rolls_back(tiny_teacher):
    m = tiny_teacher.model
    cache, _ = KVCache.prefill(m, _ids(5), writer="t")
    calls = {"n": 0}

    def boom(module, args, output):   # fail inside the 2nd layer, after layer 0 appended K/V
        raise RuntimeError("injected")

    h = m.model.layers[1].register_forward_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            cache.forward(m, [7, 8], writer="t")
    finally:
        h.remove()
    assert cache.layer_lengths() == [5, 5] and len(cache.ledger) == 5 and cache.next_position == 5
    cache.check()
    del calls


def test_check_detects_drift(tiny_teacher):
    m = tiny_teacher.model
    cache, _ = KVCache.prefill(m, _ids(5), writer="t")
    cache.live.pop()   # simulate a one-sided edit
    with pytest.raises(AssertionError, match="out of step"):
        cache.check()


def test_positions_repeated_by_an_interior_insert_are_refused(tiny_teacher):
    """After an interior insert two live slots share a position: splice_positions / append_from
    must refuse it (naming the position) instead of silently taking one slot, and change nothing."""
    m = tiny_teacher.model
    ids = [5, 6, 7, 8, 9, 10]
    c, _ = KVCache.prefill(m, ids, writer="teacher")
    c.insert(3, [20, 21], m, writer="teacher")
    assert c.positions == [0, 1, 2, 3, 4, 3, 4, 5]              # 3 and 4 now held twice
    src, _ = KVCache.prefill(m, c.token_ids, writer="student")  # same tokens, positions 0..7
    before = (list(c.live), [k.clone() for k in c.kv(0)])
    with pytest.raises(ValueError, match=r"this cache holds 2 entries at position 3 \(slots \[3, 5\]\)"):
        c.splice_positions(src, [2, 3])
    assert c.live == before[0] and torch.equal(c.kv(0)[0], before[1][0])
    c.splice_positions(src, [0, 2])                             # unambiguous positions still work
    assert c.writers[:4] == ["student", "teacher", "student", "teacher"]
    dup, _ = KVCache.prefill(m, ids, writer="teacher")
    dup.insert(3, [20, 21], m, writer="teacher")
    empty = KVCache()
    empty.next_position = 3
    with pytest.raises(ValueError, match="src holds 2 entries at position 3"):
        empty.append_from(dup, 1)
