"""INT8 storage for one layer's older cache entries (Conf-KV "mixed precision"), pure tensor helpers.

Entries that leave the FP window are quantized in *groups* (the entries that left together, at
least ``group`` of them): symmetric, one scale per (group, head, channel) for keys and values
separately,

    s[g, h, d] = max_{t ∈ g} |x[t, h, d]| / 127,   q = clamp(round(x / s), -127, 127) (int8),
    x̂ = q · s[gid[t]]                               (dequantized on read)

so ``|x - x̂| ≤ s / 2 = absmax_{g,h,d} / 254`` per element. Storage per entry and layer:
``2·H·D`` bytes of int8 + a 4-byte group id, plus ``2·H·D`` scales (float32) per group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = 127


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (1, H, t, D) -> (int8 (1, H, t, D), float32 scale (1, H, 1, D))."""
    xf = x.float()
    scale = (xf.abs().amax(dim=2, keepdim=True) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


@dataclass
class Int8Layer:
    """One layer's INT8 entries (the oldest ``n`` slots of the cache), keys and values."""

    kq: torch.Tensor      # (1, H, n, D) int8
    vq: torch.Tensor      # (1, H, n, D) int8
    ks: torch.Tensor      # (1, H, G, D) float32
    vs: torch.Tensor      # (1, H, G, D) float32
    gid: torch.Tensor     # (n,) int32: group of each entry

    @classmethod
    def empty_like(cls, k: torch.Tensor) -> "Int8Layer":
        b, h, _, d = k.shape
        z8 = torch.zeros(b, h, 0, d, dtype=torch.int8, device=k.device)
        zs = torch.zeros(b, h, 0, d, dtype=torch.float32, device=k.device)
        return cls(z8, z8.clone(), zs, zs.clone(), torch.zeros(0, dtype=torch.int32, device=k.device))

    def __len__(self) -> int:
        return int(self.kq.shape[2])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.kq, self.vq, self.ks, self.vs, self.gid))

    def append_group(self, k: torch.Tensor, v: torch.Tensor) -> "Int8Layer":
        """A new layer with ``k, v`` (1, H, t, D) quantized as one more group (self is not modified)."""
        kq, ks = quantize(k)
        vq, vs = quantize(v)
        g = self.ks.shape[2]
        gid = torch.full((k.shape[2],), g, dtype=torch.int32, device=self.gid.device)
        return Int8Layer(torch.cat([self.kq, kq], 2), torch.cat([self.vq, vq], 2), torch.cat([self.ks, ks], 2),
                         torch.cat([self.vs, vs], 2), torch.cat([self.gid, gid]))

    def dequant(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.gid.long()
        k = self.kq.float() * self.ks[:, :, g, :]                              # (1, H, n, D)
        v = self.vq.float() * self.vs[:, :, g, :]
        return k.to(dtype), v.to(dtype)

    def gather(self, idx: torch.Tensor) -> "Int8Layer":
        """Entries ``idx`` (slots of this store), unused groups dropped."""
        gid = self.gid[idx]
        used, new_gid = torch.unique(gid, return_inverse=True)
        used = used.long()
        return Int8Layer(self.kq[:, :, idx], self.vq[:, :, idx], self.ks[:, :, used], self.vs[:, :, used],
                         new_gid.to(torch.int32))

    def write(self, idx: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite entries ``idx`` in place, quantized with their group's existing scales (clamped)."""
        g = self.gid[idx].long()
        self.kq[:, :, idx] = torch.round(k.float() / self.ks[:, :, g]).clamp_(-QMAX, QMAX).to(torch.int8)
        self.vq[:, :, idx] = torch.round(v.float() / self.vs[:, :, g]).clamp_(-QMAX, QMAX).to(torch.int8)

    def clone(self) -> "Int8Layer":
        return Int8Layer(self.kq.clone(), self.vq.clone(), self.ks.clone(), self.vs.clone(), self.gid.clone())
