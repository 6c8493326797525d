"""Minitron/OverFill-style width pruning of the MLP: the embedded student.

Channel importance is the mean absolute activation of each MLP intermediate channel
(``act(gate(x)) * up(x)``, the input of ``down_proj``) over the calibration prompts in
``data/calibration.jsonl``. Every layer keeps the same number of top channels, so the pruned
model is an ordinary Llama config with a smaller ``intermediate_size``. Attention heads, k/v
projections, hidden size and layer count are never touched: the KV geometry stays the teacher's.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from .data import calibration_file, load_prompts


def _check_ratio(ratio: float) -> float:
    if not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise ValueError(f"ratio={ratio!r} must be in [0, 1): the fraction of MLP channels to remove")
    return float(ratio)


def mlp_importance(lm, prompts: list[str]) -> list[torch.Tensor]:
    """Per layer, mean |activation| of every MLP intermediate channel over ``prompts``. # [(I,)] * L"""
    layers = lm.model.model.layers
    sums = [torch.zeros(layer.mlp.down_proj.in_features, dtype=torch.float64) for layer in layers]
    count = 0
    handles = []

    def hook(i):
        def fn(module, args):
            x = args[0].detach().float()  # (B, T, I)
            sums[i] += x.abs().sum(dim=(0, 1)).double().cpu()
        return fn

    try:
        for i, layer in enumerate(layers):
            handles.append(layer.mlp.down_proj.register_forward_pre_hook(hook(i)))
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([lm.encode_prompt(p)], device=lm.device)
                lm.model(input_ids=ids, use_cache=False)
                count += ids.shape[1]
    finally:
        for h in handles:
            h.remove()
    return [s / max(count, 1) for s in sums]


@torch.no_grad()
def prune_mlp(model, keep: list[torch.Tensor]) -> None:
    """Slice every layer's gate/up rows and down columns to ``keep[i]`` (sorted indices), in place."""
    import torch.nn as nn

    sizes = {len(k) for k in keep}
    if len(sizes) != 1:
        raise ValueError("keep: every layer must keep the same number of channels")
    for layer, idx in zip(model.model.layers, keep):
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            new = nn.Linear(old.in_features, len(idx), bias=old.bias is not None,
                            dtype=old.weight.dtype, device=old.weight.device)
            new.weight.copy_(old.weight[idx])
            if old.bias is not None:
                new.bias.copy_(old.bias[idx])
            setattr(mlp, name, new)
        old = mlp.down_proj
        new = nn.Linear(len(idx), old.out_features, bias=old.bias is not None,
                        dtype=old.weight.dtype, device=old.weight.device)
        new.weight.copy_(old.weight[:, idx])
        if old.bias is not None:
            new.bias.copy_(old.bias)
        mlp.down_proj = new
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = len(idx)
    model.config.intermediate_size = sizes.pop()


def prune_lm(lm, ratio: float, prompts: list[str]):
    """Prune ``lm`` in place: remove ``ratio`` of MLP intermediate channels by activation importance."""
    ratio = _check_ratio(ratio)
    scores = mlp_importance(lm, prompts)
    n_keep = max(1, round(len(scores[0]) * (1.0 - ratio)))
    keep = [torch.sort(torch.topk(s, n_keep).indices).values for s in scores]
    prune_mlp(lm.model, keep)
    return lm


def student_path(ratio: float) -> Path:
    """Cached safetensors folder of the embedded student for ``ratio`` (built on first use)."""
    from .models import TEACHER_NAME, _atomic_save, cache_dir, load_model, teacher_path

    ratio = _check_ratio(ratio)
    calib = calibration_file()
    digest = hashlib.sha256(calib.read_bytes()).hexdigest()[:8]
    target = cache_dir() / "models" / f"{TEACHER_NAME}-pruned-i{ratio:.2f}-c{digest}"
    if (target / "config.json").is_file():
        return target

    def write(tmp: Path) -> None:
        lm = load_model(teacher_path(), device="cpu", dtype=torch.float32, local_files_only=True)
        prune_lm(lm, ratio, [r["prompt"] for r in load_prompts(calib)])
        lm.model.config.name_or_path = target.name
        lm.model.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)

    _atomic_save(target, write)
    return target
