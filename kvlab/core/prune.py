"""Minitron/OverFill-style width pruning: the embedded student's shape.
Works on a model in memory: it reads calibration activations through forward hooks it removes again and prunes
the model in place; saving it is the caller's (kvlab.core.models.pruned_student_path).

A :class:`PruneShape` removes a fraction of the MLP intermediate channels (``i``) and of the hidden
(embedding) channels (``h``), e.g. ``h0.45,i0.45`` — OverFill's ``pruned-h0.45-i0.45``. Importance is
activation magnitude over the calibration prompts (``data/calibration.jsonl``):

* MLP channel: mean ``|act(gate(x)) * up(x)|`` (the input of ``down_proj``), per layer;
* hidden channel: mean ``|RMSNorm output|`` summed over every norm of the model (Minitron's rule).

Every layer keeps the same number of channels, so the pruned model is an ordinary Llama config
(the kept hidden width is rounded to a multiple of the attention head count, which transformers
requires: h0.45 of SmolLM2's 576 keeps 315).
Attention heads, ``head_dim`` and the q/k/v output sizes are never touched (only their input size
shrinks with the hidden width), so the KV geometry stays the teacher's and teacher K/V can be
spliced into the student's cache (``kvlab.core.compat.kv_compat`` is clean). This module imports nothing
from :mod:`kvlab.core.models`; the cached student folder is built by ``kvlab.core.models.pruned_student_path``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PruneShape:
    """Fractions of hidden (``hidden``) and MLP intermediate (``inter``) channels removed, each in [0, 1)."""

    hidden: float = 0.0
    inter: float = 0.0

    def __post_init__(self):
        for name, v in (("hidden", self.hidden), ("inter", self.inter)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0.0 <= v < 1.0:
                raise ValueError(f"--prune: {name} ratio={v!r} must be in [0, 1) (the fraction of channels removed), "
                                 "e.g. --prune h0.45,i0.45")
        object.__setattr__(self, "hidden", round(float(self.hidden), 4))
        object.__setattr__(self, "inter", round(float(self.inter), 4))

    @property
    def label(self) -> str:
        """``h0.45-i0.45``; a shape without hidden pruning keeps the old name ``i0.30``."""
        return (f"h{self.hidden:.2f}-" if self.hidden else "") + f"i{self.inter:.2f}"

    @property
    def flag(self) -> str:
        return self.label.replace("-", ",")

    @classmethod
    def parse(cls, spec) -> "PruneShape":
        """``"h0.45,i0.45"``, ``"i0.3"``, ``"h0.25"``, a bare number (= MLP ratio), or a PruneShape."""
        if isinstance(spec, PruneShape):
            return spec
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(0.0, float(spec))
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"--prune={spec!r} must look like 'h0.45,i0.45' (h: hidden, i: MLP intermediate ratio)")
        vals = {"h": 0.0, "i": 0.0}
        for part in re.split(r"[,\-\s]+", spec.strip()):
            m = re.fullmatch(r"([hi]?)([0-9]*\.?[0-9]+)", part)
            if not m:
                raise ValueError(f"--prune={spec!r}: cannot read {part!r}; use e.g. 'h0.45,i0.45' or 'i0.3'")
            vals[m.group(1) or "i"] = float(m.group(2))
        return cls(vals["h"], vals["i"])


def _norms(model) -> list:
    layers = model.model.layers
    return [n for layer in layers for n in (layer.input_layernorm, layer.post_attention_layernorm)] + [model.model.norm]


def importance(lm, prompts: list[str], norm_sq: list | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(hidden-channel importance ``(H,)``, per-layer MLP-channel importance ``[(I,)] * L``) over ``prompts``.

    If ``norm_sq`` is a list, it receives every norm's mean squared input per channel ``(H,)`` (for
    :func:`prune_hidden`'s RMS correction)."""
    model = lm.model
    layers = model.model.layers
    mlp = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64) for layer in layers]
    hid = torch.zeros(model.config.hidden_size, dtype=torch.float64)
    count = 0
    handles = []

    def mlp_hook(i):
        def fn(module, args):
            mlp[i].add_(args[0].detach().float().abs().sum(dim=(0, 1)).double().cpu())   # (B, T, I) → (I,)
        return fn

    norms = _norms(model)
    sq = [torch.zeros(model.config.hidden_size, dtype=torch.float64) for _ in norms]

    def norm_hook(i):
        def fn(module, args, out):
            hid.add_(out.detach().float().abs().sum(dim=(0, 1)).double().cpu())           # (B, T, H) → (H,)
            sq[i].add_(args[0].detach().float().pow(2).sum(dim=(0, 1)).double().cpu())
        return fn

    try:
        for i, layer in enumerate(layers):
            handles.append(layer.mlp.down_proj.register_forward_pre_hook(mlp_hook(i)))
        for i, norm in enumerate(norms):
            handles.append(norm.register_forward_hook(norm_hook(i)))
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([lm.encode_prompt(p)], device=lm.device)
                model(input_ids=ids, use_cache=False)
                count += ids.shape[1]
    finally:
        for h in handles:
            h.remove()
    if norm_sq is not None:
        norm_sq[:] = [q / max(count, 1) for q in sq]
    return hid / max(count, 1), [s / max(count, 1) for s in mlp]


def mlp_importance(lm, prompts: list[str]) -> list[torch.Tensor]:
    """Per layer, mean |activation| of every MLP intermediate channel over ``prompts``. # [(I,)] * L"""
    return importance(lm, prompts)[1]


def _linear(old, rows=None, cols=None):
    import torch.nn as nn

    w = old.weight
    w = w[rows] if rows is not None else w
    w = w[:, cols] if cols is not None else w
    new = nn.Linear(w.shape[1], w.shape[0], bias=old.bias is not None, dtype=w.dtype, device=w.device)
    new.weight.copy_(w)
    if old.bias is not None:
        new.bias.copy_(old.bias[rows] if rows is not None else old.bias)
    return new


@torch.no_grad()
def prune_mlp(model, keep: list[torch.Tensor]) -> None:
    """Slice every layer's gate/up rows and down columns to ``keep[i]`` (sorted indices), in place."""
    sizes = {len(k) for k in keep}
    if len(sizes) != 1:
        raise ValueError("keep: every layer must keep the same number of channels")
    for layer, idx in zip(model.model.layers, keep):
        mlp = layer.mlp
        mlp.gate_proj = _linear(mlp.gate_proj, rows=idx)
        mlp.up_proj = _linear(mlp.up_proj, rows=idx)
        mlp.down_proj = _linear(mlp.down_proj, cols=idx)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = len(idx)
    model.config.intermediate_size = sizes.pop()


@torch.no_grad()
def prune_hidden(model, idx: torch.Tensor, norm_sq: list | None = None) -> None:
    """Keep hidden channels ``idx`` (sorted) everywhere: embeddings (and the tied LM head), every norm,
    the input columns of q/k/v/gate/up and the output rows of o/down. q/k/v output sizes, heads and
    ``head_dim`` are unchanged (the KV geometry is kept).

    ``norm_sq`` (per norm, mean squared input per channel over calibration text): each RMSNorm's weight is
    scaled by ``sqrt(mean_kept / mean_all)``, so a kept channel is normalised by about the RMS it had
    before the other channels were removed (without it, RMSNorm over the kept, larger channels shrinks
    every output)."""
    import torch.nn as nn

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.head_dim = head_dim   # explicit: it no longer equals hidden_size / heads
    emb = model.model.embed_tokens
    new_emb = nn.Embedding(emb.num_embeddings, len(idx), padding_idx=emb.padding_idx,
                           dtype=emb.weight.dtype, device=emb.weight.device)
    new_emb.weight.copy_(emb.weight[:, idx])
    model.model.embed_tokens = new_emb
    for i, norm in enumerate(_norms(model)):
        w = norm.weight[idx].clone()
        if norm_sq is not None:
            q = norm_sq[i]
            w = w * float((q[idx].mean() / q.mean()).sqrt())
        norm.weight = nn.Parameter(w)
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        att.q_proj, att.k_proj, att.v_proj = (_linear(p, cols=idx) for p in (att.q_proj, att.k_proj, att.v_proj))
        att.o_proj = _linear(att.o_proj, rows=idx)
        mlp.gate_proj, mlp.up_proj = _linear(mlp.gate_proj, cols=idx), _linear(mlp.up_proj, cols=idx)
        mlp.down_proj = _linear(mlp.down_proj, rows=idx)
        if hasattr(mlp, "hidden_size"):
            mlp.hidden_size = len(idx)
        if hasattr(att, "hidden_size"):
            att.hidden_size = len(idx)
    if getattr(cfg, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        model.lm_head = _linear(model.lm_head, cols=idx)
    cfg.hidden_size = len(idx)


def prune_lm(lm, shape, prompts: list[str]):
    """Prune ``lm`` in place to ``shape`` (a :class:`PruneShape`, its string, or a bare MLP ratio)."""
    shape = PruneShape.parse(shape)
    norm_sq: list = []
    hid, mlp = importance(lm, prompts, norm_sq)
    if shape.inter:
        n_keep = max(1, round(len(mlp[0]) * (1.0 - shape.inter)))
        prune_mlp(lm.model, [torch.sort(torch.topk(s, n_keep).indices).values for s in mlp])
    if shape.hidden:
        heads = lm.model.config.num_attention_heads   # transformers wants hidden_size % heads == 0
        n_keep = max(heads, heads * round(len(hid) * (1.0 - shape.hidden) / heads))
        prune_hidden(lm.model, torch.sort(torch.topk(hid, n_keep).indices).values, norm_sq)
    return lm
