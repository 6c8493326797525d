"""Trained default students shipped in the repository as fp16 LoRA adapters (see ``manifest.json``)."""
from __future__ import annotations

import json
from pathlib import Path


def write_adapter(path, tensors: dict, scale: float, meta: dict | None = None) -> Path:
    """Write ``tensors`` (fp16 LoRA A/B per module) and ``scale`` as one safetensors file."""
    from safetensors.torch import save_file

    path = Path(path)
    info = {"scale": repr(float(scale)), "format": "kvlab-lora-1", **{k: str(v) for k, v in (meta or {}).items()}}
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(path), metadata=info)
    return path


def read_adapter(path) -> tuple[dict, float, dict]:
    """``(tensors, scale, metadata)`` of an adapter file written by :func:`write_adapter`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != "kvlab-lora-1" or "scale" not in meta:
        raise ValueError(f"{path}: not a kvlab LoRA adapter file (no 'format: kvlab-lora-1' metadata)")
    return tensors, float(meta["scale"]), meta
