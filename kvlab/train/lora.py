"""LoRA (via ``peft``) as the alternative to full-weight training, measured against it (README).

``TrainConfig.lora_rank = r > 0`` wraps the pruned student in rank-``r`` adapters on every attention
and MLP projection (alpha = 2r, no dropout: training stays deterministic); only the adapters train. At
the end the adapters are merged into the weights, so a LoRA-trained student is saved and loaded exactly
like a full-weight one.
"""
from __future__ import annotations

from dataclasses import replace

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(student, rank: int):
    """``student`` (an ``LM``) with its model wrapped in rank-``rank`` LoRA adapters."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:   # pragma: no cover - peft is a dependency; a stripped env gets the fix
        raise ImportError("--lora-rank needs peft: pip install peft") from e
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(TARGETS), bias="none")
    return replace(student, model=get_peft_model(student.model, cfg))


def merged(student):
    """``student`` with its LoRA adapters merged into the base weights (a plain transformers model)."""
    return replace(student, model=student.model.merge_and_unload())
