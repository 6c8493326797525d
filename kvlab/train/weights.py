"""Trained students in the model cache: ``<cache>/models/<teacher>-<variant>-<shape>-t<key>/``.

The key (:meth:`TrainConfig.key`) covers the variant, prune shape, training-data hash, steps, seed,
every weight-changing setting and ``TRAIN_VERSION``. The folder holds the weights plus the training
log (``train_log.jsonl``: loss per step, held-out KL every ``eval_every`` steps) and
``train_meta.json`` (config, data, time, device). Checkpoints of a run in progress live in
``<cache>/train/runs/<folder name>/`` until it finishes.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from .config import DEFAULT_TRAIN, TRAINED_VARIANTS, TrainConfig


def _shape(shape):
    from kvlab.core.prune import PruneShape

    return PruneShape.parse(shape)


def train_data_key(cfg: TrainConfig) -> str:
    from kvlab.core.models import TEACHER_NAME
    from .data import data_key, load_train_prompts

    return data_key(load_train_prompts(cfg.train_prompts), TEACHER_NAME, cfg.tokens, cfg.topk, cfg.seed, 53)


def trained_name(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> str:
    from kvlab.core.models import TEACHER_NAME

    shape = _shape(shape)
    return f"{TEACHER_NAME}-{variant}-{shape.label}-t{cfg.key(variant, shape.label, train_data_key(cfg))}"


def trained_dir(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> Path:
    from kvlab.core.models import cache_dir

    return cache_dir() / "models" / trained_name(variant, shape, cfg)


def train_command(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> str:
    extra = "" if cfg == DEFAULT_TRAIN else f" --steps {cfg.steps} --batch {cfg.batch} --seed {cfg.seed}"
    if (cfg.lora_rank, cfg.lr) != (DEFAULT_TRAIN.lora_rank, DEFAULT_TRAIN.lr):
        extra += f" --lora-rank {cfg.lora_rank} --lr {cfg.lr:g}"
    return f"python -m kvlab train-student --student {variant} --prune {_shape(shape).flag}{extra}"


def trained_student_path(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN, *, train_if_missing: bool = False,
                         progress: bool = True) -> Path:
    """The cached trained student; trains it only with ``train_if_missing`` (else a clear error)."""
    if variant not in TRAINED_VARIANTS:
        raise ValueError(f"--student={variant!r}: trained variants are {TRAINED_VARIANTS}")
    target = trained_dir(variant, shape, cfg)
    if (target / "config.json").is_file():
        return target
    if not train_if_missing:
        raise FileNotFoundError(
            f"the {variant!r} student ({_shape(shape).flag}) is not trained yet (no {target.name} in the model "
            f"cache); train it first with `{train_command(variant, shape, cfg)}` (~10 min on a 2-core CPU), "
            "use variant='pruned' for the untrained student, or pass train_if_missing=True")
    return train_student(variant, shape, cfg, progress=progress)


def training_data(cfg: TrainConfig, teacher, progress: bool = True):
    """(train examples, held-out examples): the teacher's responses, cached; the held-out slice is the
    last ``cfg.heldout`` of the seeded prompt selection."""
    from .data import load_train_prompts, teacher_responses

    rows = load_train_prompts(cfg.train_prompts)
    ex = teacher_responses(teacher, rows, tokens=cfg.tokens, topk=cfg.topk, batch=53, seed=cfg.seed,
                           progress=progress)
    n = len(ex) - cfg.heldout
    return ex[:n], ex[n:]


def train_student(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN, *, device=None, progress: bool = True,
                  stop_after: int | None = None, checkpoint_s: float = 180.0) -> Path:
    """Train ``variant`` at ``shape`` (teacher responses generated/cached first) and cache the weights.

    Returns the weights folder; with ``stop_after`` it may stop early (checkpointed) and return the run
    folder instead. Only the student is trained; the teacher is loaded frozen.
    """
    import torch

    from kvlab.core.models import _atomic_save, cache_dir, load_model, load_teacher, pruned_student_path, resolve_device
    from .trainer import train, write_log

    shape = _shape(shape)
    if variant not in TRAINED_VARIANTS:
        raise ValueError(f"--student={variant!r}: trained variants are {TRAINED_VARIANTS}")
    target = trained_dir(variant, shape, cfg)
    if (target / "config.json").is_file():
        return target
    dev = resolve_device(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    teacher = load_teacher(dev, torch.float32)
    t0 = time.perf_counter()
    train_ex, held = training_data(cfg, teacher, progress)
    data_s = time.perf_counter() - t0
    student = load_model(pruned_student_path(shape), device=dev, dtype=torch.float32, local_files_only=True)
    if cfg.lora_rank:
        from .lora import with_lora

        student = with_lora(student, cfg.lora_rank, seed=cfg.seed)
    run_dir = cache_dir() / "train" / "runs" / target.name
    key = target.name
    t1 = time.perf_counter()
    if dev.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = train(student, teacher, train_ex, held, variant, cfg, run_dir, key=key, progress=progress,
                        checkpoint_s=checkpoint_s, stop_after=stop_after)
    else:
        res = train(student, teacher, train_ex, held, variant, cfg, run_dir, key=key, progress=progress,
                    checkpoint_s=checkpoint_s, stop_after=stop_after)
    if not res.finished:
        return run_dir
    adapter = None
    if cfg.lora_rank:
        from .lora import adapter_tensors, merged

        adapter = adapter_tensors(student)      # fp16: what the repository ships (kvlab.train.shipped)
        student = merged(student)
    meta = {"variant": variant, "shape": shape.label, "config": cfg.__dict__, "data_key": train_data_key(cfg),
            "train_examples": len(train_ex), "heldout_examples": len(held),
            "response_tokens": sum(len(e.response_ids) for e in train_ex), "train_s_last_session": round(res.seconds, 1),
            "data_s": round(data_s, 1), "device": str(dev), "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def write(tmp: Path) -> None:
        student.model.config.name_or_path = target.name
        student.model.save_pretrained(tmp)
        student.tokenizer.save_pretrained(tmp)
        write_log(res.log, tmp, meta)
        if adapter is not None:
            from .shipped import write_adapter

            write_adapter(tmp / "adapter.safetensors", *adapter, meta={"variant": variant, "shape": shape.label,
                                                                       "key": target.name})

    _atomic_save(target, write)
    (run_dir / "ckpt.pt").unlink(missing_ok=True)
    return target


def read_log(path: Path) -> list[dict]:
    p = Path(path) / "train_log.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
