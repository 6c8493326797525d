"""An explicit forward of a Llama-family model for the batched step (gpt-fast's shape: the layers written out).
Part of the cache module: it writes new keys and values only through the step cache's own ``update`` and attends
through the ``"kvlab"`` attention function (:mod:`.attn_fn`), exactly as the model's own forward does.

Why: at batch 8 a CPU decode step of the embedded teacher spends most of its time in the small-``M`` weight
products, which ``F.linear`` runs at half the memory bandwidth that MKL's packed GEMM reaches
(:mod:`kvlab.core.packed`). This forward computes what ``LlamaForCausalLM.forward`` computes — embedding, per layer
``x += o(attn(rope(q), rope(k), v))`` and ``x += down(silu(gate) · up)`` after RMS norms, a final norm and the
head on the kept positions — with q/k/v and gate/up each as one matrix, RoPE applied to queries and keys in one
op, and every product through a :class:`~kvlab.core.packed.PackedLinear`. Logits equal the model's forward within
float rounding (tests/test_explicit_step.py); on CUDA or in bf16 the products are ``F.linear`` (fewer launches).

:func:`explicit_step` builds it once per model (and again when any parameter changes: training, ``.to``),
or returns None when the model is not one it computes exactly; the caller then runs the model's own forward.
Supported: every decoder layer holds exactly ``self_attn`` (``q/k/v/o_proj``, no bias), ``mlp`` (``gate/up/down``,
no bias, SiLU) and two RMS norms (checked on a probe), full attention on every layer, eval mode, and no forward
hook on any of the model's modules (hooks see only the model's own forward: the decode loop's layer-input capture
for kvpress's presses runs that).
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from kvlab.cache.attn_fn import kvlab_attention
from kvlab.core.packed import PackedLinear

_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj", "act_fn"}
_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_STEPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _linear(mod) -> bool:
    return isinstance(mod, torch.nn.Linear) and mod.bias is None


def _rms(norm, width: int) -> float | None:
    """The norm's epsilon when ``norm`` computes ``weight · x / rms(x)`` (checked on a probe), else None."""
    eps, w = getattr(norm, "variance_epsilon", None), getattr(norm, "weight", None)
    if eps is None or not isinstance(w, torch.Tensor) or tuple(w.shape) != (width,):
        return None
    x = torch.linspace(-2.0, 3.0, width, device=w.device, dtype=w.dtype).view(1, width)
    ok = torch.allclose(norm(x).float(), F.rms_norm(x, (width,), w, float(eps)).float(), rtol=1e-2, atol=1e-3)
    return float(eps) if ok else None


def unsupported(model) -> str | None:
    """Why :class:`LlamaStep` cannot compute ``model``'s forward exactly (None: it can)."""
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if model.training:
        return "the model is in training mode (dropout)"
    if base is None or not _linear(head) or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm",
                                                                              "rotary_emb")):
        return "not a decoder with model.{embed_tokens, layers, norm, rotary_emb} and an unbiased lm_head"
    cfg = model.config
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])) or \
            getattr(cfg, "sliding_window", None) is not None or getattr(cfg, "attn_logit_softcapping", None):
        return "not full attention on every layer"
    width = cfg.hidden_size
    probe = torch.linspace(-4.0, 4.0, 64, device=head.weight.device, dtype=head.weight.dtype)
    for i, lay in enumerate(base.layers):
        kids = {n for n, _ in lay.named_children()}
        attn, mlp = getattr(lay, "self_attn", None), getattr(lay, "mlp", None)
        if kids != _LAYER or {n for n, _ in attn.named_children()} != _ATTN or \
                {n for n, _ in mlp.named_children()} != _MLP:
            return f"layer {i} is not (self_attn: q/k/v/o_proj, mlp: gate/up/down_proj + act_fn, two norms)"
        if not all(_linear(getattr(attn, n)) for n in _ATTN) or \
                not all(_linear(getattr(mlp, n)) for n in _MLP - {"act_fn"}):
            return f"layer {i} has a biased or non-Linear projection"
        if not torch.allclose(mlp.act_fn(probe), F.silu(probe)):
            return f"layer {i}'s activation is not SiLU"
        if _rms(lay.input_layernorm, width) is None or _rms(lay.post_attention_layernorm, width) is None:
            return f"layer {i}'s norms are not RMS norms"
    if _rms(base.norm, width) is None:
        return "the final norm is not an RMS norm"
    return None


class _Layer:
    def __init__(self, lay):
        a, m = lay.self_attn, lay.mlp
        self.module = a                                  # what the attention function reads: layer_idx, scaling, …
        self.qkv = PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))   # (H·D + 2·H_kv·D, C)
        self.o = PackedLinear(a.o_proj.weight)
        self.gate_up = PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]))             # (2·I, C)
        self.down = PackedLinear(m.down_proj.weight)
        self.inter = m.gate_proj.weight.shape[0]
        # the norms are RMS norms with these epsilons: unsupported() checked each on a probe
        self.n1, self.eps1 = lay.input_layernorm.weight, float(lay.input_layernorm.variance_epsilon)
        self.n2, self.eps2 = lay.post_attention_layernorm.weight, float(lay.post_attention_layernorm.variance_epsilon)


class LlamaStep:
    """The model's forward written out (see the module docstring). Build with :func:`explicit_step`."""

    def __init__(self, model):
        base, cfg = model.model, model.config
        self.width = cfg.hidden_size
        a0 = base.layers[0].self_attn
        self.head_dim = a0.head_dim
        self.heads = a0.q_proj.weight.shape[0] // self.head_dim
        self.kv_heads = a0.k_proj.weight.shape[0] // self.head_dim
        with torch.no_grad():
            self.layers = [_Layer(lay) for lay in base.layers]
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.norm, self.eps = base.norm.weight, float(base.norm.variance_epsilon)     # checked: unsupported()
        self.head = PackedLinear(model.lm_head.weight)
        self.params = list(model.parameters())
        self.root = weakref.ref(model)   # the step never holds the model itself: _STEPS's entry dies with it
        self.modules = [m for m in model.modules() if m is not model]
        self.key = _weights_key(self.params)

    def hooked(self) -> bool:
        """A forward hook sits on the model (a capture of layer inputs, kvpress's press hooks, a user's): only the
        model's own forward runs it."""
        from torch.nn.modules import module as nn_module
        root = self.root()
        hooked = lambda m: bool(m._forward_hooks or m._forward_pre_hooks)  # noqa: E731
        return bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks) or \
            (root is not None and hooked(root)) or any(map(hooked, self.modules))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, logits_to_keep=1,
                 **attn_kwargs) -> torch.Tensor:
        """Logits ``(B, k, V)`` of ``input_ids`` ``(B, n)`` at ``position_ids`` ``(B, n)`` over ``cache`` (its
        ``layers[i].update(k, v)`` stores and returns layer ``i``'s keys and values); ``logits_to_keep`` as the
        model's forward takes it (an int: the last that many; a tensor: those positions); ``attn_kwargs`` go to
        the attention function (masks, mass sink, query sink)."""
        b, n = input_ids.shape
        h, hkv, d = self.heads, self.kv_heads, self.head_dim
        x = self.embed(input_ids)                                                       # (B, n, C)
        cos, sin = self.rotary(x, position_ids)                                         # (B, n, D)
        cos, sin = cos[:, None], sin[:, None]                                           # (B, 1, n, D)
        half = d // 2
        for i, lay in enumerate(self.layers):
            y = F.rms_norm(x, (self.width,), lay.n1, lay.eps1)
            qkv = lay.qkv(y).view(b, n, h + 2 * hkv, d).transpose(1, 2)                 # (B, H + 2·H_kv, n, D)
            qk, v = qkv[:, :h + hkv], qkv[:, h + hkv:]                                  # v: (B, H_kv, n, D)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), -1) * sin      # RoPE on q and k at once
            keys, values = cache.layers[i].update(qk[:, h:], v)                         # (B, H_kv, T, D)
            o, _ = kvlab_attention(lay.module, qk[:, :h], keys, values, None, dropout=0.0,
                                   scaling=lay.module.scaling, **attn_kwargs)          # (B, n, H, D)
            x = x + lay.o(o.reshape(b, n, h * d))
            y = F.rms_norm(x, (self.width,), lay.n2, lay.eps2)
            gu = lay.gate_up(y)                                                         # (B, n, 2·I)
            x = x + lay.down(F.silu(gu[..., :lay.inter]) * gu[..., lay.inter:])
        if isinstance(logits_to_keep, int):
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        else:
            x = x[:, logits_to_keep]
        return self.head(F.rms_norm(x, (self.width,), self.norm, self.eps))             # (B, k, V)


def _weights_key(params) -> tuple:
    """Changes whenever a parameter's tensor is replaced or edited in place (optimizer steps, ``.to``, loading;
    an inference tensor keeps no version counter: only its replacement is seen)."""
    return tuple((p.data_ptr(), -1 if p.is_inference() else p._version) for p in params)


def explicit_step(model) -> LlamaStep | None:
    """``model``'s :class:`LlamaStep` (built on first use and whenever its weights changed), or None when
    :func:`unsupported` names a reason or a forward hook sits on the model (then run the model's own forward)."""
    if model.training:
        return None
    got = _STEPS.get(model)
    if got is not None and (got is False or got.key == _weights_key(got.params)):
        return None if got is False or got.hooked() else got
    if unsupported(model) is not None:
        _STEPS[model] = False
        return None
    step = LlamaStep(model)
    _STEPS[model] = step
    return None if step.hooked() else step
