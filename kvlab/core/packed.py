"""Linear layers for a batched decode step: one weight matrix, prepacked for the step's row count.
Pure linear algebra: reads weights it is given, edits nothing, touches no cache.

A batched decode step multiplies ``M`` rows (the batch) by every weight matrix of the model. On a CPU with MKL,
``F.linear`` runs those small-``M`` products well below the memory bandwidth: on the 2-core Xeon here, at
``M = 8``, the teacher's matrices stream at 7-17 GB/s through ``F.linear`` and at 15-35 GB/s through MKL's packed
GEMM (``cblas_sgemm_pack``, reached through ``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``, the pair
inductor's CPU freezing pass uses; ``docs/measured/packed_step``). The packed copy serves one row count ``M``;
any other count runs ``F.linear`` on the original weight, so results never depend on whether a pack exists beyond
float rounding (a packed product sums in another order: |Δ| ~1e-6 relative).

:class:`PackedLinear` holds one weight ``(N, K)`` and at most :data:`PACKS` packed copies (the row counts most
recently asked for, of at most :data:`PACK_ROWS` rows; a pack is a copy of the weight's bytes, made in ~0.3 ms per
MB). Packing is used only where it can run: float32 on a CPU whose torch has MKL; elsewhere (CUDA, bf16, no MKL)
and for more rows (a prefill) it is ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PACKS = 1          # packed copies kept per weight (row counts): the batch's decode step
PACK_ROWS = 32     # products of more rows (a prefill's) run F.linear: packing serves the small-M regime only


def can_pack(weight: torch.Tensor) -> bool:
    """MKL's packed GEMM serves this weight: float32, on the CPU, torch built with MKL."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and bool(torch._C.has_mkl)
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))


class PackedLinear:
    """``y = x @ weightᵀ`` for ``x`` ``(..., K)``; packed per row count ``M`` (rows of ``x`` flattened)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"weight must be (N, K), got shape {tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()                                   # (N, K)
        self.pack = can_pack(self.weight)
        self.packs: dict[int, torch.Tensor] = {}

    def _packed(self, m: int) -> torch.Tensor:
        got = self.packs.pop(m, None)
        if got is None:
            got = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, m)
        self.packs[m] = got                                                          # newest last
        while len(self.packs) > PACKS:
            self.packs.pop(next(iter(self.packs)))
        return got

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pack or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)                                                        # (M, K)
        m = x2.shape[0]
        if m > PACK_ROWS:
            return F.linear(x, self.weight)
        y = torch.ops.mkl._mkl_linear(x2.contiguous(), self._packed(m), self.weight, None, m)   # (M, N)
        return y.view(*x.shape[:-1], self.weight.shape[0])
