"""Batched decisions of the ranked policies and block eviction (issue 36, item 3): ``keep_rows(views)`` — every row
of a batch ranked together, one ranking per (sinks, budget, length) group over all rows and layers; block
eviction's block scores of every row and layer one sort — decides exactly what ``keep`` decides row by row: on
random statistics with many ties, ragged layers, rows of different lengths, rows within budget or not due,
statistics carried per layer or as one ``(L, T)`` matrix; and on the rows of a bank whose evictions left holes
(lazy rows)."""
from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import make_tiny_lm  # noqa: E402
from kvlab.decode.protocols import keep_rows  # noqa: E402
from kvlab.eviction import H2O, BlockEvict, ConfKV, EvictView, Knorm, PyramidKV, Scissorhands, SnapKV  # noqa: E402
from kvlab.eviction.ranked import _bottom_rows, _top_rows, rank_items  # noqa: E402

CONFIDENT = SimpleNamespace(entropy_bits=0.05, top1_prob=0.99, margin=0.985)
UNSURE = SimpleNamespace(entropy_bits=6.0, top1_prob=0.2, margin=0.01)

POLICIES = {
    "h2o": lambda: H2O(20, 4),
    "h2o_sinks": lambda: H2O(18, 3, sinks=2),
    "h2o_mean": lambda: H2O(20, 4, per_layer=False),
    "scissorhands": lambda: Scissorhands(20, 4, sinks=1),
    "snapkv": lambda: SnapKV(budget=12, window=2, kernel=3),
    "pyramidkv": lambda: PyramidKV(budget=16, window=2, kernel=3, beta=2),
    "confkv": lambda: ConfKV(gamma=0.5, tight=16, loose=28, protect=3, sinks=2),
    "confkv_pyramid": lambda: ConfKV(gamma=0.5, tight=20, loose=30, protect=4, pyramidal=True, int8_window=6),
    "confkv_recency": lambda: ConfKV(gamma=0.5, tight=20, loose=30, protect=4, attn_weight=0.0),
    "confkv_mean": lambda: ConfKV(gamma=0.5, tight=20, loose=30, protect=4, per_layer=False),
    "knorm": lambda: Knorm(budget=16, sinks=2, protect=3, every_step=True),
    "block": lambda: BlockEvict(block_size=4, start_blocks=1, evictable_blocks=3, recent_blocks=1),
    "block_sum_rerotate": lambda: BlockEvict(block_size=4, start_blocks=1, evictable_blocks=2, recent_blocks=2,
                                             score="sum", rerotate=True),
    "block_kvcrush": lambda: BlockEvict(block_size=4, start_blocks=1, evictable_blocks=3, recent_blocks=1,
                                        kvcrush=1),
}


def row_view(g: torch.Generator, lengths: tuple[int, ...], ties: bool, matrix: bool, first: bool,
             confident: bool) -> EvictView:
    """One row's view: per-layer live positions (sorted, layer 0 starting with the sinks), statistics with
    ties (integers 0..3) or without, as per-layer tuples or (when the layers are alike) one (L, T) matrix."""
    L = len(lengths)
    uniform = len(set(lengths)) == 1
    if uniform:
        lp = (tuple(sorted(torch.randperm(300, generator=g)[:lengths[0]].tolist())),) * L
    else:
        lp = tuple((0, 1) + tuple(sorted(torch.randperm(298, generator=g)[:n - 2].add(2).tolist()))
                   for n in lengths)

    def stat(n):
        return (torch.randint(0, 4, (n,), generator=g).float() if ties
                else torch.rand(n, generator=g, dtype=torch.float64).float() * 5)
    attn = {name: [stat(n) for n in lengths] for name in ("acc", "ema", "low", "count")}
    if matrix and uniform:
        attn = {name: torch.stack(ts) for name, ts in attn.items()}
    else:
        attn = {name: tuple(ts) for name, ts in attn.items()}
    kv = {l: (torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g))
          for l, n in enumerate(lengths)}
    return EvictView(step=3, length=lengths[0], positions=lp[0], record=CONFIDENT if confident else UNSURE,
                     vocab_size=64, num_layers=L, attn=attn, layer_positions=lp, first=first,
                     kv=lambda l, kv=kv: kv[l], modules=tuple(SimpleNamespace() for _ in range(L)))


BATCHES = {                     # per row: layer lengths
    "alike": [(40, 40, 40)] * 5,
    "alike_28_layers": [(64,) * 28] * 3,
    "rows_differ": [(40, 40, 40), (33, 33, 33), (40, 40, 40), (21, 21, 21)],
    "ragged_layers": [(40, 10, 50), (31, 33, 31), (40, 40, 40)],
    "some_within_budget": [(12, 12, 12), (40, 40, 40), (9, 30, 9)],
}


def decisions(keeps) -> list[tuple]:
    return [(tuple(k.slots), None if k.layers is None else tuple(tuple(x) for x in k.layers), k.budget,
             k.confidence, k.int8_window, k.rerotate) for k in keeps]


@pytest.mark.parametrize("matrix", [False, True])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_keep_rows_equals_keep_row_by_row(name, batch, ties, matrix):
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{batch}/{ties}/{matrix}".encode()))
    pol = POLICIES[name]()
    rows = BATCHES[batch]
    if name == "h2o_mean" or name == "confkv_mean":
        rows = [r for r in rows if len(set(r)) == 1] or [(40, 40, 40)]
    views = [row_view(g, r, ties, matrix, first=b % 2 == 0, confident=b % 3 == 0) for b, r in enumerate(rows)]
    together = keep_rows(pol, views)
    assert decisions(together) == decisions([pol.keep(v) for v in views])
    if matrix:                  # the same rows carried per layer: the same decisions
        flat = [EvictView(**{**v.__dict__, "attn": {k: tuple(t) for k, t in v.attn.items()}}) for v in views]
        assert decisions([pol.keep(v) for v in flat]) == decisions(together)


def test_rank_items_blocks_and_rows_agree():
    """A (G, T) block ranks as its G rows given one by one, ties (the older slot goes first) and infinities
    included; a NaN falls back to the sort, and the two rankers agree."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        G, n, s, recent = 6, 50, 2, 5
        x = torch.randint(0, 3, (G, n), generator=g).float()
        x[0, 7] = float("inf")
        x[1, 9] = float("-inf")
        for b in (n - 1, 40, 30, 20, s + recent + 1):
            as_block = rank_items([(x, n, b, recent, s)])[0]
            as_rows = rank_items([(r, n, b, recent, s) for r in x.unbind(0)])
            assert [tuple(k) for k in as_block] == [tuple(k) for k in as_rows]
            for k in as_block:
                assert len(k) == b and tuple(k[:s]) == tuple(range(s)) and tuple(k[-recent:]) == tuple(range(n - recent, n))
    m, d = 40, 7
    x = torch.randint(0, 4, (5, m), generator=g).float()
    kept = _top_rows(x, m - d)
    drop = _bottom_rows(x, d)
    for r in range(5):
        assert sorted(set(range(m)) - set(kept[r].tolist())) == drop[r].tolist()
    x[2, 3] = float("nan")
    with_nan = rank_items([(x, m, m - d, 0, 0)])[0]
    assert [tuple(k) for k in with_nan] == [tuple(k) for k in rank_items([(r, m, m - d, 0, 0) for r in x.unbind(0)])]


@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("name", ["h2o", "scissorhands", "confkv"])
def test_bank_rows_with_holes_decide_alike(name, fill, monkeypatch):
    """Rows of a bank whose evictions left holes (lazy rows, compacted only now and then), or filled them (measured
    rows, ``FILL_MEASURED``: columns out of slot order): the views the evict phase builds (statistics as matrices)
    give the same decisions batched and row by row, and applying them keeps every row's invariants."""
    import kvlab.cache.evict as evict_mod
    from kvlab.cache import KVCache
    from kvlab.cache.batch import Bank, forward_rows
    from kvlab.decode.evict_phase import apply_keep, evict_view
    from kvlab.decode.protocols import evict_attr

    with torch.random.fork_rng():
        lm = make_tiny_lm(seed=3, layers=3)
    model = lm.model
    pol = {"h2o": H2O(24, 4), "scissorhands": Scissorhands(24, 4, sinks=1),
           "confkv": ConfKV(gamma=0.0505, tight=20, loose=28, protect=3)}[name]
    B, g = 4, torch.Generator().manual_seed(1)
    bank = Bank.for_model(model, B, capacity=120)
    caches = []
    for b in range(B):
        c = KVCache()
        c.track_attention(evict_attr(pol, "ema_decay"), window=evict_attr(pol, "attention_window"),
                          pool=evict_attr(pol, "attention_pool"), below=evict_attr(pol, "attention_below"),
                          ema_prefill=evict_attr(pol, "ema_prefill"))
        c.forward(model, torch.randint(3, 128, (30 + 3 * b,), generator=g).tolist(), writer="teacher",
                  attention=True)
        caches.append(bank.adopt(b, c))
    monkeypatch.setattr(evict_mod, "FILL_MEASURED", fill)
    holes = 0
    for step in range(1, 16):
        logits = forward_rows(bank, model, caches, torch.randint(3, 128, (B,), generator=g).tolist(),
                              writer="teacher", steps=[step] * B, attention=[True] * B)
        recs = [SimpleNamespace(step=step, entropy_bits=float(step % 3), top1_prob=0.5, margin=0.1) for _ in caches]
        views = [evict_view(c, step, r, int(logits.shape[-1]), first=step == 1) for c, r in zip(caches, recs)]
        together = keep_rows(pol, views)
        assert decisions(together) == decisions([pol.keep(v) for v in views])
        for c, k in zip(caches, together):
            apply_keep(c, k, model)
            c.check()
        holes += sum(len(lay.holes) if not fill else lay.order is not None for row in bank.rows[:B] for lay in row)
    assert holes > 0                    # the rows did carry holes between compactions (or permuted columns)


CALLS: list[int] = []


@dataclass(frozen=True)
class CountedH2O(H2O):
    """H2O that notes how many rows each batched decision covered (test only)."""

    def keep_rows(self, views):
        CALLS.append(len(views))
        return super().keep_rows(views)


@dataclass(frozen=True)
class OwnKeepH2O(H2O):
    """A subclass that overrides ``keep`` itself: batches decide it row by row, through that ``keep``."""

    def keep(self, view):
        return super().keep(view)


def test_the_batched_loop_decides_its_rows_together(tiny_teacher):
    """BatchDecoding decides the rows sharing a policy in one keep_rows call, and every row's tokens and live
    positions equal its own single decode's; a subclass overriding ``keep`` is decided through it."""
    from kvlab.decode import DecodeConfig, run, run_batch

    prompts = ["the quick brown fox jumps", "over the lazy dog and then some", "a b c d e f g h i j"]
    for pol in (CountedH2O(14, 3, sinks=1), OwnKeepH2O(14, 3)):
        CALLS.clear()
        cfg = DecodeConfig(mode="teacher", chat=False, max_new_tokens=8, evict=pol)
        traces = run_batch(tiny_teacher, None, prompts, cfg)
        if isinstance(pol, CountedH2O):
            assert CALLS and max(CALLS) == len(prompts)
        assert keep_rows(OwnKeepH2O(14, 3), []) == []
        for p, t in zip(prompts, traces):
            alone = run(tiny_teacher, None, p, cfg)
            assert [r.token_id for r in t.records] == [r.token_id for r in alone.records]
            assert [r.evicted for r in t.records] == [r.evicted for r in alone.records]
            assert t.live["positions"] == alone.live["positions"]
