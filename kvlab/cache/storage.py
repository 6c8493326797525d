"""K/V storage of a :class:`~kvlab.cache.KVCache`: per layer, full-precision tensors plus INT8 entries.

Each layer holds its entries in slot order: the oldest ``n_int8`` of them in an :class:`Int8Layer`
(:mod:`.int8`), the rest as full-precision ``(1, H_kv, T, D)`` tensors (keys post-RoPE) in a
transformers ``DynamicCache`` that the model appends to during a forward. :class:`Storage` is the
only object that reads or writes those tensors; it knows nothing about tokens or positions (that
is the mirror's job, :mod:`.mirror`): every method addresses entries by slot.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .int8 import Int8Layer


def _layer_len(layer) -> int:
    keys = getattr(layer, "keys", None)
    if keys is None or not getattr(layer, "is_initialized", True) or keys.dim() != 4:
        return 0
    return int(keys.shape[-2])


class Storage:
    """Per-layer K/V: FP tensors in ``hf`` (a ``DynamicCache``) after INT8 entries in ``int8``."""

    def __init__(self, hf: DynamicCache | None = None, int8: list[Int8Layer] | None = None):
        self.hf = hf if hf is not None else DynamicCache()
        self.int8 = int8                  # the oldest n_int8 slots of every layer, INT8 (or None)
        self._materialized = False

    # ------------------------------------------------------------------ sizes

    @property
    def num_layers(self) -> int:
        return len(self.hf.layers)

    @property
    def n_int8(self) -> int:
        """Entries (the oldest slots, same on every layer) held in INT8 storage."""
        return len(self.int8[0]) if self.int8 else 0

    def layer_lengths(self) -> list[int]:
        return [self.n_int8 + _layer_len(layer) for layer in self.hf.layers]

    def check(self, n: int) -> None:
        """Every layer holds exactly ``n`` entries, batch 1, full-attention ``DynamicLayer`` s."""
        for i, layer in enumerate(self.hf.layers):
            if not isinstance(layer, DynamicLayer) or type(layer).__name__ != "DynamicLayer":
                raise TypeError(f"layer {i} is {type(layer).__name__}; kvlab supports full-attention "
                                "DynamicLayer caches only")
            m = self.n_int8 + _layer_len(layer)
            if m != n:
                raise AssertionError(f"cache/ledger out of step: layer {i} holds {m} entries, live map {n}")
            if m and layer.keys.shape[0] != 1:
                raise AssertionError(f"layer {i} has batch {layer.keys.shape[0]}; KVCache holds one sequence")
        if self.int8 is not None and any(len(q) != self.n_int8 for q in self.int8):
            raise AssertionError("INT8 stores of the layers hold different numbers of entries")

    def nbytes(self) -> int:
        """Real bytes of K/V over all layers: FP tensors at their dtype plus INT8 entries with scales and group ids."""
        total = 0
        for layer in self.hf.layers:
            if _layer_len(layer):
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        for q in self.int8 or ():
            total += q.nbytes()
        return total

    def geometry(self) -> dict:
        """Layers, KV heads, head dim, dtype of the stored tensors (empty dict before the first write)."""
        if not self.num_layers:
            return {}
        keys = self.hf.layers[0].keys
        b, h, _, d = keys.shape  # (B, H_kv, T, D)
        return {"layers": self.num_layers, "kv_heads": h, "head_dim": d, "dtype": str(keys.dtype)}

    @property
    def device(self) -> torch.device:
        return self.hf.layers[0].keys.device

    def check_geometry(self, src: "Storage") -> None:
        if self.num_layers != src.num_layers:
            raise ValueError(f"src has {src.num_layers} layers, this cache {self.num_layers}")
        for dst, s in zip(self.hf.layers, src.hf.layers):
            if dst.keys.shape[1:2] + dst.keys.shape[3:] != s.keys.shape[1:2] + s.keys.shape[3:]:
                raise ValueError(f"KV geometry differs: {tuple(dst.keys.shape)} vs {tuple(s.keys.shape)}")

    # ------------------------------------------------------------------ reads

    def full_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (keys, values), each (1, H_kv, T, D), INT8 entries dequantized (views if none)."""
        lay = self.hf.layers[i]
        if not self.n_int8:
            return lay.keys, lay.values
        k, v = self.int8[i].dequant(lay.keys.dtype)
        return torch.cat([k, lay.keys], dim=2), torch.cat([v, lay.values], dim=2)

    def read_slots(self, i: int, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of layer ``i`` at ``slots``, each (1, H_kv, n, D), INT8 dequantized."""
        k, v = self.full_kv(i)
        idx = torch.tensor(list(slots), dtype=torch.long, device=k.device)
        return k[:, :, idx, :], v[:, :, idx, :]

    def prefix_view(self, s: int, batch: int = 1) -> DynamicCache:
        """A throwaway DynamicCache over slots ``[0, s)``: views (batch ``expand``-ed), no copy.

        A forward on it appends to the views (the model's own ``cat``), never to this storage.
        """
        if not s or not self.num_layers:
            return DynamicCache()
        full = [self.full_kv(i) for i in range(self.num_layers)]   # views unless INT8 entries exist
        views = [(k[:, :, :s, :].expand(batch, -1, -1, -1),                         # (batch, H_kv, s, D)
                  v[:, :, :s, :].expand(batch, -1, -1, -1)) for k, v in full]
        tmp = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in views])
        for lay, (k, v) in zip(tmp.layers, views):
            lay.keys, lay.values = k, v
        return tmp

    # ------------------------------------------------------------------ writes

    def write_slots(self, i: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite layer ``i``'s ``slots`` with ``k, v`` (1, H_kv, n, D); INT8 slots are quantized
        with their group's scales."""
        nq, lay = self.n_int8, self.hf.layers[i]
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
            self.int8[i].write(dst, k[:, :, src, :].to(dev), v[:, :, src, :].to(dev))

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v`` (1, H_kv, n, D) after layer ``i``'s last entry (creating the layer if new)."""
        if i < self.num_layers and (_layer_len(self.hf.layers[i]) or self.n_int8):
            dst = self.hf.layers[i]
            dst.keys = torch.cat([dst.keys, k.to(dst.keys)], dim=-2)
            dst.values = torch.cat([dst.values, v.to(dst.values)], dim=-2)
        else:
            self.hf.update(k.clone(), v.clone(), i)

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` entries of every layer (callers dequantize first if ``n < n_int8``)."""
        n = n - self.n_int8                  # FP tail length
        for layer in self.hf.layers:
            if _layer_len(layer) > n:
                layer.keys = layer.keys[:, :, :n, :]
                layer.values = layer.values[:, :, :n, :]

    def keep(self, keep_t: torch.Tensor) -> None:
        """Keep only slots ``keep_t`` (sorted, (T',)) on every layer. New tensors of every layer are
        built first and swapped in together, so an error leaves the storage as it was."""
        nq = self.n_int8
        dev = self.device
        iq = keep_t[keep_t < nq].to(dev)
        it = (keep_t[keep_t >= nq] - nq).to(dev)
        new_fp = [(lay.keys.index_select(2, it), lay.values.index_select(2, it)) for lay in self.hf.layers]
        new_q = [q.gather(iq) for q in self.int8] if self.int8 is not None else None
        for lay, (k, v) in zip(self.hf.layers, new_fp):
            lay.keys, lay.values = k, v
        self.int8 = new_q

    def rotate(self, rope, slots: Sequence[int], delta: Sequence[int]) -> None:
        """Rotate the post-RoPE keys at ``slots`` by position offsets ``delta`` on every layer (FP only)."""
        dev = self.device
        idx = torch.tensor(list(slots), dtype=torch.long, device=dev)
        d = torch.tensor(list(delta), dtype=torch.long, device=dev)
        new_keys = [rope.rotate(lay.keys[:, :, idx, :], d) for lay in self.hf.layers]  # (1, H_kv, m, D)
        for lay, k in zip(self.hf.layers, new_keys):
            lay.keys = lay.keys.clone()
            lay.keys[:, :, idx, :] = k

    def splice(self, layout, blocks, hook, mode: str) -> int:
        """Rebuild every layer by a surgery ``layout`` (``gather``: one ``cat`` per layer) or by its
        sequential ``steps`` (``per_row``: the seed's one ``cat`` per row op). ``blocks[j][1][i]`` =
        block ``j``'s (K, V) on layer ``i``. Returns bytes written."""
        if not self.num_layers:                       # never written: create empty layers shaped like the blocks
            self.hf = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in blocks[0][1]])
        nbytes = 0
        if mode == "gather":
            for i, lay in enumerate(self.hf.layers):
                hook(f"splice:{i}")
                for name in ("keys", "values"):
                    old = getattr(lay, name)                                          # (1, H_kv, T, D)
                    parts = [old[:, :, a:b, :] if kind == "old" else blocks[a][1][i][name == "values"]
                             for kind, a, b in layout.layout]
                    new = torch.cat(parts, dim=2) if parts else old[:, :, :0, :]      # (1, H_kv, T', D)
                    setattr(lay, name, new)
                    nbytes += new.numel() * new.element_size()
        else:                                         # the seed's naive sequence: one torch.cat per row op
            for op, slot, j in layout.steps:
                for i, lay in enumerate(self.hf.layers):
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
        return nbytes

    def clear(self) -> None:
        self.hf, self.int8, self._materialized = DynamicCache(), None, False

    def copy(self, written: bool) -> "Storage":
        """A deep copy (``written``: the cache holds entries, so the layers exist)."""
        kvs = [(layer.keys.clone(), layer.values.clone()) for layer in self.hf.layers]
        hf = DynamicCache(ddp_cache_data=kvs) if kvs and written else DynamicCache()
        return Storage(hf, [q.clone() for q in self.int8] if self.int8 is not None else None)

    # ------------------------------------------------------------------ INT8

    def quantize_prefix(self, m: int) -> None:
        """Move the oldest ``m`` FP entries of every layer to INT8, as one scale group."""
        new_q = []
        for i, lay in enumerate(self.hf.layers):
            base = self.int8[i] if self.int8 is not None else Int8Layer.empty_like(lay.keys)
            new_q.append(base.append_group(lay.keys[:, :, :m, :], lay.values[:, :, :m, :]))
        new_fp = [(lay.keys[:, :, m:, :].clone(), lay.values[:, :, m:, :].clone()) for lay in self.hf.layers]
        for lay, (k, v) in zip(self.hf.layers, new_fp):
            lay.keys, lay.values = k, v
        self.int8 = new_q

    def dequantize(self) -> None:
        """Turn every INT8 entry back into an FP entry (values as dequantized)."""
        if self.n_int8:
            self._prepend_int8()
        self.int8 = None

    def materialize(self) -> int:
        """Put the dequantized INT8 prefix in front of every layer's FP tail (for one forward); returns
        the prefix length for :meth:`dematerialize`."""
        nq = self.n_int8
        if nq:
            self._prepend_int8()
            self._materialized = True
        return nq

    def dematerialize(self, nq: int) -> None:
        """Drop the materialized prefix again (a no-op unless :meth:`materialize` put one there)."""
        if not self._materialized:
            return
        for lay in self.hf.layers:
            lay.keys = lay.keys[:, :, nq:, :].clone()
            lay.values = lay.values[:, :, nq:, :].clone()
        self._materialized = False

    def _prepend_int8(self) -> None:
        """Put every layer's dequantized INT8 entries in front of its FP entries (``(1, H_kv, T, D)``)."""
        for q, lay in zip(self.int8, self.hf.layers):
            k, v = q.dequant(lay.keys.dtype)
            lay.keys = torch.cat([k, lay.keys], dim=2)
            lay.values = torch.cat([v, lay.values], dim=2)
