"""The ``"kvlab"`` attention function: every layer attends over its OWN cached keys (per-layer live sets).
Registered through transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` (no forward is patched); it
reads a layer's keys and values and writes nothing.

transformers builds one attention mask per forward, sized from layer 0's cache length
(``masking_utils.create_causal_mask`` asks ``past_key_values.get_mask_sizes(q_len, 0)``), and
every layer gets it. When layers hold different numbers of entries (per-layer eviction), that
mask has the wrong width on the other layers. This function, registered through transformers'
``AttentionInterface`` (no attention forward is patched), takes the layer's own K/V length ``T``
and the ``n`` new queries and:

* uses the mask transformers built when its width is ``T`` (then it is this layer's mask);
* otherwise builds the layer's own: a one-token step needs none; ``n > 1`` queries get a causal
  mask aligned to the bottom right (query ``i`` sees keys ``0 .. T - n + i``: everything cached
  before it plus the new tokens up to itself);

then runs transformers' own SDPA attention. The mask function registered for ``"kvlab"`` is SDPA's,
so a model switched to ``"kvlab"`` computes exactly what it did under ``"sdpa"`` whenever all layers
are the same length. A forward that measures attention mass passes a :class:`~kvlab.cache.mass.MassSink` as its
``kvlab_mass`` kwarg: a decode step's attention is then computed once, eagerly, and its head-mean probabilities go
to the sink beside the output (:mod:`.mass`; no second Q·Kᵀ pass, no hooks); a deferred step passes a
:class:`~kvlab.cache.deferred.QuerySink` as ``kvlab_queries``, which keeps each layer's query (:mod:`.deferred`). A batched step (:func:`kvlab.cache.batch.forward_rows`) passes every layer's
per-row mask ``(B, 1, 1, T)`` (padding and causal: True on the row's own columns) as the forward's
``kvlab_masks`` kwarg; it is used as given, and its one-token steps attend through SDPA or two plain products
(:mod:`kvlab.core.decode_attn`, :data:`~kvlab.core.decode_attn.DECODE`: SDPA unless asked). Building its own mask assumes one unpadded sequence per batch row, which is
what a :class:`~kvlab.cache.KVCache` holds (batch 1, or the probe's identical copies).

:func:`use` registers the function (first call only; nothing happens at import) and switches a
model to it with ``model.set_attn_implementation``.
"""
from __future__ import annotations

import torch

from kvlab.cache import deferred, mass
from kvlab.core import decode_attn

NAME = "kvlab"


def causal_mask(n: int, t: int, device) -> torch.Tensor:
    """Bool ``(1, 1, n, t)``, True = attend: query ``i`` sees keys ``j <= t - n + i`` (bottom right)."""
    qi = torch.arange(n, device=device).view(n, 1) + (t - n)
    kj = torch.arange(t, device=device).view(1, t)
    return (kj <= qi).view(1, 1, n, t)


def kvlab_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, **kwargs):
    """``query`` (B, H, n, D), ``key``/``value`` (B, H_kv, T, D) -> transformers' SDPA attention with
    this layer's own causal mask (see the module docstring). ``dropout`` is named (transformers passes it as a
    keyword; a wrapper such as kvpress's, installed at ``import kvpress``, passes it positionally)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masks = kwargs.pop("kvlab_masks", None)
    sink = kwargs.pop(mass.KWARG, None)
    queries = kwargs.pop(deferred.KWARG, None)
    if queries is not None:                 # a deferred step keeps its queries (kvlab.cache.deferred)
        queries.take(module.layer_idx, query, kwargs.get("scaling"))
    n, t = query.shape[2], key.shape[2]
    if masks is not None:                   # a batched step (kvlab.cache.batch): each row's own columns
        attention_mask = masks[module.layer_idx]                                          # (B, 1, 1, T)
    elif attention_mask is None or attention_mask.shape[-1] != t:
        if n > t:
            raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: {n} queries over {t} keys; the cache lost "
                             "entries of this forward")
        attention_mask = causal_mask(n, t, query.device) if n > 1 and t > n else None
    if sink is not None:                    # attention mass measured by this same computation (kvlab.cache.mass)
        if n == 1 and not dropout:
            return mass.decode_attention(module, query, key, value, attention_mask, kwargs.get("scaling"), sink)
        mass.window_mass(module, query, key, attention_mask, kwargs.get("scaling"), sink)
    elif masks is not None and n == 1 and not dropout and decode_attn.choice(query, key) == "eager":
        return decode_attn.eager(query, key, value, attention_mask, kwargs.get("scaling"))[0], None   # (B, 1, H, D)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, **kwargs)


def register() -> None:
    """Register ``"kvlab"`` with transformers' attention and mask interfaces (idempotent)."""
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    if AttentionInterface._global_mapping.get(NAME) is not kvlab_attention:
        AttentionInterface.register(NAME, kvlab_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)


def use(model) -> None:
    """Switch ``model`` to the ``"kvlab"`` attention function (a no-op when it already runs it)."""
    if getattr(model.config, "_attn_implementation", None) == NAME:
        return
    register()
    model.set_attn_implementation(NAME)
    if getattr(model.config, "_attn_implementation", None) != NAME:
        raise ValueError(f"{type(model).__name__} cannot switch to the {NAME!r} attention function (it does not "
                         "dispatch through transformers' AttentionInterface); per-layer live sets need it")
