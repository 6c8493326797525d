"""INT8 storage for one layer's older cache entries (Conf-KV "mixed precision"), pure tensor helpers.

Two schemes, both symmetric with separate scales for keys and values:

* **per (head, channel)** — the paper's (seed 002: "older retained entries are symmetrically
  quantized to INT8 per head and channel with scale s = max|x|/127"): ONE scale per (head,
  channel) over the whole quantized prefix (:meth:`Int8Layer.append_channel`). Entries join the
  prefix as they leave the 16-bit window; when a newcomer's ``|x|`` exceeds a channel's scale the
  scale grows to ``max|x|/127`` over the prefix and the channel's stored codes are re-quantized to
  it (``q ← round(q · s_old / s_new)``), so every code stays in ``[-127, 127]`` and one scale per
  channel covers the prefix. Error per element ``≤ s/2`` per quantization (a re-quantized code
  adds at most another ``s_new/2``).
* **grouped** — kvlab's earlier variant: entries are quantized in *groups* (the entries that left
  together, at least ``group`` of them), one scale per (group, head, channel)
  (:meth:`Int8Layer.append_group`):

      s[g, h, d] = max_{t ∈ g} |x[t, h, d]| / 127,   q = clamp(round(x / s), -127, 127) (int8),
      x̂ = q · s[gid[t]]                               (dequantized on read)

so ``|x - x̂| ≤ s / 2 = absmax_{g,h,d} / 254`` per element. Storage per entry and layer: ``2·H·D``
bytes of int8, plus ``2·H·D`` scales per group (and a group id per entry when there is more than one
group). :meth:`Int8Layer.nbytes16` counts the scales at 16 bits (the paper's FP16 reference).
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

    def nbytes16(self) -> int:
        """Bytes with the scales stored at 16 bits (FP16, the paper's reference); group ids only when
        there is more than one group (one scale per channel needs none)."""
        gid = self.gid.numel() * self.gid.element_size() if self.ks.shape[2] > 1 else 0
        return self.kq.numel() + self.vq.numel() + 2 * (self.ks.numel() + self.vs.numel()) + gid

    def append_channel(self, k: torch.Tensor, v: torch.Tensor) -> "Int8Layer":
        """A new layer with ``k, v`` (1, H, t, D) added to a prefix with ONE scale per (head, channel)
        (module docstring; self is not modified). A grouped store is first merged to one scale."""
        if not len(self):
            kq, ks = quantize(k)
            vq, vs = quantize(v)
            return Int8Layer(kq, vq, ks, vs, torch.zeros(k.shape[2], dtype=torch.int32, device=self.gid.device))
        base = self if self.ks.shape[2] == 1 else self.merged()
        kq, ks = _join_channel(base.kq, base.ks, k)
        vq, vs = _join_channel(base.vq, base.vs, v)
        gid = torch.zeros(kq.shape[2], dtype=torch.int32, device=self.gid.device)
        return Int8Layer(kq, vq, ks, vs, gid)

    def merged(self) -> "Int8Layer":
        """The same entries under one scale per (head, channel) (re-quantized from the dequantized values)."""
        k, v = self.dequant(torch.float32)
        return Int8Layer.empty_like(k).append_channel(k, v)

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


def _join_channel(q: torch.Tensor, s: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``q`` (1, H, n, D) under scale ``s`` (1, H, 1, D) plus new values ``x`` (1, H, t, D):
    the joint codes and the grown scale (old codes re-quantized where a channel's scale grew)."""
    xf = x.float()
    new = torch.maximum(s, xf.abs().amax(dim=2, keepdim=True) / QMAX)                # (1, H, 1, D)
    grew = bool((new > s).any())
    if grew:
        q = torch.round(q.float() * (s / new)).clamp_(-QMAX, QMAX).to(torch.int8)
    qx = torch.round(xf / new).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, qx], 2), new


def roundtrip_error(x: torch.Tensor, scheme: str = "channel", group: int = 8) -> dict:
    """Quantize ``x`` (1, H, T, D) as a cache prefix would be (``"channel"``: one scale per (head,
    channel), entries arriving one at a time; ``"group"``: groups of ``group`` entries) and report
    the round-trip error: ``mean_rel`` = mean |x - x̂| / mean |x| (the paper's "mean roundtrip error"),
    ``max_abs``, ``rel_fro`` = ‖x - x̂‖ / ‖x‖, and ``bound`` (max over channels of scale/2)."""
    if scheme not in ("channel", "group"):
        raise ValueError(f"scheme={scheme!r} must be 'channel' or 'group'")
    lay = Int8Layer.empty_like(x)
    t = x.shape[2]
    step = 1 if scheme == "channel" else group
    for i in range(0, t, step):
        part = x[:, :, i:i + step]
        lay = lay.append_channel(part, part) if scheme == "channel" else lay.append_group(part, part)
    xh, _ = lay.dequant(torch.float32)
    err = (x.float() - xh).abs()
    return {"mean_rel": float(err.mean() / x.float().abs().mean()), "max_abs": float(err.max()),
            "rel_fro": float(err.norm() / x.float().norm()), "bound": float(lay.ks.max() / 2)}
