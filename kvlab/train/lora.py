"""LoRA (via ``peft``) as the alternative to full-weight training, measured against it (README).

``TrainConfig.lora_rank = r > 0`` wraps the pruned student in rank-``r`` adapters on every attention
and MLP projection (alpha = 2r, no dropout: training stays deterministic); only the adapters train. At
the end the adapters are rounded to fp16 (:func:`adapter_tensors`) and merged into the pruned weights in
float64 (:func:`merge_adapter`), so a LoRA-trained student is saved and loaded like a full-weight one,
and the same fp16 adapter file (shipped in the repository, :mod:`kvlab.train.shipped`) rebuilds exactly
those weights on any machine.
"""
from __future__ import annotations

from dataclasses import replace

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(student, rank: int, seed: int = 0):
    """``student`` (an ``LM``) with its model wrapped in rank-``rank`` LoRA adapters.

    The adapters' random init (peft: A Kaiming-uniform, B zero) is drawn from a generator seeded with
    ``seed`` and leaves the global RNG as it was, so the trained weights depend on the training seed
    only, not on what ran before in the process (e.g. generating the training data)."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:   # pragma: no cover - peft is a dependency; a stripped env gets the fix
        raise ImportError("--lora-rank needs peft: pip install peft") from e
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGETS), bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(student.model, cfg)
    return replace(student, model=model)


def plain_model(model):
    """The transformers model under ``model``'s LoRA adapters (``model`` itself when it carries none): the
    one whose ``forward`` signature names the KV-cache keyword (:func:`kvlab.core.compat.cache_kwarg`);
    peft's wrapper takes ``**kwargs`` and passes them through to it."""
    get = getattr(model, "get_base_model", None)     # peft's PeftModel; transformers models have none
    return get() if callable(get) else model


def merged(student):
    """``student`` with its LoRA adapters merged into the base weights (a plain transformers model), through
    the fp16 adapter file's values (:func:`adapter_tensors` then :func:`merge_adapter`): exactly what
    loading the exported adapter onto the pruned student gives."""
    tensors, scale = adapter_tensors(student)
    base = student.model.unload()            # the pruned weights, adapters removed unmerged
    merge_adapter(base, tensors, scale)
    return replace(student, model=base)


def adapter_tensors(student) -> tuple[dict, float]:
    """``({"<module>.lora_A": (r, in) fp16, "<module>.lora_B": (out, r) fp16, ...}, scale)`` of a
    peft-wrapped ``student``; module names are the plain model's (``model.layers.0.self_attn.q_proj``)."""
    import torch
    from peft.tuners.lora import LoraLayer

    out, scales = {}, set()
    root = student.model.get_base_model()
    for name, mod in root.named_modules():
        if isinstance(mod, LoraLayer):
            ad = next(iter(mod.lora_A))
            out[f"{name}.lora_A"] = mod.lora_A[ad].weight.detach().to("cpu", torch.float16).contiguous()
            out[f"{name}.lora_B"] = mod.lora_B[ad].weight.detach().to("cpu", torch.float16).contiguous()
            scales.add(float(mod.scaling[ad]))
    if not out or len(scales) != 1:
        raise ValueError("adapter_tensors: the student carries no LoRA adapters (or mixed scalings)")
    return out, scales.pop()


def merge_adapter(model, tensors: dict, scale: float) -> None:
    """``W ← fp32(W + scale · B A)`` in float64 for every adapted Linear of ``model`` (in place), so the
    result does not depend on the machine's fp32 matmul kernels. Raises ValueError naming a module
    whose shape does not match (an adapter for another prune shape)."""
    import torch

    mods = dict(model.named_modules())
    names = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    with torch.no_grad():
        for name in names:
            lin = mods.get(name)
            a, b = tensors.get(f"{name}.lora_A"), tensors.get(f"{name}.lora_B")
            if lin is None or a is None or b is None or not hasattr(lin, "weight"):
                raise ValueError(f"adapter module {name!r} is missing from the model or incomplete")
            w = lin.weight
            if (b.shape[0], a.shape[1]) != tuple(w.shape) or a.shape[0] != b.shape[1]:
                raise ValueError(f"adapter for {name!r} has shape B{tuple(b.shape)} A{tuple(a.shape)}, the model's "
                                 f"weight is {tuple(w.shape)}: the adapter belongs to another prune shape")
            delta = b.to(torch.float64) @ a.to(torch.float64) * scale
            w.copy_((w.detach().cpu().to(torch.float64) + delta).to(w.dtype).to(w.device))
