"""K/V storage of a :class:`~kvlab.cache.KVCache`: per layer, a preallocated full-precision buffer
plus INT8 entries.
Only :class:`Storage` reads or writes the K/V tensors; it knows no tokens or positions.

Each layer holds its own entries in slot order (layers may hold different numbers: per-layer live
sets): the oldest ``int8_len(i)`` of them in an :class:`~kvlab.cache.int8.Int8Layer`, the rest in a
:class:`BufferLayer` — a preallocated ``(1, H_kv, capacity, D)`` buffer with a length (keys
post-RoPE), in the spirit of transformers' ``DynamicLayer`` (which it subclasses, so the model
appends to it through the ordinary cache API) but appended and compacted in place: a decode step
writes one column instead of concatenating the whole layer, and eviction moves the kept entries
down inside the buffer (:mod:`.buffer`; a bank row's layer only marks evicted columns dead until enough
have piled up). :class:`Storage` is the only object that reads or writes these tensors; it
knows nothing about tokens or positions (the mirror's job, :mod:`.mirror`): it addresses entries
by layer and slot.
"""
from __future__ import annotations

from typing import Sequence

import torch
from transformers.cache_utils import Cache, DynamicCache

from kvlab.cache.buffer import MIN_CAPACITY, BufferLayer, fill_layers, keep_plan  # noqa: F401 - re-exported
from kvlab.cache.int8 import Int8Layer


class KVStore(Cache):
    """The transformers ``Cache`` a KVCache's model forwards append to: one :class:`BufferLayer` per layer."""

    def __init__(self, layers: list[BufferLayer] | None = None):
        if layers is None:
            super().__init__(layer_class_to_replicate=BufferLayer)
        else:
            super().__init__(layers=layers)
            self.layer_class_to_replicate = BufferLayer


class Storage:
    """Per-layer K/V: INT8 entries (``int8``, or None) before FP entries (``hf``, a :class:`KVStore`)."""

    def __init__(self, hf: KVStore | None = None, int8: list[Int8Layer] | None = None):
        self.hf = hf if hf is not None else KVStore()
        self.int8 = int8                  # per layer: its oldest int8_len(i) slots, INT8 (or None)
        self._materialized: list[int] | None = None
        self._checked: tuple | None = None  # ids of the layers check() verified (type, batch 1)

    # ------------------------------------------------------------------ sizes

    @property
    def layers(self) -> list[BufferLayer]:
        return self.hf.layers

    @property
    def num_layers(self) -> int:
        return len(self.hf.layers)

    def int8_len(self, i: int) -> int:
        return len(self.int8[i]) if self.int8 else 0

    @property
    def n_int8(self) -> int:
        """Entries of layer 0 held in INT8 storage (the oldest slots)."""
        return self.int8_len(0) if self.num_layers else 0

    def layer_len(self, i: int) -> int:
        return self.int8_len(i) + self.hf.layers[i].n

    def layer_lengths(self) -> list[int]:
        if not self.int8:                       # (every decode step asks each row: no per-layer method calls)
            return [lay.n for lay in self.hf.layers]
        return [self.layer_len(i) for i in range(self.num_layers)]

    def check(self, lengths: Sequence[int]) -> None:
        """Layer ``i`` holds exactly ``lengths[i]`` entries, batch 1."""
        if self.int8 is None and self._checked is not None and [lay.n for lay in self.hf.layers] == list(lengths) \
                and self._checked == tuple(map(id, self.hf.layers)):
            return                              # the per-step case: lengths match, the layers were checked before
        if self.num_layers and len(lengths) != self.num_layers:
            raise AssertionError(f"mirror has {len(lengths)} live maps, storage {self.num_layers} layers")
        for i, layer in enumerate(self.hf.layers):
            if not isinstance(layer, BufferLayer):
                raise TypeError(f"layer {i} is {type(layer).__name__}; kvlab stores full-attention BufferLayers only")
            m = self.layer_len(i)
            if m != lengths[i]:
                raise AssertionError(f"cache/ledger out of step: layer {i} holds {m} entries, live map {lengths[i]}")
            if m and layer.buf_k.shape[0] != 1:
                raise AssertionError(f"layer {i} has batch {layer.buf_k.shape[0]}; KVCache holds one sequence")
        if self.int8 is not None and len(self.int8) != self.num_layers:
            raise AssertionError("INT8 stores and FP layers differ in number")
        self._checked = tuple(map(id, self.hf.layers)) \
            if self.num_layers and all(lay.buf_k is not None for lay in self.hf.layers) else None

    def nbytes(self) -> int:
        """Bytes of the live K/V over all layers: FP entries at their dtype (the used part of each
        buffer) plus INT8 entries with their scales and group ids."""
        total = 0
        for lay in self.hf.layers:
            if lay.n:
                _, h, _, d = lay.buf_k.shape                                      # (1, H_kv, cap, D)
                total += 2 * lay.n * h * d * lay.buf_k.element_size()
        for q in self.int8 or ():
            total += q.nbytes()
        return total

    def nbytes16(self) -> int:
        """:meth:`nbytes` at the 16-bit reference (the paper's FP16 cache): FP entries at 2 bytes per
        element whatever their dtype, INT8 entries at 1 byte with 16-bit scales (:meth:`Int8Layer.nbytes16`)."""
        total = 0
        for lay in self.hf.layers:
            if lay.n:
                _, h, _, d = lay.buf_k.shape                                      # (1, H_kv, cap, D)
                total += 2 * lay.n * h * d * 2
        for q in self.int8 or ():
            total += q.nbytes16()
        return total

    def capacity_nbytes(self) -> int:
        """Bytes allocated for FP buffers (capacity, used or not)."""
        return sum(2 * lay.buf_k.numel() * lay.buf_k.element_size() for lay in self.hf.layers if lay.buf_k is not None)

    def geometry(self) -> dict:
        """Layers, KV heads, head dim, dtype of the stored tensors (empty dict before the first write)."""
        if not self.num_layers or self.hf.layers[0].buf_k is None:
            return {}
        b, h, _, d = self.hf.layers[0].buf_k.shape  # (B, H_kv, cap, D)
        return {"layers": self.num_layers, "kv_heads": h, "head_dim": d, "dtype": str(self.hf.layers[0].dtype)}

    @property
    def device(self) -> torch.device:
        return self.hf.layers[0].buf_k.device

    def check_geometry(self, src: "Storage") -> None:
        if self.num_layers != src.num_layers:
            raise ValueError(f"src has {src.num_layers} layers, this cache {self.num_layers}")
        for dst, s in zip(self.hf.layers, src.hf.layers):
            if dst.buf_k.shape[1:2] + dst.buf_k.shape[3:] != s.buf_k.shape[1:2] + s.buf_k.shape[3:]:
                raise ValueError(f"KV geometry differs: {tuple(dst.keys.shape)} vs {tuple(s.keys.shape)}")

    # ------------------------------------------------------------------ reads

    def full_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s (keys, values), each (1, H_kv, T_i, D), INT8 entries dequantized (views if none)."""
        lay = self.hf.layers[i]
        if not self.int8_len(i):
            return lay.keys, lay.values
        k, v = self.int8[i].dequant(lay.dtype)
        return torch.cat([k, lay.keys], dim=2), torch.cat([v, lay.values], dim=2)

    def read_slots(self, i: int, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) of layer ``i`` at ``slots``, each (1, H_kv, n, D), INT8 dequantized."""
        k, v = self.full_kv(i)
        idx = torch.tensor(list(slots), dtype=torch.long, device=k.device)
        return k[:, :, idx, :], v[:, :, idx, :]

    def prefix_view(self, lengths: Sequence[int], batch: int = 1) -> DynamicCache:
        """A throwaway DynamicCache over slots ``[0, lengths[i])`` of each layer: views (batch
        ``expand``-ed), no copy. A forward on it appends to the views (the model's own ``cat``),
        never to this storage."""
        if not self.num_layers or not any(lengths):
            return DynamicCache()
        full = [self.full_kv(i) for i in range(self.num_layers)]   # views unless INT8 entries exist
        views = [(k[:, :, :s, :].expand(batch, -1, -1, -1),                         # (batch, H_kv, s, D)
                  v[:, :, :s, :].expand(batch, -1, -1, -1)) for (k, v), s in zip(full, lengths)]
        tmp = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in views])
        for lay, (k, v) in zip(tmp.layers, views):
            lay.keys, lay.values = k, v
        return tmp

    # ------------------------------------------------------------------ writes

    def write_slots(self, i: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite layer ``i``'s ``slots`` with ``k, v`` (1, H_kv, n, D) in place; INT8 slots are
        quantized with their group's scales."""
        nq, lay = self.int8_len(i), self.hf.layers[i]
        slots = list(slots)
        dev = lay.buf_k.device
        q_pick = [j for j, s in enumerate(slots) if s < nq]
        t_pick = [j for j, s in enumerate(slots) if s >= nq]
        if t_pick:
            src = torch.tensor(t_pick, dtype=torch.long, device=dev)
            dst = torch.tensor([slots[j] - nq for j in t_pick], dtype=torch.long, device=dev)
            lay.keys[:, :, dst, :] = k[:, :, src.to(k.device), :].to(lay.buf_k)         # views: in place
            lay.values[:, :, dst, :] = v[:, :, src.to(v.device), :].to(lay.buf_v)
        if q_pick:
            src = torch.tensor(q_pick, dtype=torch.long, device=k.device)
            dst = torch.tensor([slots[j] for j in q_pick], dtype=torch.long, device=dev)
            self.int8[i].write(dst, k[:, :, src, :].to(dev), v[:, :, src, :].to(dev))

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v`` (1, H_kv, n, D) after layer ``i``'s last entry (creating the layer if new)."""
        if i < self.num_layers and self.hf.layers[i].is_initialized:
            lay = self.hf.layers[i]
            lay.update(k.to(lay.buf_k), v.to(lay.buf_v))
        else:
            self.hf.update(k.clone(), v.clone(), i)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Keep the first ``lengths[i]`` entries of layer ``i`` (callers dequantize first if that cuts INT8)."""
        for i, n in enumerate(lengths[:self.num_layers]):
            self.hf.layers[i].truncate(n - self.int8_len(i))

    def keep(self, keeps: Sequence[torch.Tensor | None], drops: Sequence[Sequence[int]] | None = None,
             fill: bool = False) -> None:
        """Keep only slots ``keeps[i]`` (sorted, (T_i',)) on layer ``i`` (None: layer unchanged), in place.
        ``drops[i]`` (optional): the same decision as the dropped slots; a lazy layer (a bank row) with no
        INT8 entries then only marks them dead, or with ``fill`` moves its last survivors into them
        (:meth:`BufferLayer.drop`)."""
        lays = self.hf.layers
        if fill and drops is not None and all(k is not None for k in keeps) and \
                len({int(k.numel()) for k in keeps}) == 1 and len({lay.n for lay in lays}) == 1 and \
                all(lay.lazy and not self.int8_len(i) for i, lay in enumerate(lays)):
            fill_layers(lays, torch.stack(list(keeps)))                   # (L, m): one pass for all layers
            return
        plans: dict[tuple[int, int], tuple[int, int]] = {}   # per shared keep tensor (layers evicting alike)
        for i, keep_t in enumerate(keeps):
            if keep_t is None:
                continue
            nq = self.int8_len(i)
            lay = self.hf.layers[i]
            if drops is not None and lay.lazy and not nq:
                lay.drop(drops[i], fill=fill)
            elif nq:
                self.int8[i] = self.int8[i].gather(keep_t[keep_t < nq].to(lay.buf_k.device))
                lay.keep(keep_t[keep_t >= nq] - nq)
            else:
                key = (id(keep_t), lay.n)
                if key not in plans:
                    plans[key] = keep_plan(keep_t, lay.n)
                lay.keep(keep_t, plans[key])

    def rotate(self, i: int, rope, slots: Sequence[int], delta: Sequence[int]) -> None:
        """Rotate layer ``i``'s post-RoPE keys at ``slots`` (FP storage) by position offsets ``delta``."""
        lay = self.hf.layers[i]
        dev = lay.buf_k.device
        idx = torch.tensor(list(slots), dtype=torch.long, device=dev)
        d = torch.tensor(list(delta), dtype=torch.long, device=dev)
        lay.keys[:, :, idx, :] = rope.rotate(lay.keys[:, :, idx, :], d)                 # (1, H_kv, m, D)

    def splice(self, layout, blocks, hook, mode: str) -> int:
        """Rebuild every layer by a surgery ``layout`` (``gather``: one ``cat`` per layer) or by its
        sequential ``steps`` (``per_row``: the seed's one ``cat`` per row op). ``blocks[j][1][i]`` =
        block ``j``'s (K, V) on layer ``i``. Returns bytes written. (FP storage, uniform layers.)"""
        if not self.num_layers:                       # never written: create empty layers shaped like the blocks
            self.hf = KVStore([BufferLayer.of(k[:, :, :0], v[:, :, :0]) for k, v in blocks[0][1]])
        nbytes = 0
        if mode == "gather":
            for i, lay in enumerate(self.hf.layers):
                hook(f"splice:{i}")
                new = []
                for old, w in ((lay.keys, 0), (lay.values, 1)):                          # (1, H_kv, T, D)
                    parts = [old[:, :, a:b, :] if kind == "old" else blocks[a][1][i][w] for kind, a, b in layout.layout]
                    new.append(torch.cat(parts, dim=2) if parts else old[:, :, :0, :])  # (1, H_kv, T', D)
                    nbytes += new[-1].numel() * new[-1].element_size()
                lay.assign(*new)
        else:                                         # the seed's naive sequence: one torch.cat per row op
            for op, slot, j in layout.steps:
                for i, lay in enumerate(self.hf.layers):
                    hook(f"splice:{i}")
                    new = []
                    for old, w in ((lay.keys, 0), (lay.values, 1)):
                        if op == "delete":
                            new.append(torch.cat([old[:, :, :slot, :], old[:, :, slot + 1:, :]], dim=2))
                        else:
                            new.append(torch.cat([old[:, :, :slot, :], blocks[j][1][i][w], old[:, :, slot:, :]], dim=2))
                        nbytes += new[-1].numel() * new[-1].element_size()
                    lay.assign(*new)
        return nbytes

    def clear(self) -> None:
        self.hf, self.int8, self._materialized = KVStore(), None, None

    def copy(self) -> "Storage":
        hf = KVStore([lay.clone_layer() for lay in self.hf.layers]) if self.num_layers else KVStore()
        return Storage(hf, [q.clone() for q in self.int8] if self.int8 is not None else None)

    # ------------------------------------------------------------------ INT8

    def quantize_prefix(self, i: int, m: int, per_channel: bool = False) -> None:
        """Move the oldest ``m`` FP entries of layer ``i`` to INT8: as one more scale group, or
        (``per_channel``) into the prefix's one scale per (head, channel) (:mod:`.int8`)."""
        if self.int8 is None:
            self.int8 = [Int8Layer.empty_like(lay.keys) for lay in self.hf.layers]
        lay = self.hf.layers[i]
        add = self.int8[i].append_channel if per_channel else self.int8[i].append_group
        self.int8[i] = add(lay.keys[:, :, :m, :], lay.values[:, :, :m, :])
        lay.drop_front(m)

    def dequantize(self) -> None:
        """Turn every INT8 entry back into an FP entry (values as dequantized)."""
        if self.int8 is not None:
            self._prepend_int8()
        self.int8 = None

    def materialize(self) -> None:
        """Put the dequantized INT8 prefix in front of every layer's FP entries (for one forward)."""
        if self.int8 is not None and any(len(q) for q in self.int8):
            self._materialized = [len(q) for q in self.int8]
            self._prepend_int8()

    def dematerialize(self) -> None:
        """Drop the materialized prefix again (a no-op unless :meth:`materialize` put one there)."""
        if self._materialized is None:
            return
        for lay, nq in zip(self.hf.layers, self._materialized):
            lay.drop_front(nq)
        self._materialized = None

    def _prepend_int8(self) -> None:
        """Put every layer's dequantized INT8 entries in front of its FP entries (``(1, H_kv, T, D)``)."""
        for q, lay in zip(self.int8, self.hf.layers):
            if len(q):
                k, v = q.dequant(lay.dtype)
                lay.assign(torch.cat([k, lay.keys], dim=2), torch.cat([v, lay.values], dim=2))
