"""The student's training forward for each variant, and the loss (CE on the teacher's response + KL).
Forwards and losses in memory; it writes nothing.

* ``standalone``: the student runs over prompt + response itself; loss on the response tokens
  (its logits at positions ``P-1 … P+R-2`` predict ``response[0 … R-1]``).
* ``overfill``: the FROZEN teacher prefills the prompt into a :class:`kvlab.cache.KVCache` (writer
  ``T``); the student runs over ``response[:-1]`` on top of that cache, position ids continuing at
  ``P`` (OverFill's ``TwoStageModel.forward`` with ``freeze_strategy: teacher``); the loss is on
  ``response[1:]`` (``response[0]`` is the teacher's first token, as at decode time).
* ``refresh-aware``: as ``overfill``, and at random refresh points every entry written since the
  previous refresh is replaced by the teacher's K/V of the same tokens (what a ``Periodic(T)``
  refresh does at decode time): the student learns to read teacher K/V mid-response.

Teacher K/V are read through ``KVCache.kv(layer)`` and copied into a ``DynamicCache`` whose layers
(:class:`SplicedLayer`) splice teacher entries into the student's fresh K/V, so gradients flow
only into the student. The teacher is only ever run under ``inference_mode``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer
from kvlab.core.compat import cache_kwarg, output_cache
from kvlab.train.lora import plain_model

VARIANTS_TRAINED = ("standalone", "overfill", "refresh-aware")


class SplicedLayer(DynamicLayer):
    """A cache layer holding teacher prompt K/V; ``update`` replaces the new (student) K/V at the
    masked positions by the teacher's K/V for those positions before appending."""

    def __init__(self, keys, values, splice_keys=None, splice_values=None, mask=None):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values                # (1, H_kv, P, D)
        self.splice = None if mask is None or not bool(mask.any()) else (splice_keys, splice_values, mask)

    def update(self, key_states, value_states, *args, **kwargs):
        if self.splice is not None:
            sk, sv, mask = self.splice                       # (1, H_kv, n, D) ×2, (n,) bool
            m = mask.view(1, 1, -1, 1)
            key_states = torch.where(m, sk.to(key_states.dtype), key_states)
            value_states = torch.where(m, sv.to(value_states.dtype), value_states)
        return super().update(key_states, value_states, *args, **kwargs)


def teacher_cache(teacher, ids):
    """The frozen teacher's prefill of ``ids`` as a kvlab cache (every entry written by ``T``)."""
    from kvlab.cache import KVCache

    with torch.inference_mode():
        cache, _ = KVCache.prefill(teacher.model, list(ids), writer="T")
    return cache


def spliced_cache(tcache, n_prompt: int, mask: torch.Tensor | None = None) -> DynamicCache:
    """A grad-mode ``DynamicCache``: the first ``n_prompt`` entries of ``tcache`` (copied out of
    inference mode), and, where ``mask`` is set, the teacher's entries ``n_prompt + j`` spliced over the
    student's own K/V of response input ``j``."""
    layers = []
    for i in range(tcache.num_layers):
        k, v = tcache.kv(i)                                                          # (1, H_kv, T, D)
        kp, vp = k[:, :, :n_prompt], v[:, :, :n_prompt]   # kv() returns copies (normal tensors)
        if mask is not None:
            n = mask.numel()
            sk, sv = k[:, :, n_prompt:n_prompt + n], v[:, :, n_prompt:n_prompt + n]
            layers.append(SplicedLayer(kp, vp, sk, sv, mask))
        else:
            layers.append(SplicedLayer(kp, vp))
    cache = DynamicCache()
    cache.layers = layers
    return cache


def refresh_mask(n: int, rng: random.Random, gap: tuple[int, int], p_none: float) -> torch.Tensor:
    """Response inputs whose K/V are teacher-written: with probability ``1 - p_none`` refresh points
    fall every ``U[gap]`` steps and each refresh rewrites everything since the previous one."""
    mask = torch.zeros(n, dtype=torch.bool)
    if n < 2 or rng.random() < p_none:
        return mask
    r = rng.randint(*gap)
    while r < n:
        mask[:r] = True
        r += rng.randint(*gap)
    return mask


@dataclass
class Forward:
    logits: torch.Tensor        # (n, V) student logits
    targets: torch.Tensor       # (n,) token ids they predict
    rows: torch.Tensor          # (n,) rows of the example's teacher top-k arrays for those targets
    positions: torch.Tensor     # (n,) position ids the student ran at
    cache: object               # the DynamicCache after the forward (teacher prefix + student entries)
    n_prompt: int
    mask: torch.Tensor | None   # teacher-spliced response inputs (refresh-aware)


def student_forward(student, teacher, ex, variant: str, rng: random.Random | None = None, *,
                    gap=(16, 64), p_none: float = 0.5) -> Forward:
    """Run the student's training forward for ``variant`` on one example (see module doc)."""
    dev = student.device
    prompt, resp = list(ex.prompt_ids), list(ex.response_ids)
    P, R = len(prompt), len(resp)
    if variant == "standalone":
        ids = torch.tensor([prompt + resp[:-1]], device=dev)                               # (1, P+R-1)
        pos = torch.arange(P + R - 1, device=dev).view(1, -1)
        out = student.model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=R)
        return Forward(out.logits[0], torch.tensor(resp, device=dev), torch.arange(R, device=dev),
                       pos[0, P - 1:], output_cache(out), 0, None)
    if variant not in ("overfill", "refresh-aware"):
        raise ValueError(f"variant={variant!r} must be one of {VARIANTS_TRAINED}")
    if R < 2:
        raise ValueError(f"example {ex.id!r}: an overfill forward needs a response of ≥ 2 tokens")
    inputs = resp[:-1]
    mask = None
    if variant == "refresh-aware":
        mask = refresh_mask(len(inputs), rng or random.Random(0), gap, p_none)
    tcache = teacher_cache(teacher, prompt + (inputs if mask is not None and mask.any() else []))
    cache = spliced_cache(tcache, P, mask)
    pos = torch.arange(P, P + R - 1, device=dev).view(1, -1)                               # (1, R-1)
    out = student.model(input_ids=torch.tensor([inputs], device=dev), position_ids=pos,
                        **{cache_kwarg(plain_model(student.model)): cache}, use_cache=True)
    return Forward(out.logits[0], torch.tensor(resp[1:], device=dev), torch.arange(1, R, device=dev),
                   pos[0], cache, P, mask)


def token_losses(fw: Forward, ex) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (CE on the teacher's tokens, KL(p_T ‖ q) over the teacher's top-k + one tail bucket). # (n,), (n,)"""
    logq = fw.logits.float().log_softmax(-1)                                               # (n, V)
    ce = -logq.gather(1, fw.targets.view(-1, 1)).squeeze(1)
    idx = ex.topk_idx[fw.rows.cpu()].to(logq.device)                                       # (n, k)
    logp = ex.topk_logp[fw.rows.cpu()].to(logq.device)                                     # (n, k)
    logq_k = logq.gather(1, idx)
    p = logp.exp()
    p_tail = (1 - p.sum(-1)).clamp_min(1e-8)
    q_tail = (1 - logq_k.exp().sum(-1)).clamp_min(1e-8)
    kl = (p * (logp - logq_k)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    return ce, kl
