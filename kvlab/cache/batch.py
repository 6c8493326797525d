"""The batched forward over a :class:`~.bank.Bank`: B sequences in one model forward, each row its own cache.

:func:`forward_rows` runs one model forward over the bank's slots ``[0, width)``, each row appending its
token(s) at its own positions (``position_ids`` ``(B, n)``). Row ``b``'s new keys are written at its columns
``s_b + n_b + j`` of every layer; the ``"kvlab"`` attention function (:mod:`.attn_fn`) gets each layer's per-row
mask ``(B, 1, n, W)`` (True on the row's used columns and its new ones up to the query; padding and other rows'
garbage masked; on CUDA ``W`` is rounded up to a multiple of :data:`WIDTH_STEP`, the extra columns masked)
through the forward's kwargs. Rows of different lengths (a batched prefill, teachers catching up) are padded at
the end; the padding is never committed. Each layer reads the columns from the first one any row uses (a row's
evictions move its start up until it moves to the front: those columns are not read). Rows inside the width with
nothing to do this step (waiting on a refresh's logits, or finished but not yet swapped out) ride along as dummies:
they write a throwaway column past their used part and see only it; their cache is unchanged. After the forward each
active row commits its columns (lengths + n), ledger rows, live maps and attention mass — or, on any error, no row
commits anything. Rows that defer their statistics (``defer``) add the step's attention probabilities into the
bank's per-column sums (all rows deferring: one eager pass) or run the plain attention and keep their queries
(:mod:`.deferred`). A step that computes attention eagerly (a mass sink) gets additive masks, built once per step.
No step copies a cache.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.cache import attn_fn
from kvlab.cache import evict as evict_mod
from kvlab.cache.deferred import KWARG as QUERIES_KWARG
from kvlab.cache.deferred import ColumnSink, QuerySink, columns_ok
from kvlab.cache.attention import QueryCapture
from kvlab.cache.mass import KWARG as MASS_KWARG
from kvlab.cache.mass import MassSink, low_of_seen
from kvlab.cache.step import explicit_step
from kvlab.cache.buffer import live_offsets_of
from kvlab.cache.bank import Bank, RowLayer  # noqa: F401 - RowLayer re-exported: kvlab.cache.batch's names stay
from kvlab.core.compat import cache_kwarg

MASKS_KWARG = "kvlab_masks"
# Key widths a batched step hands the attention, per device type: a multiple of this many columns (the extra ones
# masked; never past the bank's capacity). On CUDA (torch 2.11, H200) SDPA pays tens of ms for every key width it has
# not seen and a decode step meets a new width every step (docs/measured/cuda_s8/sdpa_mask.jsonl; an additive mask
# did not avoid it inside the model, docs/measured/cuda_s10); padded widths repeat. The CPU reads exact widths.
WIDTH_STEP = {"cuda": 256}


class _StepLayer(DynamicLayer):
    """One layer of the throwaway cache a batched step runs on: writes row ``b``'s new key at column
    ``cols[b]`` of the bank's buffer and returns the ``width`` columns from ``lo`` on (views)."""

    def __init__(self, bank: Bank, i: int, cols: torch.Tensor, width: int, lo: int = 0):
        super().__init__()
        self.bank, self.i, self.cols, self.width, self.lo = bank, i, cols, width, lo
        self.B = bank.width
        self.rows = torch.arange(self.B, device=bank.device)
        self.is_initialized = True
        self.dtype, self.device = bank.dtype, bank.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = self.bank.k[self.i][:self.B], self.bank.v[self.i][:self.B]   # (B, H_kv, cap, D) slots < width
        n = key_states.shape[2]
        if n == 1:
            k[self.rows, :, self.cols] = key_states[:, :, 0].to(k.dtype)     # (B, H_kv, D) at (b, cols[b])
            v[self.rows, :, self.cols] = value_states[:, :, 0].to(v.dtype)
        else:
            idx = self.cols[:, None] + torch.arange(n, device=self.cols.device)                  # (B, n)
            k[self.rows[:, None], :, idx] = key_states.transpose(1, 2).to(k.dtype)               # (B, n, H_kv, D)
            v[self.rows[:, None], :, idx] = value_states.transpose(1, 2).to(v.dtype)
        self.keys, self.values = k[:, :, self.lo:self.lo + self.width], v[:, :, self.lo:self.lo + self.width]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.width - 1


class _StepCache(Cache):
    def __init__(self, layers):
        super().__init__(layers=layers)


@torch.inference_mode()
def forward_rows(bank: Bank, model, caches: Sequence, tokens: Sequence, *, writer: str,
                 steps: Sequence[int], attention: Sequence[bool] | None = None,
                 defer: Sequence[bool] | None = None) -> torch.Tensor:
    """One batched forward over the bank's slots ``[0, bank.width)``. ``caches[b]`` is slot ``b``'s
    KVCache (from :meth:`Bank.row_cache` / :meth:`Bank.adopt`) or None (a dummy row this time);
    ``tokens[b]`` the token (a decode step) or token list (a prefill or a teacher catching up; rows
    may differ in length: padded, the padding never committed) it appends at its ``next_position``
    on; ``steps[b]`` its ledger step. The lists have ``bank.batch`` entries (None past the width).
    ``attention[b]``: measure row ``b``'s attention mass (needs ``track_attention``; rows of the
    longest length only). ``defer[b]``: row ``b``'s one-token step keeps its queries and its attention statistics
    are computed when next read or edited (:mod:`.deferred`; needs ``track_attention``, excludes
    ``attention[b]``). Returns logits ``(width, V)``: each row's after its last token (dummies'
    are meaningless). All-or-nothing: on error no row's cache changes."""
    if len(caches) != bank.batch or len(tokens) != bank.batch or len(steps) != bank.batch:
        raise ValueError(f"caches, tokens and steps need one entry per slot ({bank.batch})")
    B = bank.width
    if any(c is not None for c in caches[B:]):
        raise ValueError(f"slots {B}.. are past the bank's width ({B}): they take no part in a forward")
    caches, tokens, steps = list(caches[:B]), list(tokens[:B]), list(steps[:B])
    attention = list(attention)[:B] if attention is not None else [False] * B
    defer = list(defer)[:B] if defer is not None else [False] * B
    active = [b for b in range(B) if caches[b] is not None]
    if not active:
        raise ValueError("forward_rows needs at least one active row")
    seqs: list[list[int] | None] = [None] * B
    for b in active:
        c, t = caches[b], tokens[b]
        if not bank.owns(b, c):
            raise ValueError(f"row {b}: its cache is not row {b} of this bank (an edit replaced its storage)")
        if t is None:
            raise ValueError(f"row {b}: an active row needs a token")
        seqs[b] = [int(t)] if isinstance(t, int) or (isinstance(t, torch.Tensor) and t.dim() == 0) \
            else [int(x) for x in t]                        # a decode step's int: no tensor built per row
        if not seqs[b]:
            raise ValueError(f"row {b}: tokens[{b}] is empty")
    n_max = max(len(seqs[b]) for b in active)
    for b in active:
        if attention[b] and caches[b]._stats is None:
            raise ValueError(f"row {b}: attention=True needs cache.track_attention(ema_decay) first")
        if defer[b] and (caches[b]._stats is None or attention[b] or len(seqs[b]) != 1):
            raise ValueError(f"row {b}: defer=True needs cache.track_attention first, one token, and attention=False")
        if attention[b] and len(seqs[b]) != n_max:
            raise ValueError(f"row {b}: attention mass needs the row's tokens to fill the batch ({n_max}), got "
                             f"{len(seqs[b])}")
    device = bank.device
    L = bank.num_layers
    bank.flush_moves()                                          # filling evictions' column moves, all rows at once
    deferring = [b for b in active if defer[b]]
    # deferring rows keep the step's probabilities in the bank's columns (one eager pass, no replay at the read)
    # when they can; else their queries (kvlab.cache.deferred)
    columns = bool(deferring) and n_max == 1 and not any(attention[b] for b in active) and \
        columns_ok([caches[b] for b in deferring])
    for b in active:
        st = caches[b]._stats
        if attention[b] or (defer[b] and st.pending and (st.pending[0][0] is None) != columns):
            caches[b]._settle()                                 # its deferred steps first: the fold keeps order
    materialized = []
    try:
        for b in active:
            caches[b]._store.materialize()
            materialized.append(b)
        want = [b for b in active if attention[b]]
        settings = {b: (caches[b]._stats.window, caches[b]._stats.below, caches[b]._stats.query_decay)
                    for b in want}
        sink = MassSink(*settings[want[0]], low_later=n_max == 1) if want and len(set(settings.values())) == 1 \
            else None
        cols, starts = [], []                                   # B x L: each row's new column, first column seen
        dead = []                                               # holes a row's evictions left: masked below
        pooled = columns and caches[deferring[0]]._stats.pool > 1   # pooled column sums: neighbours must be entries
        holed = []                      # dummies, the capture's pass and pooling read hole-free rows, the mass in order
        # a one-query measured step puts a permuted row's mass in slot order (evict.FILL_MEASURED: else in order first)
        in_order = sink is not None and n_max == 1 and evict_mod.FILL_MEASURED
        for b, row in enumerate(bank.rows[:B]):
            for lay in row:
                if lay.sparse and (caches[b] is None or (want and sink is None) or (pooled and defer[b] and lay.holes)
                                   or (lay.order is not None and attention[b] and not in_order)):
                    if lay.order is None:
                        holed.append(lay)
                    else:
                        lay.compact()
        if holed:
            bank.compact_rows(holed)                            # every row layer's holes at once
        for b, row in enumerate(bank.rows[:B]):                 # one pass: n_max free columns per row and layer
            c_row, s_row = [], []
            for i, lay in enumerate(row):
                if lay.s > max(16, lay.n // 4):                 # attention reads columns [0, s + p]: keep rows near
                    lay._to_front()                             # the front (amortized: once per n/4 columns)
                lay.reserve(n_max)                              # (growth keeps every other row's s and n)
                c_row.append(lay.s + lay.p)
                s_row.append(lay.s)
                if lay.holes:
                    dead.append((i, b, lay.holes, lay.s))
            cols.append(c_row)
            starts.append(s_row if caches[b] is not None else c_row)
        cols_t = torch.tensor(cols, dtype=torch.long, device=device).T                    # (L, B)
        starts_t = torch.tensor(starts, dtype=torch.long, device=device).T                # (L, B)
        step = WIDTH_STEP.get(device.type, 1)
        # per layer the columns [lo, lo + width) are read: from the first column any row sees (a row's used part
        # starts at its s, which its evictions move up until it is moved to the front) to the last new one
        used = [max(c[i] for c in cols) + n_max for i in range(L)]
        lows = [min(s[i] for s in starts) for i in range(L)]
        extra = caches[deferring[0]]._stats.pool - 1 if pooled else 0     # pooled sums: the pool's window past the
        widths = [min(-(-(u + extra - lo) // step) * step, bank.capacity(i))         # end read as masked columns
                  for i, (u, lo) in enumerate(zip(used, lows))]
        lows = [min(lo, bank.capacity(i) - w) for i, (lo, w) in enumerate(zip(lows, widths))]   # rounded: in the bank
        W = max(widths)
        lo_t = torch.tensor(lows, dtype=torch.long, device=device)                        # (L,)
        ar = lo_t[:, None, None, None] + torch.arange(W, device=device)                   # (L, 1, 1, W) columns
        last = cols_t[..., None] + torch.arange(n_max, device=device)                     # (L, B, n) query j's column
        masks = (ar >= starts_t[..., None, None]) & (ar <= last[..., None])                # (L, B, n, W)
        if dead:                                                                          # dead columns: unseen
            hl, hb, hc = bank.dead_index(dead)
            masks[hl, hb, :, hc - lo_t[hl]] = False
        if sink is not None and n_max == 1:                    # every layer's mass written into one (L, B, W) tensor
            sink.block = torch.empty(L, B, W, dtype=torch.float32, device=device)
        step_cache = _StepCache([_StepLayer(bank, i, cols_t[i], widths[i], lows[i]) for i in range(L)])
        per_layer = [masks[i, :, None, :, :widths[i]] for i in range(L)]                  # (B, 1, n, W_i)
        ids = torch.tensor([(s or [0]) + [0] * (n_max - len(s or [0])) for s in seqs], dtype=torch.long,
                           device=device)                                                 # (B, n)
        nxt = [caches[b].next_position if caches[b] is not None else 0 for b in range(B)]
        pos = torch.tensor(nxt, dtype=torch.long, device=device)[:, None] + torch.arange(n_max, device=device)
        keep = sorted({len(seqs[b]) - 1 for b in active})                                 # logits needed
        attn_fn.use(model)
        kwargs = dict(input_ids=ids, position_ids=pos, **{cache_kwarg(model): step_cache}, use_cache=True,
                      logits_to_keep=1 if n_max == 1 else torch.tensor(keep, device=device),
                      **{MASKS_KWARG: per_layer})
        qsink = QuerySink() if deferring and not columns else None
        csink = None
        if qsink is not None:
            kwargs[QUERIES_KWARG] = qsink
        if columns:
            st = caches[deferring[0]]._stats
            slots = None            # pooling rows a filling eviction permuted: the pool runs in slot order
            if pooled and any(lay.order is not None for b in deferring for lay in bank.rows[b]):
                slots = bank.slot_columns(W, starts_t, lo_t, st.pool - 1)              # (L, B, w + pool - 1)
            csink = ColumnSink(bank, lows, st.ema_decay, st.below, None if len(deferring) == B else
                               torch.tensor([defer[b] for b in range(B)], device=device), pool=st.pool,
                               seen=masks[:, :, 0].sum(-1, keepdim=True) if st.below else None,   # (L, B, 1)
                               spare=[lo + w - u for lo, w, u in zip(lows, widths, used)], slots=slots)
            kwargs[MASS_KWARG] = csink
        if sink is not None:                                    # one pass: the attention function measures
            kwargs[MASS_KWARG] = sink
        if n_max == 1 and (sink is not None or csink is not None):   # the eager step adds its masks (no bool fill)
            add = torch.zeros(masks.shape, dtype=torch.float32, device=device).masked_fill_(~masks, float("-inf"))
            kwargs[MASKS_KWARG] = [add[i, :, None, :, :widths[i]] for i in range(L)]   # (B, 1, 1, W_i) additive
        explicit = explicit_step(model) if not (want and sink is None) else None
        if explicit is not None:                                # the layers written out, packed products
            logits = explicit(ids, pos, step_cache, kwargs["logits_to_keep"],
                              **{k: kwargs[k] for k in (MASKS_KWARG, MASS_KWARG, QUERIES_KWARG) if k in kwargs})
        elif want and sink is None:                             # rows measure differently: the capture's pass
            with QueryCapture(model) as cap:
                logits = model(**kwargs).logits
        else:
            logits = model(**kwargs).logits
        for b in active:                                        # the new columns join each active row
            for lay in bank.rows[b]:
                lay.n += len(seqs[b])
                lay._views()
        masses = {}
        try:
            queries = qsink.stacked(L) if qsink is not None else None                     # (L, B, H, D)
            if csink is not None:
                csink.apply(L)
                for b in deferring:                             # their sums may be nonzero now (Bank.summed)
                    bank.summed[b] = True
            if sink is not None:
                masses = _sink_rows(sink, bank, want, settings[want[0]], per_layer, masks)
            elif want:                                          # all measured rows at once (QueryCapture.mass_rows)
                masses = cap.mass_rows(want, n_max, lambda i, group: _group_keys(bank, i, group),
                                       lambda b, i: bank.rows[b][i].n, settings)
        except BaseException:
            for b in active:
                for lay in bank.rows[b]:
                    lay.n -= len(seqs[b])
                    lay._views()
            raise
    except BaseException:
        for b in materialized:
            caches[b]._store.dematerialize()
        raise
    from kvlab.cache.forward import commit_append

    scales = [qsink.scaling[i] for i in range(L)] if qsink is not None else None          # per layer, once a step
    for b in active:
        c = caches[b]
        c._store.dematerialize()
        before = [len(x) for x in c._mirror.lives]
        mass, low, ema_mass = masses.get(b, (None, None, None))
        p0 = c.next_position
        commit_append(c, seqs[b], list(range(p0, p0 + len(seqs[b]))), writer, int(steps[b]), mass, low, before,
                      ema_mass)
        if defer[b]:
            c._stats.defer(queries, None if columns else b, c.layer_lengths(), scales)
    # logits: (B, k, V)
    if n_max == 1:
        return logits[:, -1, :]                                                           # (B, V)
    pick = torch.tensor([keep.index(len(s) - 1) if s else 0 for s in seqs], device=logits.device)
    return logits[torch.arange(B, device=logits.device), pick]                            # (B, V)


def _sink_rows(sink: MassSink, bank: Bank, rows: list[int], setting: tuple, masks: list[torch.Tensor],
               full: torch.Tensor | None = None) -> dict:
    """Each measured row's per-layer ``(mass, low, ema_mass)`` (lists of ``(T_i,)``; None where not kept) out of
    the sink's ``(B, W_i)`` bank columns: row ``b``'s live columns of every layer — those its last query saw
    (``masks[i]`` ``(B, 1, n, W_i)``: its used span, holes left out, the new columns in; ``full`` ``(L, B, n, W)``:
    all of them, narrower layers' extra columns unseen). One boolean pick per layer for all rows, split by row; when
    the sink wrote every layer's mass into one block (:attr:`MassSink.block`), one pick for all layers. The picks
    come in column order; a layer a filling eviction permuted (one query per row) is put in slot order
    (:func:`_slot_index`)."""
    _, below, decay = setting
    L = bank.num_layers
    later = below and sink.low_later                      # the low counts from the picked mass (one query per row)
    got = {"mass": sink.layers("mass", L), "low": sink.layers("low", L) if below and not later else None,
           "ema": sink.layers("ema", L) if decay is not None else None}
    if sink.block is not None and full is not None and got["low"] is None:            # one query: ema is the mass
        fast = _sink_stacked({"mass": sink.block, "low": None, "ema": sink.block if decay is not None else None},
                             full[:, :, -1, :], rows, later, bank)                    # (L, B, W) seen
        seen = None
    else:
        seen = [m[:, 0, -1, :] for m in masks]                                        # (B, W_i) bool
        wide = max(x.shape[1] for x in seen)              # layers' widths differ after per-layer evictions: pad
        fast = _sink_stacked(got, torch.stack([F.pad(x, (0, wide - x.shape[1])) for x in seen]), rows, later, bank)
    if fast is not None:
        return fast
    if seen is None:                                      # rows see different counts: per layer, from here on
        seen = [m[:, 0, -1, :] for m in masks]                                        # (B, W_i) bool
    counts = [seen_i.sum(1).tolist() for seen_i in seen]                              # per layer, per row
    split = {}
    for name, per_layer in got.items():
        if per_layer is not None:
            split[name] = [t[:, :seen[i].shape[1]][seen[i]].split(counts[i]) for i, t in enumerate(per_layer)]
    out = {}
    for b in rows:
        lays = bank.rows[b]
        out[b] = tuple(None if name not in split else [_in_slots(split[name][i][b], lays[i]) for i in range(L)]
                       for name in ("mass", "low", "ema"))
        if later:
            m = out[b][0]
            out[b] = (m, [low_of_seen(x, x.shape[-1]) for x in m], out[b][2])
    return out


def _in_slots(t: torch.Tensor, lay) -> torch.Tensor:
    """One row layer's picked statistic ``(c,)`` (column order) in slot order: a layer a filling eviction permuted
    holds slot ``j`` at offset ``order[j]`` (no holes); any other layer's picks are in slot order already."""
    return t if lay.order is None else t.index_select(0, lay.live_offsets().to(t.device))


def _slot_index(bank: Bank, rows: list[int], c: int, device) -> torch.Tensor | None:
    """``(R, L, c)`` long: for each measured row and layer, the pick (in column order) holding each slot's statistic
    (:func:`_in_slots` for all rows at once); None when no layer of these rows is permuted."""
    lays = [lay for b in rows for lay in bank.rows[b]]
    if all(lay.order is None for lay in lays):
        return None
    if all(lay.order is not None for lay in lays):                 # the rows' orders read at once (one block)
        return live_offsets_of(lays, c).reshape(len(rows), -1, c).to(device)
    ident = torch.arange(c)
    idx = torch.stack([ident if lay.order is None else lay.live_offsets() for lay in lays])    # (R·L, c)
    return idx.view(len(rows), -1, c).to(device)


def _sink_stacked(got: dict, seen: torch.Tensor, rows: list[int], low_later: bool = False,
                  bank: Bank | None = None) -> dict | None:
    """:func:`_sink_rows` when each measured row sees ``c`` columns on every layer (``seen`` ``(L, B, W)``, narrower
    layers padded with unseen columns; each statistic per layer, or one ``(L, B, W)`` block whose unseen columns are
    never read): one boolean pick per statistic for all rows and layers, each row's
    statistic an ``(L, c)`` matrix (its layers' rows), in slot order (``bank``: its permuted layers,
    :func:`_slot_index`); ``low_later``: the low counts from the picked mass, one
    comparison for all rows (:func:`~kvlab.cache.mass.low_of_seen`). None (nothing done) otherwise."""
    every = rows == list(range(seen.shape[1]))            # every row of the step measured: no selection
    idx = None if every else torch.tensor(rows, dtype=torch.long, device=seen.device)
    seen = seen if every else seen.index_select(1, idx)                               # (L, R, W)
    counts = seen.sum(-1)                                                             # (L, R)
    c = int(counts[0, 0])
    if not bool((counts == c).all()):
        return None
    L, R, W = seen.shape
    at = seen.reshape(-1).nonzero().squeeze(1)                                        # (L·R·c,) flat picks
    order = _slot_index(bank, rows, c, seen.device) if bank is not None else None    # (R, L, c) or None
    split, done = {}, {}
    for name, per_layer in got.items():
        if per_layer is not None:
            key = id(per_layer) if isinstance(per_layer, torch.Tensor) else tuple(map(id, per_layer))   # ema is mass
            if key not in done:                                                       # when w == 1
                x = per_layer if isinstance(per_layer, torch.Tensor) else \
                    torch.stack([F.pad(t[:, :W], (0, W - min(W, t.shape[1]))) for t in per_layer])
                x = x if every else x.index_select(1, idx)                            # (L, R, W)
                done[key] = x.reshape(-1).index_select(0, at).view(L, R, c).transpose(0, 1)   # (R, L, c)
                if order is not None:                                                 # column order -> slot order
                    done[key] = done[key].gather(2, order)
            split[name] = done[key]
    if low_later:
        split["low"] = low_of_seen(split["mass"], c)                                  # (R, L, c)
    return {b: tuple(split[name][j] if name in split else None for name in ("mass", "low", "ema"))
            for j, b in enumerate(rows)}


def _group_keys(bank: Bank, i: int, group: list[int]) -> torch.Tensor:
    """Layer ``i``'s keys of the rows ``group`` (all the same length ``T``), ``(G, H_kv, T, D)``: a view of
    the bank when they are consecutive rows starting at the same column, else one copy of their views."""
    lays = [bank.rows[b][i] for b in group]
    s, t = lays[0].s, lays[0].n
    if all(lay.s == s for lay in lays) and group == list(range(group[0], group[0] + len(group))):
        return bank.k[i][group[0]:group[0] + len(group), :, s:s + t]                     # (G, H_kv, T, D) view
    return torch.cat([lay.keys for lay in lays])                                          # (G, H_kv, T, D)
