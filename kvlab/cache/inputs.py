"""The inputs of the decoder's attention layers on a run's forwards (hidden states, RoPE, positions), captured
by removable hooks, for score functions that recompute queries from them (NVIDIA kvpress's presses).
Its hooks sit on a model only while one forward runs; they read the layer inputs and change nothing.

kvpress registers a forward hook on every attention module and hands its press the module's input
``hidden_states`` ``(B, n, hidden)`` and the forward's kwargs (``position_embeddings`` ``(cos, sin)``,
``cache_position``, ...). :class:`LayerInputs` keeps the same per layer for one decoding run (one batch
row): a policy that says ``needs_inputs`` gets one from the decode loop, which wraps the prefill (and,
for a policy that ``needs_decode_inputs``, every decode step) in :func:`capture`. Per layer it holds the
inputs of the last ``window`` forwarded tokens — all of the prompt after the prefill (kvpress's prefill
compression sees exactly that), then the prompt's tail and the decoded tokens — as
``(1, m, hidden)`` hidden states, ``(1, m, D)`` cos / sin and ``(m,)`` absolute positions.

A batched forward (:func:`kvlab.cache.batch.forward_rows`) is captured once for all its rows: ``sinks``
maps a batch row to that row's :class:`LayerInputs`, and each keeps its own row.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Mapping

import torch

from kvlab.cache.attention import attention_modules


class LayerInputs:
    """One run's captured attention-layer inputs (module docstring). ``window``: the most tokens kept per
    layer after a decode step (``None``: all); ``decode``: capture decode steps too (else the prefill only)."""

    def __init__(self, window: int | None = 128, decode: bool = False):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r} must be a positive int (tokens) or None (keep all)")
        self.window, self.decode = window, bool(decode)
        self.hidden: dict[int, torch.Tensor] = {}       # layer -> (1, m, hidden)
        self.cos: dict[int, torch.Tensor] = {}          # layer -> (1, m, D)
        self.sin: dict[int, torch.Tensor] = {}
        self.positions: dict[int, torch.Tensor] = {}    # layer -> (m,) long, absolute positions
        self.rotary_emb = None                          # the model's rotary embedding (rotary_of)

    def add(self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            reset: bool = False) -> None:
        """Append one forward's ``n`` tokens of layer ``layer`` (``reset``: replace what was there, a prefill)."""
        hidden, cos, sin = hidden.detach(), cos.detach(), sin.detach()
        positions = positions.detach().reshape(-1).long()
        if not reset and layer in self.hidden:
            hidden = torch.cat([self.hidden[layer], hidden], dim=1)
            cos = torch.cat([self.cos[layer], cos], dim=1)
            sin = torch.cat([self.sin[layer], sin], dim=1)
            positions = torch.cat([self.positions[layer], positions])
            if self.window is not None and hidden.shape[1] > self.window:
                hidden, cos, sin, positions = hidden[:, -self.window:], cos[:, -self.window:], \
                    sin[:, -self.window:], positions[-self.window:]
        self.hidden[layer], self.cos[layer], self.sin[layer], self.positions[layer] = hidden, cos, sin, positions

    def layer(self, layer: int) -> dict:
        """Layer ``layer``'s inputs: ``hidden_states`` ``(1, m, hidden)``, ``position_embeddings``
        ``(cos, sin)`` each ``(1, m, D)``, ``positions`` ``(m,)``. KeyError naming the layer when none
        were captured."""
        if layer not in self.hidden:
            raise KeyError(f"layer {layer}: no attention-layer inputs were captured (the decode loop captures "
                           "them for a policy that says needs_inputs)")
        return {"hidden_states": self.hidden[layer], "position_embeddings": (self.cos[layer], self.sin[layer]),
                "positions": self.positions[layer], "rotary_emb": self.rotary_emb}

    def __len__(self) -> int:
        """Tokens held (layer 0's)."""
        return int(self.hidden[0].shape[1]) if 0 in self.hidden else 0


def rotary_of(model):
    """The model's rotary embedding, where kvpress's ``press(model)`` finds it (``model.model.rotary_emb``, or
    the language model's in a multimodal wrapper); None when it has none."""
    base = getattr(model, "model", model)
    base = getattr(base, "language_model", base)
    return getattr(base, "rotary_emb", None)


@contextmanager
def _hooks(model, sinks: Mapping[int, LayerInputs], reset: bool):
    """Forward pre-hooks on every attention module of ``model`` for one forward; removed on exit."""
    handles = []
    rotary = rotary_of(model)
    for inp in sinks.values():
        inp.rotary_emb = rotary

    def hook_for(i):
        def hook(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            pe = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
            if hidden is None or pe is None:
                raise RuntimeError(f"layer {i}: the attention module got no hidden_states / position_embeddings "
                                   "(a model whose attention takes neither cannot feed kvpress-style scorers)")
            pos = kwargs.get("position_ids")
            if pos is None:
                pos = kwargs.get("cache_position")
            if pos is None:
                raise RuntimeError(f"layer {i}: the attention module got neither position_ids nor cache_position")
            cos, sin = pe
            for b, inp in sinks.items():
                row = slice(b, b + 1)
                p = pos[b] if pos.dim() > 1 and pos.shape[0] > 1 else pos.reshape(-1)
                inp.add(i, hidden[row], cos[row] if cos.shape[0] > 1 else cos, sin[row] if sin.shape[0] > 1 else sin,
                        p, reset=reset)
        return hook

    try:
        for m in attention_modules(model):
            handles.append(m.register_forward_pre_hook(hook_for(m.layer_idx), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def capture(inputs: LayerInputs | None, model, prefill: bool):
    """The context one forward of the decode loop runs in: hooks feeding ``inputs`` (batch row 0) on a
    prefill, and on a decode step when ``inputs.decode``; a no-op context otherwise (``inputs`` None)."""
    if inputs is None or not (prefill or inputs.decode):
        return nullcontext()
    return _hooks(model, {0: inputs}, reset=prefill)


def capture_rows(sinks: Mapping[int, LayerInputs | None], model):
    """The context of one batched decode step: ``sinks[b]`` (batch row ``b``'s inputs, or None) gets row ``b``."""
    live = {b: x for b, x in sinks.items() if x is not None and x.decode}
    return _hooks(model, live, reset=False) if live else nullcontext()
