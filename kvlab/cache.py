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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass(frozen=True)
class Row:
    """One ledger row: a K/V entry as written."""

    index: int       # ledger row number
    token_id: int
    position: int    # absolute RoPE position the K/V was computed at
    writer: str      # which model wrote it ("teacher", "student", ...)
    step: int        # decode step at which it was written (-1: prompt prefill)


class Ledger:
    """Append-only record of every cache entry ever written (columnar, for speed)."""

    __slots__ = ("token_id", "position", "writer", "step")

    def __init__(self):
        self.token_id: list[int] = []
        self.position: list[int] = []
        self.writer: list[str] = []
        self.step: list[int] = []

    def __len__(self) -> int:
        return len(self.token_id)

    def append(self, token_ids: Sequence[int], positions: Sequence[int], writer: str, step: int) -> list[int]:
        start = len(self.token_id)
        self.token_id.extend(int(t) for t in token_ids)
        self.position.extend(int(p) for p in positions)
        self.writer.extend([writer] * len(token_ids))
        self.step.extend([int(step)] * len(token_ids))
        return list(range(start, len(self.token_id)))

    def truncate(self, n: int) -> None:
        """Roll back rows appended by a call that failed (only ever used for rows no one saw)."""
        for col in (self.token_id, self.position, self.writer, self.step):
            del col[n:]

    def row(self, i: int) -> Row:
        return Row(i, self.token_id[i], self.position[i], self.writer[i], self.step[i])

    def copy(self) -> "Ledger":
        new = Ledger()
        for name in self.__slots__:
            setattr(new, name, list(getattr(self, name)))
        return new


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
            self._truncate_tensors(before)
            self.ledger.truncate(n_rows)
            del self.live[before:]
            raise
        self.next_position = max(self.next_position, max(positions) + 1)
        out_logits = out.logits[0]                                                 # (n or 1, V)
        return out_logits if logits == "all" else out_logits[-1]

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
        if self.num_layers != src.num_layers:
            raise ValueError(f"src has {src.num_layers} layers, this cache {self.num_layers}")
        mine, theirs = self.live[-k:], src.live[-k:]
        led, sled = self.ledger, src.ledger
        for a, b in zip(mine, theirs):
            if (led.token_id[a], led.position[a]) != (sled.token_id[b], sled.position[b]):
                raise ValueError(f"splice_last: entries differ (token {led.token_id[a]}@{led.position[a]} vs "
                                 f"{sled.token_id[b]}@{sled.position[b]}); both caches must end on the same tokens")
        for dst, s in zip(self._hf.layers, src._hf.layers):
            if dst.keys.shape[1:2] + dst.keys.shape[3:] != s.keys.shape[1:2] + s.keys.shape[3:]:
                raise ValueError(f"KV geometry differs: {tuple(dst.keys.shape)} vs {tuple(s.keys.shape)}")
        for dst, s in zip(self._hf.layers, src._hf.layers):
            dst.keys[:, :, -k:, :] = s.keys[:, :, -k:, :].to(dst.keys.dtype)      # (1, H_kv, k, D)
            dst.values[:, :, -k:, :] = s.values[:, :, -k:, :].to(dst.values.dtype)
        new_rows = []
        for b in theirs:
            new_rows += led.append([sled.token_id[b]], [sled.position[b]], sled.writer[b], sled.step[b])
        self.live[-k:] = new_rows
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
            r = src.live[b]
            self.live[a] = led.append([sled.token_id[r]], [sled.position[r]], sled.writer[r], sled.step[r])[0]
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
            for b in theirs:
                r = src.live[b]
                self.live += self.ledger.append([src.ledger.token_id[r]], [src.ledger.position[r]],
                                                src.ledger.writer[r], src.ledger.step[r])
            self.check()
        except BaseException:
            self._truncate_tensors(before)
            self.ledger.truncate(n_rows)
            del self.live[before:]
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
        return KVCache(hf, self.ledger.copy(), list(self.live), self.next_position)

    # ------------------------------------------------------------------ internals

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


def _slots_of(cache: KVCache, positions: Sequence[int], name: str) -> list[int]:
    """Live slots holding each absolute position (ValueError naming the first one missing)."""
    pos = cache.ledger.position
    where = {pos[r]: s for s, r in enumerate(cache.live)}
    out = []
    for p in positions:
        if p not in where:
            raise ValueError(f"{name} holds no entry at position {p}")
        out.append(where[p])
    return out
