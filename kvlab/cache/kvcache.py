"""The one module that touches KV-cache tensors.

A :class:`KVCache` wraps a transformers ``DynamicCache`` (tensors per layer, shape
``(B, H_kv, T, D)``, keys post-RoPE) together with a token mirror:

* the **ledger** — an append-only table of every entry ever written: token id, absolute
  (RoPE) position, the writer (which model computed the K/V), the decode step. Rows are never
  rewritten or reordered.
* the **live map** — ``slot -> ledger row`` for the entries currently in the cache, in slot order.

Every edit (prefill/append via :meth:`KVCache.forward`, :meth:`splice_last`, :meth:`crop`, …)
changes the tensors and the live map in the same call, and restores both if it fails, so
``len(live) == cache length`` on every layer at all times (:meth:`check`). Nothing outside
this module reads ``cache.layers[i].keys``: a transformers cache-API change breaks one file.

Surgery (seed 004, "Step 4"): :meth:`KVCache.apply` executes an action list — ``delete``,
``insert``, ``replace_pair``, ``add`` — as one tick; :meth:`delete`, :meth:`insert`,
:meth:`append` are one-action ticks. See :meth:`KVCache.apply` for the position semantics.

Eviction (issue 9): :meth:`KVCache.evict` removes entries by slot from every layer, the live
map and the per-entry attention statistics in one call (event ``evicted``); survivors keep their
absolute positions unless ``rerotate=True``, which moves them to consecutive positions by
rotating their post-RoPE keys (:meth:`reposition`, :mod:`.rope`). :meth:`quantize_older` moves
entries older than an FP window to INT8 storage (:mod:`.int8`); the model still sees an ordinary
``DynamicCache`` because every forward materializes the dequantized prefix for its duration.

One live set for all layers. Per-layer (pyramidal) lengths were tried against transformers
5.x: with ragged layers a one-token decode step works only under ``sdpa`` (its causal mask is
skipped); ``eager`` fails (the mask is sized from layer 0), and every multi-token forward
(surgery inserts, rebuilds, prefills over a cache) fails under both, because one mask sized
by layer 0's length is shared by all layers. The mirror (ledger, live map, refresh splices by
position) is also shared. So every layer keeps the same entries; see
``tests/test_eviction_cache.py::test_ragged_layers_break_transformers_masks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .attention import QueryCapture
from .int8 import Int8Layer
from .ledger import EventLog, Ledger, Row
from .plan import _ORIGIN_EVENTS, _REMOVAL_EVENTS, SPLICE_MODES, SurgeryError, TickPlan, TickReport, plan_actions


class KVCache:
    """A DynamicCache plus its ledger and live map, edited in lock-step.

    Batch size is 1 (one sequence); ``next_position`` is the RoPE position the next appended
    token gets. It is owned here and by the decode loop, never inferred from the cache length.
    """

    def __init__(self, hf: DynamicCache | None = None, ledger: Ledger | None = None,
                 live: list[int] | None = None, next_position: int = 0):
        self._hf = hf if hf is not None else DynamicCache()
        self.ledger = ledger if ledger is not None else Ledger()
        self.live: list[int] = live if live is not None else []
        self.next_position = int(next_position)
        self.events = EventLog()   # append-only edit history: surgery ticks and evictions (see ledger_status)
        self.ticks = 0             # edit ticks attempted (surgery and eviction)
        self._int8: list[Int8Layer] | None = None   # the oldest n_int8 slots of every layer, INT8
        self.attn: dict[str, torch.Tensor] | None = None  # per-entry attention stats (track_attention)
        self.ema_decay: float | None = None
        self.attn_window: int | None = None   # only the last attn_window queries of a forward are measured
        self.attn_pool: int = 1               # each forward's mass is max-pooled over this many entries
        self.check()

    # ------------------------------------------------------------------ introspection

    def __len__(self) -> int:
        return len(self.live)

    @property
    def num_layers(self) -> int:
        return len(self._hf.layers)

    def layer_lengths(self) -> list[int]:
        return [self.n_int8 + _layer_len(layer) for layer in self._hf.layers]

    @property
    def n_int8(self) -> int:
        """Entries (the oldest slots, same on every layer) held in INT8 storage."""
        return len(self._int8[0]) if self._int8 else 0

    @property
    def token_ids(self) -> list[int]:
        tid = self.ledger.token_id
        return [tid[i] for i in self.live]

    @property
    def positions(self) -> list[int]:
        pos = self.ledger.position
        return [pos[i] for i in self.live]

    @property
    def writers(self) -> list[str]:
        w = self.ledger.writer
        return [w[i] for i in self.live]

    def rows(self) -> list[Row]:
        """Ledger rows of the live entries, in slot order."""
        return [self.ledger.row(i) for i in self.live]

    def check(self) -> None:
        """The invariant: every layer holds exactly ``len(live)`` entries, batch 1, live rows valid."""
        for i, layer in enumerate(self._hf.layers):
            if not isinstance(layer, DynamicLayer) or type(layer).__name__ != "DynamicLayer":
                raise TypeError(f"layer {i} is {type(layer).__name__}; kvlab supports full-attention "
                                "DynamicLayer caches only")
            n = self.n_int8 + _layer_len(layer)
            if n != len(self.live):
                raise AssertionError(f"cache/ledger out of step: layer {i} holds {n} entries, live map {len(self.live)}")
            if n and layer.keys.shape[0] != 1:
                raise AssertionError(f"layer {i} has batch {layer.keys.shape[0]}; KVCache holds one sequence")
        if self.live and (min(self.live) < 0 or max(self.live) >= len(self.ledger)):
            raise AssertionError("live map points outside the ledger")
        if self._int8 is not None and any(len(q) != self.n_int8 for q in self._int8):
            raise AssertionError("INT8 stores of the layers hold different numbers of entries")
        if self.attn is not None:
            for name, t in self.attn.items():
                if t.shape[-1] != len(self.live):
                    raise AssertionError(f"attention stat {name!r} has {t.shape[-1]} entries, live map {len(self.live)}")

    def nbytes(self) -> int:
        """Real bytes of K/V storage over all layers: the FP tensors at their dtype plus the INT8
        entries with their scales and group ids (:mod:`.int8`). Attention statistics are not K/V
        (see :meth:`meta_nbytes`)."""
        total = 0
        for layer in self._hf.layers:
            if _layer_len(layer):
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        for q in self._int8 or ():
            total += q.nbytes()
        return total

    def meta_nbytes(self) -> int:
        """Bytes of the per-entry attention statistics kept for eviction policies."""
        return sum(t.numel() * t.element_size() for t in (self.attn or {}).values())

    def geometry(self) -> dict:
        """Layers, KV heads, head dim, dtype of the stored tensors (empty dict before the first write)."""
        if not len(self) or not self.num_layers:
            return {}
        keys = self._hf.layers[0].keys
        b, h, _, d = keys.shape  # (B, H_kv, T, D)
        return {"layers": len(self._hf.layers), "kv_heads": h, "head_dim": d, "dtype": str(keys.dtype)}

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only copies of one layer's (keys, values), each (B, H_kv, T, D), for analysis
        (INT8 entries dequantized)."""
        k, v = self._full_kv(layer)
        return k.detach().clone(), v.detach().clone()

    def to_frame(self):
        """The live map as a DataFrame: slot, ledger row, token id, position, writer, step."""
        import pandas as pd

        led = self.ledger
        return pd.DataFrame({
            "slot": range(len(self.live)),
            "row": self.live,
            "token_id": [led.token_id[i] for i in self.live],
            "position": [led.position[i] for i in self.live],
            "writer": [led.writer[i] for i in self.live],
            "step": [led.step[i] for i in self.live],
        })

    def __repr__(self) -> str:
        from collections import Counter

        return (f"KVCache(len={len(self)}, layers={self.num_layers}, next_position={self.next_position}, "
                f"writers={dict(Counter(self.writers))}, ledger_rows={len(self.ledger)})")

    # ------------------------------------------------------------------ edits

    @torch.inference_mode()
    def forward(self, model, token_ids: Sequence[int] | torch.Tensor, *, writer: str, step: int = -1,
                positions: Sequence[int] | None = None, logits: str = "last", attention: bool = False) -> torch.Tensor:
        """Run ``model`` on ``token_ids`` over this cache, appending their K/V (prefill or decode step).

        Positions default to ``next_position, next_position+1, …`` and are passed explicitly as
        ``position_ids``. Returns logits ``(n, V)`` for ``logits="all"`` or ``(V,)`` for ``"last"``.
        On error the cache and ledger are rolled back to their state before the call.

        ``attention=True`` (needs :meth:`track_attention` first) also measures this forward's
        attention mass over every entry (:class:`~kvlab.cache.attention.QueryCapture`: hooks for
        this call only) and folds it into :attr:`attn`. INT8 entries are dequantized into the
        ``DynamicCache`` for the duration of the forward and dropped again afterwards.
        """
        if attention and self.attn is None:
            raise ValueError("attention=True needs cache.track_attention(ema_decay) first")
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = ids.numel()
        if n == 0:
            raise ValueError("token_ids must hold at least one token")
        if logits not in ("last", "all"):
            raise ValueError(f"logits={logits!r} must be 'last' or 'all'")
        if positions is None:
            positions = range(self.next_position, self.next_position + n)
        positions = [int(p) for p in positions]
        if len(positions) != n:
            raise ValueError(f"positions has {len(positions)} entries for {n} tokens")
        device = next(model.parameters()).device
        before = len(self.live)
        n_rows = len(self.ledger)
        nq = self.n_int8
        try:
            self._materialize()
            if attention:
                with QueryCapture(model) as cap:
                    out = model(input_ids=ids.to(device).view(1, n),                   # (1, n)
                                position_ids=torch.tensor([positions], device=device),
                                past_key_values=self._hf, use_cache=True,
                                logits_to_keep=0 if logits == "all" else 1)
                mass = cap.mass(lambda i: self._hf.layers[i].keys, n, window=self.attn_window)  # (L, T)
                mass = max_pool_next(mass, self.attn_pool)                             # (L, T)
            else:
                out = model(input_ids=ids.to(device).view(1, n),                       # (1, n)
                            position_ids=torch.tensor([positions], device=device),     # (1, n)
                            past_key_values=self._hf, use_cache=True,
                            logits_to_keep=0 if logits == "all" else 1)
                mass = None
            self._dematerialize(nq)
            rows = self.ledger.append(ids.tolist(), positions, writer, step)
            self.live.extend(rows)
            self._meta_append(n, mass)
            self.check()
        except BaseException:
            self._dematerialize(nq)
            self._rollback_append(before, n_rows)
            raise
        self.next_position = max(self.next_position, max(positions) + 1)
        out_logits = out.logits[0]                                                 # (n or 1, V)
        return out_logits if logits == "all" else out_logits[-1]

    @torch.inference_mode()
    def probe_last(self, model, n_copies: int) -> torch.Tensor:
        """Re-run the last live entry as a batch of ``n_copies`` over the other entries; ``(n, V)`` logits.

        The last entry's token is fed again at its ledger position, attending to the first
        ``len - 1`` entries — the computation that produced the current step's logits — with the
        batch dimension expanded to ``n_copies`` (e.g. N Monte-Carlo-dropout passes in one
        forward). This cache is NOT modified: the batch runs on a throwaway ``DynamicCache``
        whose layers are ``expand`` views of this cache's prefix (no copy until the model's own
        append concatenates the new entry); the N new K/V entries die with it. Tensors, ledger,
        live map and ``next_position`` are bit-identical before and after.
        """
        if isinstance(n_copies, bool) or not isinstance(n_copies, int) or n_copies < 1:
            raise ValueError(f"n_copies={n_copies!r} must be a positive int (batch of passes)")
        if not len(self):
            raise ValueError("probe_last needs a non-empty cache (prefill first)")
        row = self.live[-1]
        token, position = self.ledger.token_id[row], self.ledger.position[row]
        tmp = self._prefix_view(len(self) - 1, n_copies)
        device = next(model.parameters()).device
        out = model(input_ids=torch.full((n_copies, 1), token, dtype=torch.long, device=device),  # (n, 1)
                    position_ids=torch.full((n_copies, 1), position, dtype=torch.long, device=device),
                    past_key_values=tmp, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]                                                            # (n, V)

    @classmethod
    def prefill(cls, model, token_ids, *, writer: str, logits: str = "last"):
        """A new cache holding ``token_ids`` at positions 0..n-1; returns ``(cache, logits)``."""
        cache = cls()
        out = cache.forward(model, token_ids, writer=writer, step=-1, logits=logits)
        return cache, out

    @torch.inference_mode()
    def splice_last(self, src: "KVCache", k: int) -> list[int]:
        """Overwrite this cache's last ``k`` entries with ``src``'s last ``k``, on every layer.

        Both caches must hold the same tokens at the same positions there (checked before any
        tensor is touched). The ledger gains ``k`` rows carrying ``src``'s writer and step, and
        the live map points at them. Returns the slots rewritten.
        """
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"k={k!r} must be a non-negative int (entries to splice)")
        if k == 0:
            return []
        if k > len(self) or k > len(src):
            raise ValueError(f"k={k} exceeds cache lengths (this {len(self)}, src {len(src)})")
        mine, theirs = self.live[-k:], src.live[-k:]
        led, sled = self.ledger, src.ledger
        for a, b in zip(mine, theirs):
            if (led.token_id[a], led.position[a]) != (sled.token_id[b], sled.position[b]):
                raise ValueError(f"splice_last: entries differ (token {led.token_id[a]}@{led.position[a]} vs "
                                 f"{sled.token_id[b]}@{sled.position[b]}); both caches must end on the same tokens")
        self._check_geometry(src)
        n = len(self)
        di = list(range(n - k, n))
        si = list(range(len(src) - k, len(src)))
        for i in range(self.num_layers):
            sk, sv = src._read_slots(i, si)                                        # (1, H_kv, k, D)
            self._write_slots(i, di, sk, sv)
        self.live[-k:] = [led.copy_row(sled, b) for b in theirs]
        return list(range(len(self) - k, len(self)))

    @torch.inference_mode()
    def splice_positions(self, src: "KVCache", positions: Sequence[int]) -> list[int]:
        """Overwrite this cache's entries at absolute ``positions`` with ``src``'s entries there.

        Unlike :meth:`splice_last` the caches may end at different points (a refresh splices
        from a teacher cache that is one entry ahead). Both must hold each position with the same
        token (checked before any tensor is touched). The ledger gains one row per position with
        ``src``'s writer and step. Returns the slots rewritten.
        """
        positions = [int(p) for p in positions]
        if not positions:
            return []
        if len(set(positions)) != len(positions):
            raise ValueError("positions must be distinct")
        mine, theirs = _slots_of(self, positions, "this cache"), _slots_of(src, positions, "src")
        led, sled = self.ledger, src.ledger
        for a, b in zip(mine, theirs):
            if led.token_id[self.live[a]] != sled.token_id[src.live[b]]:
                raise ValueError(f"splice_positions: token {led.token_id[self.live[a]]} vs "
                                 f"{sled.token_id[src.live[b]]} at position {led.position[self.live[a]]}; "
                                 "both caches must hold the same tokens there")
        self._check_geometry(src)
        for i in range(self.num_layers):
            sk, sv = src._read_slots(i, theirs)                                    # (1, H_kv, n, D)
            self._write_slots(i, mine, sk, sv)
        for a, b in zip(mine, theirs):
            self.live[a] = led.copy_row(sled, src.live[b])
        return mine

    @torch.inference_mode()
    def append_from(self, src: "KVCache", n: int) -> list[int]:
        """Append ``src``'s entries at positions ``next_position .. next_position + n - 1``.

        The K/V are copied (not recomputed); the ledger rows carry ``src``'s writer, token and
        step, and ``next_position`` advances by ``n``. Returns the new slots.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"n={n!r} must be a positive int (entries to append)")
        positions = list(range(self.next_position, self.next_position + n))
        theirs = _slots_of(src, positions, "src")
        if len(self):
            self._check_geometry(src)
        before, n_rows = len(self.live), len(self.ledger)
        try:
            for i in range(src.num_layers):
                k, v = src._read_slots(i, theirs)                                          # (1, H_kv, n, D)
                if i < len(self._hf.layers) and (_layer_len(self._hf.layers[i]) or self.n_int8):
                    dst = self._hf.layers[i]
                    dst.keys = torch.cat([dst.keys, k.to(dst.keys)], dim=-2)
                    dst.values = torch.cat([dst.values, v.to(dst.values)], dim=-2)
                else:
                    self._hf.update(k.clone(), v.clone(), i)
            self.live += [self.ledger.copy_row(src.ledger, src.live[b]) for b in theirs]
            self._meta_append(n, None)
            self.check()
        except BaseException:
            self._rollback_append(before, n_rows)
            raise
        self.next_position += n
        return list(range(before, len(self)))

    def _check_geometry(self, src: "KVCache") -> None:
        if self.num_layers != src.num_layers:
            raise ValueError(f"src has {src.num_layers} layers, this cache {self.num_layers}")
        for dst, s in zip(self._hf.layers, src._hf.layers):
            if dst.keys.shape[1:2] + dst.keys.shape[3:] != s.keys.shape[1:2] + s.keys.shape[3:]:
                raise ValueError(f"KV geometry differs: {tuple(dst.keys.shape)} vs {tuple(s.keys.shape)}")

    @torch.inference_mode()
    def crop(self, n: int) -> None:
        """Keep the first ``n`` entries (``n >= 0``); ``next_position`` is unchanged."""
        if not isinstance(n, int) or not 0 <= n <= len(self):
            raise ValueError(f"n={n!r} must be an int in [0, {len(self)}]")
        if n < self.n_int8:
            self.dequantize()
        self._truncate_tensors(n)
        del self.live[n:]
        self._meta_keep(list(range(n)))

    @torch.inference_mode()
    def copy(self) -> "KVCache":
        """A deep copy: new tensors, new ledger, new live map."""
        kvs = [(layer.keys.clone(), layer.values.clone()) for layer in self._hf.layers]
        hf = DynamicCache(ddp_cache_data=kvs) if kvs and len(self) else DynamicCache()
        new = KVCache.__new__(KVCache)
        new._hf, new.ledger, new.live, new.next_position = hf, self.ledger.copy(), list(self.live), self.next_position
        new.events, new.ticks = self.events.copy(), self.ticks
        new._int8 = [q.clone() for q in self._int8] if self._int8 is not None else None
        new.attn = {k: t.clone() for k, t in self.attn.items()} if self.attn is not None else None
        new.ema_decay = self.ema_decay
        new.attn_window, new.attn_pool = self.attn_window, self.attn_pool
        new.check()
        return new

    # ------------------------------------------------------------------ surgery (seed 004, "Step 4")

    @torch.inference_mode()
    def apply(self, actions: Sequence[Mapping], model, *, writer: str, step: int = -1,
              splice: str = "gather", fault_hook: Callable[[str], None] | None = None,
              rerotate: bool = False) -> "TickReport":
        """Execute an action list as one tick; tensors and live map are cut by the same layout.

        Actions (every position is a slot of the cache as it is *before* the tick):

        * ``{'action': 'delete', 'pos': s}`` — drop slot ``s``;
        * ``{'action': 'insert', 'pos': s, 'token_ids': [...]}`` — new tokens right before slot
          ``s`` (``s == len(cache)``: at the end, before any ``add``);
        * ``{'action': 'replace_pair', 'original_pos1': p1, 'original_pos2': p2, 'new_token_ids': [...]}``
          — drop ``p1 < p2``, put the new tokens where ``p1`` was (slots between stay, after them);
        * ``{'action': 'add', 'token_id': t}`` — append ``t`` (adds run last, in list order).

        The meaning is the seed's sequential algorithm: actions run in descending slot order
        (at one slot, the removal before the insert), a replace_pair as delete ``p2``, delete
        ``p1``, insert at ``p1``, then the adds. The whole list is validated first
        (:func:`plan_actions`: ranges, ``p1 < p2``, overlapping spans, vocabulary, cache == map
        length); an invalid list raises ``ValueError`` and changes nothing. Because descending
        order never moves a slot left of the current action, every inserted block sees the
        *original* left context ``[0, s)``; so the K/V of all blocks are computed first (reads
        only), then each layer is rebuilt with ONE ``torch.cat`` of kept runs and new blocks
        (``splice="per_row"``: the seed's naive per-row ``torch.cat`` sequence, kept for the
        benchmark), then the adds run as one forward over the edited cache.

        Positions (no-shift): surviving entries keep the RoPE position they were written at —
        nothing is re-rotated, the ledger is never rewritten, so deleting leaves a gap in
        positions. A block inserted at slot ``s`` gets consecutive positions starting right
        after its left neighbour's (``positions[s-1] + 1``; 0 at slot 0); at the end
        (``s == len``) it starts at ``next_position``, exactly where decoding would put it, so
        an insert at the end equals decoding those tokens. Positions of a long interior insert
        may reach or pass those of its right neighbours (RoPE sees only relative distance);
        ``next_position`` becomes ``max(next_position, newest + 1)``, so decoding continues
        above every live position.

        Positions with ``rerotate=True`` (final positions): entries left of the first edited slot
        keep their positions; from the first edit on, every entry of the edited cache gets
        consecutive positions (left neighbour + 1) — new blocks are computed at those final
        positions (over the original left context ``[0, s)``), and surviving right neighbours are
        moved there by rotating their post-RoPE keys by the delta (:meth:`reposition`, one
        operation: keys rotated, new ledger rows, events ``moved``). So an interior insert no
        longer collides with its right neighbour, and a delete closes its gap. ``next_position``
        becomes the last entry's position + 1 before the adds run.

        INT8 entries (:meth:`quantize_older`) are dequantized before the tick; surgery edits a
        full-precision cache. Attention statistics follow their entries (zeros for new ones).

        Failure after validation (OOM, a model error, ``fault_hook``): no VRAM snapshot is
        kept; the live map is reset to its pre-tick content (a list of ints, the mirror) and
        every layer is recomputed from those tokens at their recorded positions, then
        :class:`SurgeryError` is raised. The tick is all-or-nothing; cache and map agree.

        ``fault_hook`` is for tests: it is called with a stage name (``"compute:j"``,
        ``"splice:i"``, ``"map"``, ``"add"``) before each stage; raising there injects a failure.
        Returns a :class:`TickReport` (``logits``: next-token logits after the last ``add``).
        """
        import time

        if splice not in SPLICE_MODES:
            raise ValueError(f"splice={splice!r} must be one of {SPLICE_MODES}")
        if not isinstance(writer, str) or not writer:
            raise ValueError(f"writer={writer!r} must be a non-empty string naming the model that computes new K/V")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step={step!r} must be an int (decode step; -1 for none)")
        try:
            self.check()
        except AssertionError as e:
            raise ValueError(f"cache and live map disagree before the tick ({e}); rebuild the cache first") from e
        geo = self.geometry()
        if geo:
            cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
            if getattr(cfg, "num_hidden_layers", geo["layers"]) != geo["layers"]:
                raise ValueError(f"model has {cfg.num_hidden_layers} layers, the cache {geo['layers']}; surgery needs "
                                 "the model that wrote this cache (or one with the same KV geometry)")
            mdtype = str(next(model.parameters()).dtype)
            if mdtype != geo["dtype"]:
                raise ValueError(f"model dtype {mdtype} differs from the cache's {geo['dtype']}; load the model in "
                                 f"{geo['dtype']}")
        plan = plan_actions(actions, len(self), _vocab_size(model))
        rope = _rope_of(model) if rerotate else None
        if self.n_int8:
            self.dequantize()
        final = self._final_positions(plan) if rerotate else None
        hook = fault_hook if fault_hook is not None else _no_fault
        tick = self.ticks
        self.ticks += 1
        pre_live, pre_next = list(self.live), self.next_position
        t = {"compute": 0.0, "splice": 0.0, "add": 0.0}
        nbytes = 0
        logits = None
        try:
            t0 = time.perf_counter()
            blocks = []                                   # per block: (positions, [(K, V) per layer])
            for j, b in enumerate(plan.blocks):
                hook(f"compute:{j}")
                pos = (final[1][j] if final is not None
                       else self._block_positions(b.anchor, len(b.token_ids), plan.length))
                blocks.append((pos, self._kv_over_prefix(model, b.anchor, b.token_ids, pos)))
            t1 = time.perf_counter()
            if plan.deleted or plan.blocks:
                nbytes = self._splice(plan, blocks, writer, step, tick, hook, splice)
                if final is not None:
                    hook("rerotate")
                    self._reposition(rope, final[0], tick)
            t2 = time.perf_counter()
            if plan.adds:
                hook("add")
                logits = self.forward(model, plan.adds, writer=writer, step=step, logits="last")
                for r in self.live[-len(plan.adds):]:
                    self.events.append(tick, r, "added")
            t3 = time.perf_counter()
            t = {"compute": t1 - t0, "splice": t2 - t1, "add": t3 - t2}
        except BaseException as e:   # incl. KeyboardInterrupt: never leave cache and map out of step
            self._rebuild(model, pre_live, pre_next, writer, step, tick)
            if not isinstance(e, Exception):
                raise
            raise SurgeryError(f"tick {tick} failed ({type(e).__name__}: {e}); the cache was rebuilt from the "
                               f"live map's {len(pre_live)} tokens and the tick discarded") from e
        return TickReport(tick=tick, actions=len(plan.actions), deleted=len(plan.deleted),
                          inserted=sum(len(b.token_ids) for b in plan.blocks), added=len(plan.adds),
                          length=len(self), next_position=self.next_position, splice=splice,
                          splice_bytes=nbytes, compute_s=t["compute"], splice_s=t["splice"], add_s=t["add"],
                          logits=logits)

    def delete(self, pos: int, model, *, writer: str, step: int = -1) -> "TickReport":
        """Drop slot ``pos`` (one-action tick; ``model`` is needed only to rebuild on failure)."""
        return self.apply([{"action": "delete", "pos": pos}], model, writer=writer, step=step)

    def insert(self, pos: int, token_ids: Sequence[int], model, *, writer: str, step: int = -1) -> "TickReport":
        """Insert ``token_ids`` right before slot ``pos``, K/V computed over slots ``[0, pos)``."""
        return self.apply([{"action": "insert", "pos": pos, "token_ids": list(token_ids)}], model,
                          writer=writer, step=step)

    def append(self, token_id: int, model, *, writer: str, step: int = -1) -> "TickReport":
        """Append one token at ``next_position`` (same K/V as a decode step)."""
        return self.apply([{"action": "add", "token_id": token_id}], model, writer=writer, step=step)

    def ledger_status(self) -> list[str]:
        """Status of every ledger row, derived (rows are never edited): ``live`` if in the live map,
        else its last removal event (``deleted``/``replaced``/``superseded``), else ``dropped``."""
        status = ["dropped"] * len(self.ledger)
        for r, ev in zip(self.events.row, self.events.event):
            if ev in _REMOVAL_EVENTS:
                status[r] = _REMOVAL_EVENTS[ev]
        for r in self.live:
            status[r] = "live"
        return status

    def ledger_frame(self):
        """The whole ledger as a DataFrame with a derived ``status`` and the ``origin`` event of each row."""
        import pandas as pd

        led = self.ledger
        origin = ["written"] * len(led)
        for r, ev in zip(self.events.row, self.events.event):
            if ev in _ORIGIN_EVENTS:
                origin[r] = ev
        return pd.DataFrame({"row": range(len(led)), "token_id": led.token_id, "position": led.position,
                             "writer": led.writer, "step": led.step, "origin": origin,
                             "status": self.ledger_status()})

    def _block_positions(self, anchor: int, n: int, length: int) -> list[int]:
        if anchor == length:
            start = self.next_position
        elif anchor == 0:
            start = 0
        else:
            start = self.ledger.position[self.live[anchor - 1]] + 1
        return list(range(start, start + n))

    def _kv_over_prefix(self, model, s: int, token_ids: Sequence[int], positions: list[int]):
        """K/V of ``token_ids`` at ``positions`` attending to slots ``[0, s)``; ``self`` is only read."""
        tmp = self._prefix_view(s)
        device = next(model.parameters()).device
        n = len(token_ids)
        model(input_ids=torch.tensor([list(token_ids)], device=device),               # (1, n)
              position_ids=torch.tensor([positions], device=device),                  # (1, n)
              past_key_values=tmp, use_cache=True, logits_to_keep=1)
        return [(lay.keys[:, :, -n:, :], lay.values[:, :, -n:, :]) for lay in tmp.layers]  # (1, H_kv, n, D)

    def _splice(self, plan: "TickPlan", blocks, writer: str, step: int, tick: int, hook, mode: str) -> int:
        """The coupled edit: every layer's K and V and the live map, by the same plan. Returns bytes written."""
        if not self.num_layers:                       # never written: create empty layers shaped like the blocks
            self._hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in blocks[0][1]])
        nbytes = 0
        if mode == "gather":
            for i, lay in enumerate(self._hf.layers):
                hook(f"splice:{i}")
                for name in ("keys", "values"):
                    old = getattr(lay, name)                                          # (1, H_kv, T, D)
                    parts = [old[:, :, a:b, :] if kind == "old" else blocks[a][1][i][name == "values"]
                             for kind, a, b in plan.layout]
                    new = torch.cat(parts, dim=2) if parts else old[:, :, :0, :]      # (1, H_kv, T', D)
                    setattr(lay, name, new)
                    nbytes += new.numel() * new.element_size()
        else:                                         # the seed's naive sequence: one torch.cat per row op
            for k, (op, slot, j) in enumerate(plan.steps):
                for i, lay in enumerate(self._hf.layers):
                    hook(f"splice:{i}")
                    for name in ("keys", "values"):
                        old = getattr(lay, name)
                        if op == "delete":
                            new = torch.cat([old[:, :, :slot, :], old[:, :, slot + 1:, :]], dim=2)
                        else:
                            blk = blocks[j][1][i][name == "values"]
                            new = torch.cat([old[:, :, :slot, :], blk, old[:, :, slot:, :]], dim=2)
                        setattr(lay, name, new)
                        nbytes += new.numel() * new.element_size()
        hook("map")
        if self.attn is not None:
            idx = plan.apply_to_list(list(range(plan.length)), [[-1] * len(b.token_ids) for b in plan.blocks])
            self._meta_remap(idx)
        new_rows = []
        for b, (pos, _) in zip(plan.blocks, blocks):
            new_rows.append(self.ledger.append(b.token_ids, pos, writer, step))
        removed = {s: self.live[s] for s in plan.deleted}
        self.live = plan.apply_to_list(self.live, new_rows)
        for s in sorted(removed):
            self.events.append(tick, removed[s], plan.deleted[s])
        for b, rows in zip(plan.blocks, new_rows):
            for r in rows:
                self.events.append(tick, r, "inserted" if b.kind == "insert" else "replacement")
        if new_rows:
            self.next_position = max(self.next_position, max(p for pos, _ in blocks for p in pos) + 1)
        self.check()
        return nbytes

    def _rebuild(self, model, live: list[int], next_position: int, writer: str, step: int, tick: int) -> None:
        """Recompute every layer from the tokens of ``live`` at their recorded positions (no snapshot)."""
        led = self.ledger
        tokens = [led.token_id[r] for r in live]
        positions = [led.position[r] for r in live]
        stale = list(dict.fromkeys(live + self.live))
        self._hf, self.live, self.next_position = DynamicCache(), [], next_position
        self._int8 = None
        if self.attn is not None:           # the history of the rebuilt entries is not recoverable: zeros
            self.attn = {k: t[..., :0] for k, t in self.attn.items()}
        if tokens:
            try:
                self.forward(model, tokens, writer=writer, step=step, positions=positions)
            except Exception as e:      # forward rolled itself back: the cache is empty and consistent
                raise SurgeryError(f"tick {tick} failed and so did the rebuild ({type(e).__name__}: {e}); the cache "
                                   f"is now empty; its tokens were {tokens} at positions {positions}") from e
        for r in stale:
            self.events.append(tick, r, "superseded")
        for r in self.live:
            self.events.append(tick, r, "rebuilt")
        self.check()

    # ------------------------------------------------------------------ internals

    def _prefix_view(self, s: int, batch: int = 1) -> DynamicCache:
        """A throwaway DynamicCache over slots ``[0, s)``: views (batch ``expand``-ed), no copy.

        A forward on it appends to the views (the model's own ``cat``), never to this cache.
        """
        if not s or not self.num_layers:
            return DynamicCache()
        full = [self._full_kv(i) for i in range(self.num_layers)]   # views unless INT8 entries exist
        views = [(k[:, :, :s, :].expand(batch, -1, -1, -1),                         # (batch, H_kv, s, D)
                  v[:, :, :s, :].expand(batch, -1, -1, -1)) for k, v in full]
        tmp = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in views])
        for lay, (k, v) in zip(tmp.layers, views):
            lay.keys, lay.values = k, v
        return tmp

    def _rollback_append(self, length: int, n_rows: int) -> None:
        """Undo a failed append: back to ``length`` entries and ``n_rows`` ledger rows (rows no one saw)."""
        self._truncate_tensors(length)
        self.ledger.truncate(n_rows)
        del self.live[length:]
        if self.attn is not None:
            self.attn = {k: t[..., :length] for k, t in self.attn.items()}

    def _truncate_tensors(self, n: int) -> None:
        n = n - self.n_int8                  # FP tail length (callers dequantize first if n < n_int8)
        for layer in self._hf.layers:
            if _layer_len(layer) > n:
                layer.keys = layer.keys[:, :, :n, :]
                layer.values = layer.values[:, :, :n, :]

    # ------------------------------------------------------------------ eviction (issue 9)

    def track_attention(self, ema_decay: float = 0.9, *, window: int | None = None, pool: int = 1) -> None:
        """Start keeping per-entry attention statistics (``attn``), updated by every
        ``forward(..., attention=True)`` and carried through every edit:

        * ``attn["acc"]`` (L, T): accumulated mass ``Σ_steps mass`` (H2O),
        * ``attn["ema"]`` (L, T): ``ema ← β·ema + (1-β)·mass`` with ``β = ema_decay`` (Conf-KV),
        * ``attn["count"]`` (T,): the entry's lifetime in measured queries — how many measured
          queries could attend to it (NORM_SUM's denominator, as OpenVINO GenAI counts it: a
          prefill of L tokens registers L, L-1, …, 1; each decode step adds 1 to every entry).

        ``window`` (SnapKV's observation window, seed 003 ``snapkv_window_size``): only the last
        ``window`` queries of a multi-token forward contribute mass (and count); ``None`` = all.
        ``pool``: each forward's mass is max-pooled over the entry and the ``pool - 1`` entries after
        it (``mass_j ← max(mass_j … mass_{j+pool-1})``, OpenVINO's ``_max_pool``) before it is folded in.

        Entries present before tracking starts, or written by a forward without
        ``attention=True``, start at 0. Idempotent for the same settings."""
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay!r} must be in [0, 1)")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r} must be None (every query) or an int >= 1 (the last queries)")
        if isinstance(pool, bool) or not isinstance(pool, int) or pool < 1:
            raise ValueError(f"pool={pool!r} must be an int >= 1 (1: no pooling)")
        if self.attn is not None:
            if (self.ema_decay, self.attn_window, self.attn_pool) != (float(ema_decay), window, pool):
                raise ValueError(f"attention is already tracked with ema_decay={self.ema_decay}, "
                                 f"window={self.attn_window}, pool={self.attn_pool}")
            return
        dev = self._hf.layers[0].keys.device if len(self) else torch.device("cpu")
        n, layers = len(self), self.num_layers
        self.attn = {"acc": torch.zeros(layers, n, device=dev), "ema": torch.zeros(layers, n, device=dev),
                     "count": torch.zeros(n, device=dev)}
        self.ema_decay = float(ema_decay)
        self.attn_window, self.attn_pool = window, pool

    def attention_stats(self) -> dict[str, torch.Tensor] | None:
        """Copies of the attention statistics (None when not tracked), for policies."""
        return None if self.attn is None else {k: t.detach().clone() for k, t in self.attn.items()}

    def slots_at(self, positions: Sequence[int]) -> dict[int, int]:
        """``{position: slot}`` for those of ``positions`` that exactly one live slot holds (evicted
        ones are absent; so are positions an interior insert made ambiguous, which position-addressed
        edits refuse)."""
        pos = self.ledger.position
        where: dict[int, int] = {}
        seen: set[int] = set()
        for s, r in enumerate(self.live):
            p = pos[r]
            if p in seen:
                where.pop(p, None)
            else:
                seen.add(p)
                where[p] = s
        return {int(p): where[int(p)] for p in positions if int(p) in where}

    @torch.inference_mode()
    def evict(self, slots: Sequence[int], *, model=None, rerotate: bool = False) -> "EvictReport":
        """Remove the entries at ``slots`` from every layer, the live map and the attention
        statistics, in one call; log ``evicted`` for their ledger rows.

        Survivors keep their absolute positions (the decode loop passes explicit
        ``position_ids``, so RoPE distances stay right) unless ``rerotate=True`` (needs
        ``model`` for its RoPE): then survivors move to consecutive positions from the first
        slot's position on (:meth:`reposition`), like seed 003's ``apply_rotation``, and
        ``next_position`` becomes the last position + 1. Validation (ints, distinct, in range)
        happens before any tensor is touched; the new tensors of every layer are built first and
        swapped in together, so an error leaves the cache as it was.
        """
        import time

        n = len(self)
        slots = list(slots)
        for s in slots:
            if isinstance(s, bool) or not hasattr(s, "__index__"):
                raise ValueError(f"slots holds {s!r}; slots must be ints")
        slots = sorted(int(s) for s in slots)
        if len(set(slots)) != len(slots):
            raise ValueError("slots must be distinct")
        if slots and (slots[0] < 0 or slots[-1] >= n):
            raise ValueError(f"slots must lie in [0, {n}); got {slots[0]}..{slots[-1]}")
        if rerotate and model is None:
            raise ValueError("rerotate=True needs model= (its rotary embedding gives the rotation)")
        rope = _rope_of(model) if rerotate else None
        t0 = time.perf_counter()
        if not slots:
            return EvictReport(0, 0, n, 0.0, 0.0)
        if rerotate and self.n_int8:
            self.dequantize()
        nq = self.n_int8
        dev = self._hf.layers[0].keys.device
        mask = torch.ones(n, dtype=torch.bool)
        mask[torch.tensor(slots, dtype=torch.long)] = False
        keep_t = mask.nonzero().squeeze(1)                                          # (T',) kept slots
        iq = keep_t[keep_t < nq].to(dev)
        it = (keep_t[keep_t >= nq] - nq).to(dev)
        new_fp = [(lay.keys.index_select(2, it), lay.values.index_select(2, it)) for lay in self._hf.layers]
        new_q = [q.gather(iq) for q in self._int8] if self._int8 is not None else None
        # swap (no failure point below but the ledger's pure-Python bookkeeping)
        for lay, (k, v) in zip(self._hf.layers, new_fp):
            lay.keys, lay.values = k, v
        self._int8 = new_q
        removed = [self.live[s] for s in slots]
        self.live = [r for r, k in zip(self.live, mask.tolist()) if k]
        self._meta_keep(keep_t)
        tick = self.ticks
        self.ticks += 1
        for r in removed:
            self.events.append(tick, r, "evicted")
        t1 = time.perf_counter()
        moved = 0
        if rerotate and self.live:
            p0 = self.ledger.position[self.live[0]]
            moved = self._reposition(rope, list(range(p0, p0 + len(self.live))), tick)
        self.check()
        return EvictReport(len(slots), moved, len(self), t1 - t0, time.perf_counter() - t1)

    @torch.inference_mode()
    def reposition(self, model, positions: Sequence[int]) -> int:
        """Move every live entry to ``positions`` (one per slot) by rotating its post-RoPE key by
        ``new - old`` (:mod:`.rope`, the model's rotary config). Values are untouched. Moved entries
        get new ledger rows (token, writer, step copied; new position) and events ``moved``; the
        old rows' status becomes ``moved``. ``next_position`` becomes ``max(positions) + 1``.
        Returns how many entries moved. Positions must be distinct ints."""
        positions = [int(p) for p in positions]
        if len(positions) != len(self):
            raise ValueError(f"positions has {len(positions)} entries for {len(self)} slots")
        if len(set(positions)) != len(positions) or (positions and min(positions) < 0):
            raise ValueError("positions must be distinct non-negative ints")
        rope = _rope_of(model)
        if self.n_int8:
            self.dequantize()
        tick = self.ticks
        self.ticks += 1
        moved = self._reposition(rope, positions, tick)
        self.check()
        return moved

    def _reposition(self, rope, positions: list[int], tick: int) -> int:
        led = self.ledger
        old = [led.position[r] for r in self.live]
        slots = [s for s, (a, b) in enumerate(zip(old, positions)) if a != b]
        if slots:
            dev = self._hf.layers[0].keys.device
            idx = torch.tensor(slots, dtype=torch.long, device=dev)
            delta = torch.tensor([positions[s] - old[s] for s in slots], dtype=torch.long, device=dev)
            new_keys = [rope.rotate(lay.keys[:, :, idx, :], delta) for lay in self._hf.layers]  # (1, H_kv, m, D)
            for lay, k in zip(self._hf.layers, new_keys):
                lay.keys = lay.keys.clone()
                lay.keys[:, :, idx, :] = k
            for s in slots:
                r = self.live[s]
                new = led.append([led.token_id[r]], [positions[s]], led.writer[r], led.step[r])[0]
                self.events.append(tick, r, "moved")
                self.events.append(tick, new, "moved_to")
                self.live[s] = new
        if positions:
            self.next_position = max(positions) + 1
        return len(slots)

    def _final_positions(self, plan: "TickPlan") -> tuple[list[int], list[list[int]]]:
        """Final positions for a rerotating tick: per slot of the edited cache (before adds), per block."""
        pos = self.positions
        out: list[int] = []
        per_block: dict[int, list[int]] = {}
        shifted, expected = False, 0
        for kind, a, b in plan.layout:
            if kind == "old":
                if not shifted and a == expected:
                    out.extend(pos[a:b])
                    expected = b
                    continue
                shifted = True
                n = b - a
            else:
                shifted = True
                n = len(plan.blocks[a].token_ids)
            start = out[-1] + 1 if out else 0
            new = list(range(start, start + n))
            out.extend(new)
            if kind == "new":
                per_block[a] = new
        return out, [per_block[j] for j in range(len(plan.blocks))]

    # ------------------------------------------------------------------ INT8 storage

    @torch.inference_mode()
    def quantize_older(self, window: int, group: int = 64) -> int:
        """Move every FP entry older than the newest ``window`` entries to INT8 (:mod:`.int8`),
        once at least ``group`` of them are waiting (they form one scale group). Returns how
        many entries were quantized (0 if fewer than ``group`` wait)."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an int >= 1 (newest entries kept in FP)")
        if isinstance(group, bool) or not isinstance(group, int) or group < 1:
            raise ValueError(f"group={group!r} must be an int >= 1 (entries per scale group)")
        m = len(self) - self.n_int8 - window
        if m < group:
            return 0
        new_q = []
        for i, lay in enumerate(self._hf.layers):
            base = self._int8[i] if self._int8 is not None else Int8Layer.empty_like(lay.keys)
            new_q.append(base.append_group(lay.keys[:, :, :m, :], lay.values[:, :, :m, :]))
        new_fp = [(lay.keys[:, :, m:, :].clone(), lay.values[:, :, m:, :].clone()) for lay in self._hf.layers]
        for lay, (k, v) in zip(self._hf.layers, new_fp):
            lay.keys, lay.values = k, v
        self._int8 = new_q
        self.check()
        return m

    @torch.inference_mode()
    def dequantize(self) -> None:
        """Turn every INT8 entry back into an FP entry (values as dequantized)."""
        if not self.n_int8:
            self._int8 = None
            return
        self._prepend_int8()
        self._int8 = None
        self.check()

    def _materialize(self) -> None:
        """Put the dequantized INT8 prefix in front of every layer's FP tail (for one forward)."""
        if not self.n_int8:
            return
        self._prepend_int8()
        self._materialized = True

    def _prepend_int8(self) -> None:
        """Put every layer's dequantized INT8 entries in front of its FP entries (``(1, H_kv, T, D)``)."""
        for q, lay in zip(self._int8, self._hf.layers):
            k, v = q.dequant(lay.keys.dtype)
            lay.keys = torch.cat([k, lay.keys], dim=2)
            lay.values = torch.cat([v, lay.values], dim=2)

    def _dematerialize(self, nq: int) -> None:
        """Drop the materialized prefix again (a no-op unless :meth:`_materialize` ran)."""
        if not getattr(self, "_materialized", False):
            return
        for lay in self._hf.layers:
            lay.keys = lay.keys[:, :, nq:, :].clone()
            lay.values = lay.values[:, :, nq:, :].clone()
        self._materialized = False

    def _full_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self._hf.layers[i]
        if not self.n_int8:
            return lay.keys, lay.values
        k, v = self._int8[i].dequant(lay.keys.dtype)
        return torch.cat([k, lay.keys], dim=2), torch.cat([v, lay.values], dim=2)

    def _read_slots(self, i: int, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of layer ``i`` at ``slots``, each (1, H_kv, n, D), INT8 dequantized."""
        nq, lay = self.n_int8, self._hf.layers[i]
        if not nq:
            idx = torch.tensor(list(slots), dtype=torch.long, device=lay.keys.device)
            return lay.keys[:, :, idx, :], lay.values[:, :, idx, :]
        k, v = self._full_kv(i)
        idx = torch.tensor(list(slots), dtype=torch.long, device=k.device)
        return k[:, :, idx, :], v[:, :, idx, :]

    def _write_slots(self, i: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite layer ``i``'s ``slots`` with ``k, v`` (1, H_kv, n, D); INT8 slots are quantized
        with their group's scales."""
        nq, lay = self.n_int8, self._hf.layers[i]
        slots = list(slots)
        dev = lay.keys.device
        q_pick = [j for j, s in enumerate(slots) if s < nq]
        t_pick = [j for j, s in enumerate(slots) if s >= nq]
        if t_pick:
            src = torch.tensor(t_pick, dtype=torch.long, device=dev)
            dst = torch.tensor([slots[j] - nq for j in t_pick], dtype=torch.long, device=dev)
            lay.keys[:, :, dst, :] = k[:, :, src.to(k.device), :].to(lay.keys)
            lay.values[:, :, dst, :] = v[:, :, src.to(v.device), :].to(lay.values)
        if q_pick:
            src = torch.tensor(q_pick, dtype=torch.long, device=k.device)
            dst = torch.tensor([slots[j] for j in q_pick], dtype=torch.long, device=dev)
            self._int8[i].write(dst, k[:, :, src, :].to(dev), v[:, :, src, :].to(dev))

    def _meta_append(self, n: int, mass: torch.Tensor | None) -> None:
        if self.attn is None:
            return
        a = self.attn
        dev = a["acc"].device
        layers = self.num_layers
        if a["acc"].shape[0] != layers:        # tracking started on an empty cache
            a["acc"] = torch.zeros(layers, a["acc"].shape[1], device=dev)
            a["ema"] = torch.zeros(layers, a["ema"].shape[1], device=dev)
        acc = torch.cat([a["acc"], torch.zeros(layers, n, device=dev)], dim=1)
        ema = torch.cat([a["ema"], torch.zeros(layers, n, device=dev)], dim=1)
        count = torch.cat([a["count"], torch.zeros(n, device=dev)])
        if mass is not None:
            mass = mass.to(dev)
            acc = acc + mass
            ema = self.ema_decay * ema + (1.0 - self.ema_decay) * mass
            count = count + lifetime_increment(count.shape[0], n, self.attn_window).to(dev)
        self.attn = {"acc": acc, "ema": ema, "count": count}

    def _meta_keep(self, keep: Sequence[int]) -> None:
        if self.attn is None:
            return
        dev = self.attn["count"].device
        idx = keep.to(dev) if isinstance(keep, torch.Tensor) else torch.tensor(list(keep), dtype=torch.long, device=dev)
        self.attn = {k: t.index_select(t.dim() - 1, idx) for k, t in self.attn.items()}

    def _meta_remap(self, idx: Sequence[int]) -> None:
        """Stats for a new slot order: ``idx[s]`` = old slot, or -1 for a new entry (zeros)."""
        if self.attn is None:
            return
        dev = self.attn["count"].device
        src = torch.tensor([max(i, 0) for i in idx], dtype=torch.long, device=dev)
        new = torch.tensor([i < 0 for i in idx], dtype=torch.bool, device=dev)
        self.attn = {k: t[..., src].masked_fill(new, 0.0) for k, t in self.attn.items()}


def lifetime_increment(t: int, n: int, window: int | None) -> torch.Tensor:
    """``(t,)``: how many of a forward's measured queries see each entry — the last ``n`` of the
    ``t`` entries are the forward's own tokens (causal: new token ``i`` is seen by ``n - i``
    queries), only the last ``window`` queries are measured (``None``: all)."""
    w = n if window is None else min(window, n)
    inc = torch.full((t,), float(w))
    inc[t - n:] = torch.clamp(torch.arange(n, 0, -1, dtype=torch.float32), max=float(w))
    return inc


def max_pool_next(mass: torch.Tensor, pool: int) -> torch.Tensor:
    """``(L, T)`` → ``(L, T)``: ``out_j = max(mass_j … mass_{j+pool-1})`` (the window is cut at the end)."""
    if pool <= 1 or mass.shape[-1] == 0:
        return mass
    padded = torch.nn.functional.pad(mass.unsqueeze(1), (0, pool - 1), value=float("-inf"))  # (L, 1, T+pool-1)
    return torch.nn.functional.max_pool1d(padded, pool, stride=1).squeeze(1)


@dataclass(frozen=True)
class EvictReport:
    """What one :meth:`KVCache.evict` did: entries removed, entries re-rotated, length after,
    seconds spent compacting (gather of every layer + mirror) and re-rotating."""

    evicted: int
    moved: int
    length: int
    compact_s: float
    rotate_s: float


def _rope_of(model):
    from .rope import rope_of

    return rope_of(model)


def _layer_len(layer) -> int:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.dim() != 4:
        return 0
    return int(keys.shape[-2])


def _vocab_size(model) -> int:
    return int(model.get_input_embeddings().weight.shape[0])


def _no_fault(stage: str) -> None:
    return None


def _slots_of(cache: KVCache, positions: Sequence[int], name: str) -> list[int]:
    """Live slots holding each absolute position.

    ValueError naming the first position that no live slot holds, or that several hold: an
    interior ``insert`` may give new entries positions its right neighbours already have (see
    :meth:`KVCache.apply`), and then "the entry at position p" is ambiguous — rather than pick one
    slot silently, position-addressed edits (``splice_positions``, ``append_from``) refuse.
    """
    pos = cache.ledger.position
    where: dict[int, list[int]] = {}
    for s, r in enumerate(cache.live):
        where.setdefault(pos[r], []).append(s)
    out = []
    for p in positions:
        slots = where.get(p)
        if not slots:
            raise ValueError(f"{name} holds no entry at position {p}")
        if len(slots) > 1:
            raise ValueError(f"{name} holds {len(slots)} entries at position {p} (slots {slots}), e.g. after an "
                             "interior insert reused its right neighbours' positions; a position-addressed edit is "
                             "ambiguous there — address entries by slot (splice_last) or rebuild the cache")
        out.append(slots[0])
    return out
