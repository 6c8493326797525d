"""RoPE re-rotation of cached keys (seed 003 ``apply_rotation``), read from the model's own rotary module.

Keys are cached *post*-RoPE: ``k_p = s · R(p) k`` where ``R(p)`` rotates each channel pair by
``p · inv_freq_i`` and ``s`` is the rotary module's ``attention_scaling`` (1 except YaRN-like
types). Rotations compose, ``R(p + δ) = R(δ) R(p)``, so moving an entry from position ``p`` to
``p + δ`` is ``k_{p+δ} = R(δ) k_p`` — the *pure* rotation (cos/sin of ``δ · inv_freq`` divided by
``attention_scaling``), applied with the model's own ``apply_rotary_pos_emb`` (its channel
pairing convention). Values carry no position and are untouched.

Everything comes from the model: the rotary module (the one submodule with an ``inv_freq``
buffer and a ``rope_type``: theta and any static scaling — linear, llama3, yarn — are already
folded into ``inv_freq``) and the attention module's ``apply_rotary_pos_emb``. RoPE types whose
frequencies depend on the sequence length (``dynamic``, ``longrope``) are refused: there the
angle is not linear in position, so a rotation by δ is not a change of position.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch

_LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass(frozen=True, eq=False)
class Rope:
    """The model's rotary module and its apply function."""

    rotary: torch.nn.Module
    apply: Callable            # apply_rotary_pos_emb(q, k, cos, sin) -> (q', k')
    rope_type: str

    @torch.no_grad()
    def cos_sin(self, delta: torch.Tensor, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Pure-rotation ``(cos, sin)`` for position offsets ``delta`` (T,), each ``(1, T, D)``."""
        x = torch.zeros(1, device=device, dtype=dtype)
        cos, sin = self.rotary(x, delta.to(device=device, dtype=torch.long).view(1, -1))   # (1, T, D)
        s = float(getattr(self.rotary, "attention_scaling", 1.0) or 1.0)
        return cos / s, sin / s

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, H_kv, T, D) at positions ``p`` -> the same keys at ``p + delta`` (T,)."""
        cos, sin = self.cos_sin(delta, keys.device)
        k = keys.float()
        _, out = self.apply(k, k, cos, sin)                 # unsqueeze_dim=1: (1, 1, T, D) broadcast
        return out.to(keys.dtype)


def rope_of(model) -> Rope:
    """The model's RoPE (rotary module + apply function); ValueError if there is none or it is length-dependent."""
    rotary = attn = None
    for module in model.modules():
        if rotary is None and hasattr(module, "inv_freq") and hasattr(module, "rope_type"):
            rotary = module
        if attn is None and hasattr(module, "q_proj") and hasattr(module, "layer_idx"):
            attn = module
    if rotary is None or attn is None:
        raise ValueError(f"{type(model).__name__} has no rotary embedding module (inv_freq, rope_type) or no "
                         "attention module with q_proj; re-rotation needs a RoPE model")
    rope_type = str(rotary.rope_type)
    if any(t in rope_type for t in _LENGTH_DEPENDENT):
        raise ValueError(f"rope_type={rope_type!r}: its frequencies depend on the sequence length, so rotating a "
                         "cached key by a position delta is not a change of position; use rerotate=False")
    apply = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise ValueError(f"{type(attn).__module__} defines no apply_rotary_pos_emb; cannot re-rotate its keys")
    return Rope(rotary=rotary, apply=apply, rope_type=rope_type)
