"""What a kvpress press's ``score`` gets under kvlab: what kvpress's own forward hook would hand it.

kvpress hooks each attention module and calls ``score(module, hidden_states, keys, values, attentions,
kwargs)`` with the module, its input ``hidden_states`` ``(B, n, hidden)``, the layer's cache, the layer's
attention weights (``None`` unless attention is eager) and the module's forward kwargs. Under kvlab, for
layer ``l`` at a decision:

* ``module`` — :class:`PressModule`: the decoder's attention module, read-only, plus ``rotary_emb`` (the
  model's rotary embedding, which kvpress's ``press(model)`` attaches to every layer; here it is not attached:
  the proxy answers it). ``isinstance`` checks on it see the module's class. Setting an attribute on it
  raises (a kvlab policy decides; it does not edit the model).
* ``hidden_states`` — the layer inputs the decode loop captured (:mod:`kvlab.cache.inputs`): at the
  prefill decision the whole prompt, exactly kvpress's; at a decode-time decision the last
  ``inputs_window`` forwarded tokens (kvpress's ``DecodingPress`` keeps such a buffer too).
* ``keys`` / ``values`` — the layer's cache, post-RoPE, ``(1, H_kv, T, D)`` (kvlab's own).
* ``attentions`` — ``None`` (what kvpress gets under SDPA), except for a press that needs explicit weights
  (``ObservedAttentionPress``): ``(1, H, m, T)``, softmax of the captured queries over the layer's keys with
  the causal mask by position, computed for that layer (:func:`explicit_attentions`).
* ``kwargs`` — ``hidden_states``, ``position_embeddings`` ``(cos, sin)`` of those tokens, ``cache_position``
  ``(m,)`` and ``position_ids`` ``(1, m)`` (their absolute positions), ``attention_mask=None`` (causal, no
  padding: what the SDPA path passes), and kvlab's own ``layer``, ``positions``, ``step``, ``first``. No
  ``past_key_values``: a press that edits the HF cache object is not a scorer (:mod:`.support`).

``post_init_from_model(model)`` is called once per run, before the prefill (:func:`prepare`).
"""
from __future__ import annotations

import sys

import torch

from kvlab.eviction.kvpress.detect import press_name


class PressModule:
    """A read-only view of an attention module for a press (module docstring)."""

    __slots__ = ("_module", "rotary_emb")

    def __init__(self, module, rotary_emb):
        object.__setattr__(self, "_module", module)
        own = getattr(module, "rotary_emb", None)
        object.__setattr__(self, "rotary_emb", own if own is not None else rotary_emb)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_module"), name)

    @property
    def __class__(self):                    # isinstance(module, Qwen3Attention) in kvpress.utils sees the real class
        return type(object.__getattribute__(self, "_module"))

    def __setattr__(self, name, value):
        raise AttributeError(f"a press may not set module.{name} under kvlab: a policy decides, it does not edit "
                             "the model (a press that stores state on the module is not a scorer kvlab can run)")


def needs_attentions(press) -> bool:
    """The press reads explicit attention weights (kvpress asserts eager attention for it)."""
    from kvpress import ObservedAttentionPress

    inner = getattr(press, "press", None)
    return isinstance(press, ObservedAttentionPress) or (inner is not None and needs_attentions(inner))


def prepare(press, model) -> None:
    """kvpress's ``post_init_from_model(model)``, before the run's first forward; its failure (e.g. a press
    that downloads per-model data, offline) is re-raised as a ValueError naming the press."""
    try:
        press.post_init_from_model(model)
    except Exception as e:      # noqa: BLE001  (any failure of the press's own set-up)
        raise ValueError(f"{press_name(press)}.post_init_from_model failed on {type(model).__name__}: "
                         f"{type(e).__name__}: {e} — a press that downloads per-model data (Q-filters, KVzap, "
                         "query statistics) needs it available offline") from e


@torch.no_grad()
def explicit_attentions(module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_pos: torch.Tensor,
                        keys: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``(1, H, m, T)``: the attention weights of the ``m`` captured queries over the layer's ``T`` keys
    (post-RoPE, GQA-repeated), causal by absolute position — what an eager attention layer outputs."""
    b, m, _ = hidden.shape
    d = module.head_dim
    q = module.q_proj(hidden).view(b, m, -1, d).transpose(1, 2)                     # (1, H, m, D)
    if getattr(module, "q_norm", None) is not None:
        q = module.q_norm(q)
    apply = getattr(sys.modules[type(module).__module__], "apply_rotary_pos_emb")
    q, _ = apply(q, q, cos, sin)
    k = keys.to(q.dtype).repeat_interleave(q.shape[1] // keys.shape[1], dim=1)      # (1, H, T, D)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * float(module.scaling)
    mask = k_pos.view(1, -1).to(q.device) > q_pos.view(-1, 1).to(q.device)        # (m, T) future keys
    s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1).to(hidden.dtype)


def press_inputs(press, view, layer: int, module, keys: torch.Tensor, kwargs: dict):
    """``(module, hidden_states, attentions, kwargs)`` for ``press.score`` on layer ``layer`` of ``view``
    (module docstring)."""
    if view.inputs is None:
        raise ValueError(f"{press_name(press)} needs the attention layers' inputs, but the view has none: the "
                         "decode loop captures them for a policy that says needs_inputs")
    got = view.inputs(layer)
    hidden, (cos, sin), pos = got["hidden_states"], got["position_embeddings"], got["positions"]
    if module is None:
        raise ValueError(f"{press_name(press)} needs the layer's attention module (view.modules)")
    mod = PressModule(module, got.get("rotary_emb"))
    attentions = None
    if needs_attentions(press):
        k_pos = torch.as_tensor(view.layer_positions[layer], dtype=torch.long)
        attentions = explicit_attentions(module, hidden, cos, sin, pos, keys, k_pos)
    kw = dict(kwargs, hidden_states=hidden, position_embeddings=(cos, sin), cache_position=pos,
              position_ids=pos.view(1, -1), attention_mask=None)
    return mod, hidden, attentions, kw
