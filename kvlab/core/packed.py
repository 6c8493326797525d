"""Linear layers for a batched decode step: one weight matrix, prepacked for the step's row count.
Pure linear algebra: reads weights it is given, edits nothing, touches no cache.

A batched decode step multiplies ``M`` rows (the batch) by every weight matrix of the model. On a CPU,
``F.linear`` runs those small-``M`` products well below the memory bandwidth. Two libraries in torch's CPU build
pack a weight for a known row count and stream it faster:

* MKL's packed GEMM (``cblas_sgemm_pack``, reached through ``torch.ops.mkl._mkl_reorder_linear_weight`` /
  ``_mkl_linear``, the pair inductor's CPU freezing pass uses). On the 2-core Intel Xeon here, at ``M = 8``, the
  teacher's matrices stream at 7-17 GB/s through ``F.linear`` and at 15-35 GB/s packed (``docs/measured/packed_step``).
* oneDNN's packed linear (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``). On a 2-core AMD
  EPYC, where MKL takes a slower path, the teacher's 30 layers at ``M = 8`` took 66 ms through MKL packed (as
  through ``F.linear``) and 18 ms through oneDNN (``docs/measured/packed_step/epyc.md``).

On the Xeon, session 15's A/B had MKL ahead (a step 72.5 vs 77.5 ms; oneDNN slower on the q/k/v shape). Which one
runs is :data:`BACKEND`: None (the default) is MKL wherever torch has it (else oneDNN), so one machine's tables do
not depend on a timing that can go either way where the two libraries are close (they round differently, and a
greedy near-tie can flip); ``"auto"`` times both once per process on four decoder layers'
products at the embedded teacher's shapes, interleaved, and keeps the faster (:func:`backend`; as
``torch.backends.cudnn.benchmark`` picks a kernel): what ``python -m kvlab bench`` runs by default (its ``--packed``). A packed copy serves
one row count ``M``; any other count runs ``F.linear`` on the original weight, so results never depend on whether a
pack exists, or which library made it, beyond float rounding (a packed product sums in another order: |Δ| ~1e-6
relative).

:class:`PackedLinear` holds one weight ``(N, K)`` and at most :data:`PACKS` packed copies (the row counts most
recently asked for, of at most :data:`PACK_ROWS` rows; a pack is a copy of the weight's bytes, made in ~0.3 ms per
MB). Packing is used only where it can run: float32 on a CPU whose torch has MKL or oneDNN; elsewhere (CUDA, bf16)
and for more rows (a prefill) it is ``F.linear``.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

PACKS = 1          # packed copies kept per weight (row counts): the batch's decode step
PACK_ROWS = 32     # products of more rows (a prefill's) run F.linear: packing serves the small-M regime only


BACKENDS = ("mkl", "onednn")
BACKEND: str | None = None      # "mkl", "onednn", "auto" (the faster here, timed once: backend()), or None: MKL first
_CHOSEN: list[str] = []         # the timed choice of this process


@functools.lru_cache(maxsize=None)
def _available(name: str) -> bool:
    """Whether this torch build has library ``name`` (fixed for the process: asked once, not per product)."""
    if name == "mkl":
        return bool(torch._C.has_mkl) and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _pack(name: str, weight: torch.Tensor, m: int) -> torch.Tensor:
    if name == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
    return torch.ops.mkldnn._reorder_linear_weight(weight, m)


def _product(name: str, x2: torch.Tensor, pack: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weightᵀ`` ``(M, N)`` through ``name``'s pack of ``weight``."""
    if name == "mkl":
        return torch.ops.mkl._mkl_linear(x2, pack, weight, None, x2.shape[0])
    return torch.ops.mkldnn._linear_pointwise(x2, pack, None, "none", [], "")


def backend() -> str | None:
    """The packing library products use: :data:`BACKEND` when it names one (checked: one of :data:`BACKENDS`,
    available here); None: the first of :data:`BACKENDS` available; ``"auto"``: the faster available one, timed once
    per process (8 rows through four decoder layers' products, :data:`_TIMED_SHAPES`; five interleaved rounds, the
    median). None when neither library is available."""
    if BACKEND is None:
        return next((b for b in BACKENDS if _available(b)), None)
    if BACKEND != "auto":
        if BACKEND not in BACKENDS:
            raise ValueError(f"kvlab.core.packed.BACKEND={BACKEND!r} must be one of {BACKENDS}, 'auto' (timed) or "
                             "None (MKL first)")
        if not _available(BACKEND):
            raise ValueError(f"kvlab.core.packed.BACKEND={BACKEND!r}: this torch build lacks it; set None or 'auto'")
        return BACKEND
    if not _CHOSEN:
        have = [b for b in BACKENDS if _available(b)]
        _CHOSEN.append(have[0] if len(have) == 1 else _timed(have) if have else "")
    return _CHOSEN[0] or None


# the products timed to choose a library: four decoder layers' q/k/v, o, gate/up and down at the embedded teacher's
# shapes (hidden 576, intermediate 1,536, 9 + 2·3 heads of 64): 57 MB, past the last-level cache as a step's are
_TIMED_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 4


def _timed(names: list[str]) -> str:
    import time

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(n, k, generator=g) for n, k in _TIMED_SHAPES]                  # (N, K) each
    xs = {k: torch.randn(8, k, generator=g) for k in {k for _, k in _TIMED_SHAPES}}
    packs = {b: [_pack(b, w, 8) for w in ws] for b in names}
    times: dict[str, list[float]] = {b: [] for b in names}

    def run(b):
        for w, p in zip(ws, packs[b]):
            _product(b, xs[w.shape[1]], p, w)

    with torch.inference_mode():
        for b in names:                                                              # warm-up
            run(b)
        for _ in range(5):
            for b in names:
                t0 = time.perf_counter()
                run(b)
                times[b].append(time.perf_counter() - t0)
    return min(names, key=lambda b: sorted(times[b])[len(times[b]) // 2])


def can_pack(weight: torch.Tensor) -> bool:
    """A packing library serves this weight: float32, on the CPU, torch built with MKL or oneDNN."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and (
        _available("mkl") or _available("onednn"))


class PackedLinear:
    """``y = x @ weightᵀ`` for ``x`` ``(..., K)``; packed per row count ``M`` (rows of ``x`` flattened)."""

    def __init__(self, weight: torch.Tensor):
        if weight.dim() != 2:
            raise ValueError(f"weight must be (N, K), got shape {tuple(weight.shape)}")
        self.weight = weight.detach().contiguous()                                   # (N, K)
        self.pack = can_pack(self.weight)
        self.packs: dict[int, tuple[str, torch.Tensor]] = {}           # row count -> (library, pack)

    def _packed(self, m: int, lib: str) -> torch.Tensor:
        got = self.packs.pop(m, None)
        if got is None or got[0] != lib:
            got = (lib, _pack(lib, self.weight, m))
        self.packs[m] = got                                                          # newest last
        while len(self.packs) > PACKS:
            self.packs.pop(next(iter(self.packs)))
        return got[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.pack or x.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, self.weight)
        k = x.shape[-1]
        x2 = x.reshape(-1, k)                                                        # (M, K)
        m = x2.shape[0]
        if m > PACK_ROWS:
            return F.linear(x, self.weight)
        lib = backend()
        if lib is None:
            return F.linear(x, self.weight)
        y = _product(lib, x2.contiguous(), self._packed(m, lib), self.weight)                  # (M, N)
        return y.view(*x.shape[:-1], self.weight.shape[0])
