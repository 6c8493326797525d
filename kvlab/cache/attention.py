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

— the attention probabilities the model computed (for full attention without softcapping). The
ordinary path never pays for it: the hooks exist only inside the ``with`` block and are removed
on exit, error or not.
"""
from __future__ import annotations

import sys

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
        per-query EMA updates in query order (a query gives 0 to entries after it: causal)."""
        w = n if window is None else min(int(window), n)
        out, lows, emas = [], [], []
        for m in self.modules:
            i = m.layer_idx
            q, pe = self.q.get(i), self.pe.get(i)
            if q is None or pe is None:
                raise RuntimeError(f"layer {i}: queries or position embeddings were not captured")
            if row is not None:                                                    # one row of a batched forward
                q, pe = q[row:row + 1], tuple(t[row:row + 1] if t.shape[0] > 1 else t for t in pe)
            d = m.head_dim
            b = q.shape[0]
            q = q.reshape(b, n, -1, d).transpose(1, 2).float()                     # (1, H, n, D)
            cos, sin = pe
            apply = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")
            q, _ = apply(q, q, cos.float(), sin.float())
            q = q[:, :, n - w:, :]                                                 # (1, H, w, D) observed queries
            k = keys_of(i).float()                                                 # (1, H_kv, T, D)
            hkv, t = k.shape[1], k.shape[2]
            groups = q.shape[1] // hkv                                             # GQA: no K copy, group the queries
            qg = q.reshape(b, hkv, groups * w, d)                                  # (1, H_kv, g·w, D)
            scores = torch.matmul(qg, k.transpose(-1, -2)) * float(m.scaling)      # (1, H_kv, g·w, T)
            scores = scores.view(b, hkv * groups, w, t)                            # (1, H, w, T)
            if w > 1:
                qi = torch.arange(w, device=q.device).view(w, 1) + (t - w)
                kj = torch.arange(t, device=q.device).view(1, t)
                scores = scores.masked_fill(kj > qi, float("-inf"))
            probs = torch.softmax(scores, dim=-1)                                  # (1, H, w, T)
            a = probs[0].mean(0)                                                   # (w, T)
            out.append(a.sum(0))                                                   # (T,)
            if decay is not None:
                wts = float(decay) ** torch.arange(w - 1, -1, -1, device=a.device, dtype=a.dtype)   # (w,) newest = 1
                emas.append(wts @ a)                                               # (T,)
            if below:
                seen = torch.arange(w, device=a.device).view(w, 1) + (t - w) + 1   # (w, 1) entries query i sees
                vis = torch.arange(t, device=a.device).view(1, t) < seen           # (w, T)
                lows.append(((a < 1.0 / seen) & vis).sum(0).float())              # (T,)
        self.low = lows if below else None                                         # per layer (T_i,)
        self.ema_mass = emas if decay is not None else None                        # per layer (T_i,)
        return out
