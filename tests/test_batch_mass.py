"""The batched loop's vectorized per-step work gives exactly (bit for bit) what the per-row computations it
replaced gave: the attention mass of many rows at once (``QueryCapture.mass_rows``) vs the old per-row
``mass(row=b)`` pass, the batch's greedy argmax vs ``choose``, the attention statistics' shared lifetime
increment vs one per layer. Everything is compared with ``torch.equal`` / ``==``, no tolerance."""
from __future__ import annotations

import sys

import pytest
import torch

from conftest import make_tiny_lm
from kvlab.cache.attention import QueryCapture
from kvlab.cache.batch import Bank, _group_keys
from kvlab.cache.stats import AttnStats, lifetime_increment
from kvlab.decode import Sampling, choose, token_stats_rows


def reference_mass(cap: QueryCapture, keys_of, n, window=None, below=False, row=None, decay=None):
    """The per-row computation forward_rows ran before (QueryCapture.mass at the previous commit), verbatim."""
    w = n if window is None else min(int(window), n)
    out, lows, emas = [], [], []
    for m in cap.modules:
        i = m.layer_idx
        q, pe = cap.q.get(i), cap.pe.get(i)
        if row is not None:
            q, pe = q[row:row + 1], tuple(t[row:row + 1] if t.shape[0] > 1 else t for t in pe)
        d = m.head_dim
        b = q.shape[0]
        q = q.reshape(b, n, -1, d).transpose(1, 2).float()
        cos, sin = pe
        apply = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")
        q, _ = apply(q, q, cos.float(), sin.float())
        q = q[:, :, n - w:, :]
        k = keys_of(i).float()
        hkv, t = k.shape[1], k.shape[2]
        groups = q.shape[1] // hkv
        qg = q.reshape(b, hkv, groups * w, d)
        scores = torch.matmul(qg, k.transpose(-1, -2)) * float(m.scaling)
        scores = scores.view(b, hkv * groups, w, t)
        if w > 1:
            qi = torch.arange(w, device=q.device).view(w, 1) + (t - w)
            kj = torch.arange(t, device=q.device).view(1, t)
            scores = scores.masked_fill(kj > qi, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        a = probs[0].mean(0)
        out.append(a.sum(0))
        if decay is not None:
            wts = float(decay) ** torch.arange(w - 1, -1, -1, device=a.device, dtype=a.dtype)
            emas.append(wts @ a)
        if below:
            seen = torch.arange(w, device=a.device).view(w, 1) + (t - w) + 1
            vis = torch.arange(t, device=a.device).view(1, t) < seen
            lows.append(((a < 1.0 / seen) & vis).sum(0).float())
    return out, (lows if below else None), (emas if decay is not None else None)


def _captured(lm, B: int, n: int, seed: int = 0) -> QueryCapture:
    """A capture of one batched forward of ``lm`` over random tokens ``(B, n)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (B, n), generator=g)
    pos = torch.randint(0, 50, (B, 1), generator=g) + torch.arange(n)           # rows at different positions
    with torch.inference_mode(), QueryCapture(lm.model) as cap:
        lm.model(input_ids=ids, position_ids=pos, use_cache=False)
    return cap


def _bank(lm, layout: dict[int, tuple[int, int]], B: int, seed: int = 1) -> Bank:
    """A bank of ``lm``'s geometry with random keys; row ``b`` of every layer holds columns ``[s, s + t)``
    for ``layout[b] = (s, t)`` (layer ``i`` holds ``i`` entries fewer: ragged layers)."""
    bank = Bank.for_model(lm.model, B, capacity=96)
    g = torch.Generator().manual_seed(seed)
    for i in range(bank.num_layers):
        bank.k[i].copy_(torch.randn(bank.k[i].shape, generator=g))
    for b, (s, t) in layout.items():
        for i, lay in enumerate(bank.rows[b]):
            lay.s, lay.n = s, t - i
            lay._views()
    return bank


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("copied", [True, False])
def test_mass_rows_equals_the_per_row_mass_exactly(kv_heads, n, copied):
    lm = make_tiny_lm(seed=kv_heads, layers=3, num_kv_heads=kv_heads)
    B = 8
    # rows 0-2: one length, one start (consecutive: keys read as one bank view); rows 3, 4: that length from
    # other starts (``copied``: with 0-2 one group, keys copied) or one longer (their own group); row 5:
    # another length; row 6: row 0's length and start but other settings (its own group); row 7: not measured
    t34 = 20 if copied else 21
    layout = {0: (0, 20), 1: (0, 20), 2: (0, 20), 3: (5, t34), 4: (30, t34), 5: (2, 33), 6: (0, 20), 7: (0, 9)}
    bank = _bank(lm, layout, B)
    cap = _captured(lm, B, n)
    base = (None, False, 0.9)
    settings = {b: base for b in range(6)}
    settings[6] = (2, True, 0.5)
    rows = [0, 1, 2, 3, 4, 5, 6]
    got = cap.mass_rows(rows, n, lambda i, group: _group_keys(bank, i, group), lambda b, i: bank.rows[b][i].n,
                        settings)
    assert sorted(got) == rows
    for b in rows:
        window, below, decay = settings[b]
        want = reference_mass(cap, lambda i, b=b: bank.rows[b][i].keys, n, window=window, below=below, row=b,
                              decay=decay)
        for mine, ref in zip(got[b], want):
            if ref is None:
                assert mine is None
                continue
            assert len(mine) == len(ref) == bank.num_layers
            for x, y in zip(mine, ref):
                assert x.shape == y.shape and torch.equal(x, y), f"row {b}"


def test_group_keys_view_or_copy_are_the_rows_keys():
    lm = make_tiny_lm(seed=0, layers=2)
    bank = _bank(lm, {0: (0, 12), 1: (0, 12), 2: (4, 12), 3: (0, 12)}, 4)
    view = _group_keys(bank, 0, [0, 1])
    assert view.data_ptr() == bank.k[0].data_ptr()                                   # a view, no copy
    for group in ([0, 1], [1, 2], [0, 1, 3], [3, 0]):
        k = _group_keys(bank, 1, group)
        assert torch.equal(k, torch.cat([bank.rows[b][1].keys for b in group]))


def test_single_cache_mass_is_the_reference():
    """QueryCapture.mass (single caches and probes) now runs through the shared helpers: same numbers."""
    lm = make_tiny_lm(seed=2, layers=2, num_kv_heads=2)
    cap = _captured(lm, 1, 4)
    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(1, 2, 11 + i, 16, generator=g) for i in range(2)]
    got = cap.mass(lambda i: keys[i], 4, window=3, below=True, decay=0.8)
    want = reference_mass(cap, lambda i: keys[i], 4, window=3, below=True, decay=0.8)
    for mine, ref in zip((got, cap.low, cap.ema_mass), want):
        assert all(torch.equal(x, y) for x, y in zip(mine, ref))


def test_batch_argmax_is_choose_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[1, 7] = logits[1, 30] = logits[1].max() + 1.0                            # a tie: the first index wins
    logits[2] = 0.0                                                                  # all equal
    logits[3, 4] = float("inf")
    stats = token_stats_rows(logits)
    best = [s[4] for s in stats]
    assert best == [choose(logits[b], Sampling(), None) for b in range(6)]
    assert best[1] == 7 and best[2] == 0 and best[3] == 4


@pytest.mark.parametrize("window", [None, 2])
def test_stats_append_shares_the_lifetime_increment_exactly(window):
    lengths = [7, 5, 7, 9]                                                           # ragged layers, two alike
    st = AttnStats(0.9, lengths, "cpu", window=window, below=True)
    g = torch.Generator().manual_seed(0)
    before = {k: [x.clone() for x in v] for k, v in st.data.items()}
    n = 3
    mass = [torch.rand(t + n, generator=g) for t in lengths]
    low = [torch.rand(t + n, generator=g) for t in lengths]
    st.append(n, mass, low)
    for i, t in enumerate(lengths):
        z = torch.zeros(n)
        count = torch.cat([before["count"][i], z]) + lifetime_increment(t + n, n, window)   # the old per-layer sum
        acc = torch.cat([before["acc"][i], z]) + mass[i]
        assert torch.equal(st.data["count"][i], count) and torch.equal(st.data["acc"][i], acc)
        assert torch.equal(st.data["low"][i], torch.cat([before["low"][i], z]) + low[i])


def test_low_of_seen_is_below_counts_of_the_seen_columns():
    from kvlab.cache.mass import below_counts, low_of_seen

    g = torch.Generator().manual_seed(3)
    B, T = 4, 50
    vis = torch.rand(B, 1, T, generator=g) > 0.3                                    # (B, 1, T) seen columns
    a = torch.softmax(torch.randn(B, 1, T, generator=g).masked_fill(~vis, float("-inf")), -1)
    want = below_counts(a, vis)                                                     # (B, T)
    for b in range(B):
        seen = vis[b, 0]
        got = low_of_seen(a[b, 0][seen], int(seen.sum()))
        assert torch.equal(got, want[b][seen]) and float(want[b][~seen].abs().sum()) == 0.0


@pytest.mark.parametrize("ragged", [False, True])
def test_batched_low_counts_equal_the_per_layer_counts(ragged, monkeypatch):
    """A measured batched step counts Scissorhands' low queries from each row's picked mass, all layers at once
    (``MassSink(low_later=True)``); the same rows stepped with the per-layer counts give the same statistics."""
    import kvlab.cache.batch as kb
    from kvlab.cache import KVCache
    from kvlab.cache.batch import forward_rows
    from kvlab.cache.mass import MassSink

    lm = make_tiny_lm(seed=0)
    vocab = int(lm.model.get_input_embeddings().weight.shape[0])
    g = torch.Generator().manual_seed(0)
    srcs = []
    for n in ([10, 10, 10] if not ragged else [10, 13, 10]):
        c = KVCache()
        c.track_attention(0.5, window=3, below=True)
        c.forward(lm.model, torch.randint(0, vocab, (n,), generator=g).tolist(), writer="teacher", attention=True)
        srcs.append(c)
    toks = torch.randint(0, vocab, (4,), generator=g).tolist()

    def run(later: bool):
        monkeypatch.setattr(kb, "MassSink", lambda *a, **k: MassSink(*a, **{**k, "low_later": later}))
        bank = Bank.for_model(lm.model, 3, capacity=32)
        rows = [bank.adopt(b, s) for b, s in enumerate(srcs)]
        for j, t in enumerate(toks):
            forward_rows(bank, lm.model, rows, [t] * 3, writer="teacher", steps=[1 + j] * 3, attention=[True] * 3)
        return [r._stats.per_layer() for r in rows]

    new, old = run(True), run(False)
    for a, b in zip(new, old):
        assert set(a) == set(b) and "low" in a
        for k in a:
            assert all(torch.equal(x, y) for x, y in zip(a[k], b[k])), k
    assert any(float(x.sum()) > 0 for x in new[0]["low"])                 # some queries were low
