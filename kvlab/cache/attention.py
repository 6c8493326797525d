"""Attention mass of one forward, from its queries and the cached keys (no attention forward is patched).
Its hooks sit on a model only while a forward measures attention; it reads queries and keys and changes no cache
tensor.

:class:`QueryCapture` is a context manager that registers removable hooks for ONE forward: a
forward hook on each attention module's query projection (``q_norm`` when the module has one,
else ``q_proj``: the pre-RoPE queries ``(B, n, H*D)``) and a kwargs pre-hook on the attention
module for the ``position_embeddings`` ``(cos, sin)`` the model itself used. After the forward,
:meth:`QueryCapture.mass` rebuilds the post-RoPE queries with the model's own
``apply_rotary_pos_emb`` and computes, per layer,

    A = softmax(q · Kᵀ · scaling + causal)        # (H, n, T), K = that layer's cached keys (GQA-repeated)
    mass_j = Σ_i mean_h A[h, i, j]                 # (T,)  summed over the n new queries (or the last w)
    ema_j  = Σ_i β^(w-1-i) mean_h A[h, i, j]       # (T,)  the same, each query weighted for a per-query EMA

— the attention probabilities the model computed (for full attention without softcapping).
:meth:`QueryCapture.mass_rows` gives the same numbers, bit for bit, for many rows of a batched forward
at once (rows of equal key length share each op). The
ordinary path never pays for it: the hooks exist only inside the ``with`` block and are removed
on exit, error or not.
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch


def attention_modules(model) -> list[torch.nn.Module]:
    """Self-attention modules (have ``q_proj`` and ``layer_idx``), in layer order."""
    mods = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    return sorted(mods, key=lambda m: m.layer_idx)


class QueryCapture:
    def __init__(self, model):
        self.modules = attention_modules(model)
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no attention modules with q_proj; attention mass "
                             "needs them")
        self.q: dict[int, torch.Tensor] = {}
        self.pe: dict[int, tuple] = {}
        self._handles = []

    def __enter__(self):
        for m in self.modules:
            i = m.layer_idx
            src = m.q_norm if getattr(m, "q_norm", None) is not None else m.q_proj
            self._handles.append(src.register_forward_hook(self._q_hook(i)))
            self._handles.append(m.register_forward_pre_hook(self._pe_hook(i), with_kwargs=True))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _q_hook(self, i):
        def hook(module, args, out):
            self.q[i] = out.detach()
        return hook

    def _pe_hook(self, i):
        def hook(module, args, kwargs):
            pe = kwargs.get("position_embeddings")
            if pe is None and len(args) > 1:
                pe = args[1]
            self.pe[i] = pe
        return hook

    @torch.no_grad()
    def mass(self, keys_of, n: int, window: int | None = None, below: bool = False,
             row: int | None = None, decay: float | None = None) -> list[torch.Tensor]:
        """Per layer, the ``(T_i,)`` float32 attention mass of the captured ``n`` queries over that
        layer's keys (layers may hold different numbers of entries).

        ``keys_of(i)`` returns layer ``i``'s cached keys ``(1, H_kv, T_i, D)`` after the forward
        (the ``n`` new entries last). ``window``: only the last ``window`` queries count (SnapKV's
        observation window); ``None`` = all ``n``. ``below=True`` also sets :attr:`low`, per layer
        ``(T_i,)``: per entry, how many of those queries gave it less than the uniform share ``1/T_i`` of
        their head-mean attention (``T_i`` = entries query ``i`` sees; Scissorhands). ``row``: the
        batch row of a batched forward whose queries count (``keys_of`` then returns that row's keys).
        ``decay=β`` also
        sets :attr:`ema_mass`, per layer ``(T_i,)``: ``Σ_i β^(w-1-i) a_i`` over the measured queries
        ``i = 0 … w-1`` in order — with it, ``ema ← β^w·ema + (1-β)·ema_mass`` is exactly ``w``
        per-query EMA updates in query order (a query gives 0 to entries after it: causal).
        (Many rows of a batched forward at once: :meth:`mass_rows`.)"""
        w = n if window is None else min(int(window), n)
        out, lows, emas = [], [], []
        for m in self.modules:
            i = m.layer_idx
            q = self._queries(m, n, None if row is None else slice(row, row + 1))     # (1, H, n, D)
            a = self._head_mean(m, q[:, :, n - w:, :], keys_of(i).float())[0]       # (w, T)
            out.append(a.sum(0))                                                   # (T,)
            if decay is not None:
                wts = float(decay) ** torch.arange(w - 1, -1, -1, device=a.device, dtype=a.dtype)   # (w,) newest = 1
                emas.append(wts @ a)                                               # (T,)
            if below:
                lows.append(_below(a, 0))                                          # (T,)
        self.low = lows if below else None                                         # per layer (T_i,)
        self.ema_mass = emas if decay is not None else None                        # per layer (T_i,)
        return out

    @torch.no_grad()
    def mass_rows(self, rows: Sequence[int], n: int, keys_of, lengths, settings) -> dict[int, tuple]:
        """:meth:`mass` of several rows of one batched forward, each row's numbers exactly (bit for
        bit) what ``mass(..., row=b)`` gives, in a few batched ops per layer instead of a pass per row.

        ``rows``: the batch rows measured; ``lengths(b, i)``: row ``b``'s key count ``T`` on layer
        ``i``; ``keys_of(i, group)``: the keys ``(G, H_kv, T, D)`` of the rows ``group`` (all of length
        ``T`` on layer ``i``); ``settings[b]`` = row ``b``'s ``(window, below, decay)``. Per layer the
        queries of all ``rows`` are rotated at once (elementwise), and the rows of equal ``T`` and
        settings form one group: one batched matmul (per row the same ``(g·w, D) x (D, T)`` products
        a single row runs), one softmax over the last dim (each row reduced alone), one head mean, one
        sum. Returns ``{b: (mass, low, ema_mass)}``, each a per-layer list of ``(T_i,)`` (``low`` /
        ``ema_mass`` None when that row does not ask for them)."""
        rows = list(rows)
        out = {b: ([], [] if settings[b][1] else None, [] if settings[b][2] is not None else None) for b in rows}
        if not rows:
            return out
        sel = torch.tensor(rows, dtype=torch.long, device=next(iter(self.q.values())).device) if self.q else None
        for m in self.modules:
            i = m.layer_idx
            q = self._queries(m, n, sel)                                           # (R, H, n, D) post-RoPE
            groups: dict[tuple, list[int]] = {}
            for j, b in enumerate(rows):
                groups.setdefault((lengths(b, i), tuple(settings[b])), []).append(j)
            for (_, (window, below, decay)), js in groups.items():
                w = n if window is None else min(int(window), n)
                qs = q if len(js) == len(rows) else q[torch.tensor(js, dtype=torch.long, device=q.device)]
                a = self._head_mean(m, qs[:, :, n - w:, :], keys_of(i, [rows[j] for j in js]).float())  # (G, w, T)
                mass = a.sum(1)                                                    # (G, T)
                if decay is not None and w == 1:
                    ema = a[:, 0, :]                                               # β^0 · a: exactly a
                elif decay is not None:
                    wts = float(decay) ** torch.arange(w - 1, -1, -1, device=a.device, dtype=a.dtype)
                    ema = torch.stack([wts @ a[g] for g in range(len(js))])        # per row: mass's own product
                low = _below(a, 1) if below else None                              # (G, T)
                for g, j in enumerate(js):
                    got = out[rows[j]]
                    got[0].append(mass[g])
                    if below:
                        got[1].append(low[g])
                    if decay is not None:
                        got[2].append(ema[g])
        return out

    def _queries(self, m, n: int, rows) -> torch.Tensor:
        """The captured queries of layer ``m`` after RoPE, float ``(b, H, n, D)``; ``rows``: the batch
        rows (a slice or an index tensor; None = all)."""
        i = m.layer_idx
        q, pe = self.q.get(i), self.pe.get(i)
        if q is None or pe is None:
            raise RuntimeError(f"layer {i}: queries or position embeddings were not captured")
        if rows is not None:                                                       # rows of a batched forward
            q, pe = q[rows], tuple(t[rows] if t.shape[0] > 1 else t for t in pe)
        d = m.head_dim
        b = q.shape[0]
        q = q.reshape(b, n, -1, d).transpose(1, 2).float()                         # (b, H, n, D)
        cos, sin = pe
        apply = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")
        q, _ = apply(q, q, cos.float(), sin.float())
        return q

    @staticmethod
    def _head_mean(m, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """``(b, w, T)``: per row, ``softmax(q · Kᵀ · scaling + causal)`` averaged over heads, for the
        observed queries ``q`` ``(b, H, w, D)`` over keys ``k`` ``(b, H_kv, T, D)`` (GQA: grouped queries)."""
        b, _, w, d = q.shape
        hkv, t = k.shape[1], k.shape[2]
        groups = q.shape[1] // hkv                                                 # GQA: no K copy, group the queries
        qg = q.reshape(b, hkv, groups * w, d) * float(m.scaling)                   # (b, H_kv, g·w, D) scaled
        scores = torch.matmul(qg, k.transpose(-1, -2))                             # (b, H_kv, g·w, T)
        scores = scores.view(b, hkv * groups, w, t)                                # (b, H, w, T)
        if w > 1:                                   # causal: query i (at t-w+i) sees no key after it; only the
            late = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)     # last w keys can be later
            scores[..., t - w:].masked_fill_(late, float("-inf"))                  # in place: no (b, H, w, T) copy
        probs = torch.softmax(scores, dim=-1)                                      # (b, H, w, T)
        return probs.mean(1)                                                       # (b, w, T)


def _below(a: torch.Tensor, dim: int) -> torch.Tensor:
    """Per entry, how many of the ``w`` queries (dimension ``dim`` of ``a``, ``(…, w, T)``) gave it less
    than the uniform share ``1/T_i`` (``T_i`` = entries query ``i`` sees); float ``(…, T)``."""
    w, t = a.shape[-2], a.shape[-1]
    seen = torch.arange(w, device=a.device).view(w, 1) + (t - w) + 1               # (w, 1) entries query i sees
    vis = torch.arange(t, device=a.device).view(1, t) < seen                       # (w, T)
    return ((a < 1.0 / seen) & vis).sum(dim).float()                               # (…, T)
