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
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

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
        self.events = EventLog()   # append-only surgery history (see ledger_status)
        self.ticks = 0             # surgery ticks attempted
        self.check()

    # ------------------------------------------------------------------ introspection

    def __len__(self) -> int:
        return len(self.live)

    @property
    def num_layers(self) -> int:
        return len(self._hf.layers)

    def layer_lengths(self) -> list[int]:
        return [_layer_len(layer) for layer in self._hf.layers]

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
            n = _layer_len(layer)
            if n != len(self.live):
                raise AssertionError(f"cache/ledger out of step: layer {i} holds {n} entries, live map {len(self.live)}")
            if n and layer.keys.shape[0] != 1:
                raise AssertionError(f"layer {i} has batch {layer.keys.shape[0]}; KVCache holds one sequence")
        if self.live and (min(self.live) < 0 or max(self.live) >= len(self.ledger)):
            raise AssertionError("live map points outside the ledger")

    def nbytes(self) -> int:
        """Bytes held by K and V tensors over all layers."""
        total = 0
        for layer in self._hf.layers:
            if _layer_len(layer):
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total

    def geometry(self) -> dict:
        """Layers, KV heads, head dim, dtype of the stored tensors (empty dict before the first write)."""
        layers = [layer for layer in self._hf.layers if _layer_len(layer)]
        if not layers:
            return {}
        b, h, _, d = layers[0].keys.shape  # (B, H_kv, T, D)
        return {"layers": len(self._hf.layers), "kv_heads": h, "head_dim": d, "dtype": str(layers[0].keys.dtype)}

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only copies of one layer's (keys, values), each (B, H_kv, T, D), for analysis."""
        lay = self._hf.layers[layer]
        return lay.keys.detach().clone(), lay.values.detach().clone()

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
                positions: Sequence[int] | None = None, logits: str = "last") -> torch.Tensor:
        """Run ``model`` on ``token_ids`` over this cache, appending their K/V (prefill or decode step).

        Positions default to ``next_position, next_position+1, …`` and are passed explicitly as
        ``position_ids``. Returns logits ``(n, V)`` for ``logits="all"`` or ``(V,)`` for ``"last"``.
        On error the cache and ledger are rolled back to their state before the call.
        """
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
        try:
            out = model(input_ids=ids.to(device).view(1, n),                       # (1, n)
                        position_ids=torch.tensor([positions], device=device),     # (1, n)
                        past_key_values=self._hf, use_cache=True,
                        logits_to_keep=0 if logits == "all" else 1)
            rows = self.ledger.append(ids.tolist(), positions, writer, step)
            self.live.extend(rows)
            self.check()
        except BaseException:
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
        for dst, s in zip(self._hf.layers, src._hf.layers):
            dst.keys[:, :, -k:, :] = s.keys[:, :, -k:, :].to(dst.keys.dtype)      # (1, H_kv, k, D)
            dst.values[:, :, -k:, :] = s.values[:, :, -k:, :].to(dst.values.dtype)
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
        di = torch.tensor(mine)
        si = torch.tensor(theirs)
        for dst, s in zip(self._hf.layers, src._hf.layers):
            dst.keys[:, :, di, :] = s.keys[:, :, si.to(s.keys.device), :].to(dst.keys)   # (1, H_kv, n, D)
            dst.values[:, :, di, :] = s.values[:, :, si.to(s.values.device), :].to(dst.values)
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
        si = torch.tensor(theirs)
        before, n_rows = len(self.live), len(self.ledger)
        try:
            for i, s in enumerate(src._hf.layers):
                k = s.keys[:, :, si.to(s.keys.device), :]                                   # (1, H_kv, n, D)
                v = s.values[:, :, si.to(s.values.device), :]
                if i < len(self._hf.layers) and _layer_len(self._hf.layers[i]):
                    dst = self._hf.layers[i]
                    dst.keys = torch.cat([dst.keys, k.to(dst.keys)], dim=-2)
                    dst.values = torch.cat([dst.values, v.to(dst.values)], dim=-2)
                else:
                    self._hf.update(k.clone(), v.clone(), i)
            self.live += [self.ledger.copy_row(src.ledger, src.live[b]) for b in theirs]
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
        self._truncate_tensors(n)
        del self.live[n:]

    @torch.inference_mode()
    def copy(self) -> "KVCache":
        """A deep copy: new tensors, new ledger, new live map."""
        kvs = [(layer.keys.clone(), layer.values.clone()) for layer in self._hf.layers]
        hf = DynamicCache(ddp_cache_data=kvs) if kvs and len(self) else DynamicCache()
        new = KVCache(hf, self.ledger.copy(), list(self.live), self.next_position)
        new.events, new.ticks = self.events.copy(), self.ticks
        return new

    # ------------------------------------------------------------------ surgery (seed 004, "Step 4")

    @torch.inference_mode()
    def apply(self, actions: Sequence[Mapping], model, *, writer: str, step: int = -1,
              splice: str = "gather", fault_hook: Callable[[str], None] | None = None) -> "TickReport":
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
                pos = self._block_positions(b.anchor, len(b.token_ids), plan.length)
                blocks.append((pos, self._kv_over_prefix(model, b.anchor, b.token_ids, pos)))
            t1 = time.perf_counter()
            if plan.deleted or plan.blocks:
                nbytes = self._splice(plan, blocks, writer, step, tick, hook, splice)
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
        views = [(lay.keys[:, :, :s, :].expand(batch, -1, -1, -1),                 # (batch, H_kv, s, D)
                  lay.values[:, :, :s, :].expand(batch, -1, -1, -1)) for lay in self._hf.layers]
        tmp = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in views])
        for lay, (k, v) in zip(tmp.layers, views):
            lay.keys, lay.values = k, v
        return tmp

    def _rollback_append(self, length: int, n_rows: int) -> None:
        """Undo a failed append: back to ``length`` entries and ``n_rows`` ledger rows (rows no one saw)."""
        self._truncate_tensors(length)
        self.ledger.truncate(n_rows)
        del self.live[length:]

    def _truncate_tensors(self, n: int) -> None:
        for layer in self._hf.layers:
            if _layer_len(layer) > n:
                layer.keys = layer.keys[:, :, :n, :]
                layer.values = layer.values[:, :, :n, :]


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
