"""LoRA (via ``peft``) as the alternative to full-weight training, measured against it (README).

``TrainConfig.lora_rank = r > 0`` wraps the pruned student in rank-``r`` adapters on every attention
and MLP projection (alpha = 2r, no dropout: training stays deterministic); only the adapters train. At
the end the adapters are merged into the weights, so a LoRA-trained student is saved and loaded exactly
like a full-weight one.
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


def merged(student):
    """``student`` with its LoRA adapters merged into the base weights (a plain transformers model)."""
    return replace(student, model=student.model.merge_and_unload())
