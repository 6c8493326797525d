"""Trained students in the model cache: ``<cache>/models/<teacher>-<variant>-<shape>-t<key>/``.
Writes trained weights, with their log and metadata, into the model cache.

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

from kvlab.train.config import DEFAULT_TRAIN, TRAINED_VARIANTS, TrainConfig
from kvlab.train.names import _shape, train_command, train_data_key, trained_dir, trained_name  # noqa: F401  (public here too)


def trained_student_path(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN, *, train_if_missing: bool = False,
                         progress: bool = True, device=None) -> Path:
    """The cached trained student; else rebuilt from the adapter the repository ships for it
    (:mod:`kvlab.train.shipped`, when its key matches); else trained on ``device``, only with
    ``train_if_missing`` (else a clear error naming ``train-student``)."""
    if variant not in TRAINED_VARIANTS:
        raise ValueError(f"--student={variant!r}: trained variants are {TRAINED_VARIANTS}")
    from kvlab.train.shipped import build_from_shipped, shipped_entry

    target = trained_dir(variant, shape, cfg)
    if (target / "config.json").is_file():
        return target
    entry = shipped_entry(variant, shape, cfg)      # raises (naming train-student) if shipped under another key
    if entry is not None:
        from kvlab.train.plan import announce

        announce([variant], shape, cfg)
        return build_from_shipped(entry, target)
    if not train_if_missing:
        raise FileNotFoundError(
            f"the {variant!r} student ({_shape(shape).flag}) is not trained yet (no {target.name} in the model "
            f"cache); train it first with `{train_command(variant, shape, cfg)}` (~10 min on a 2-core CPU), "
            "use variant='pruned' for the untrained student, or pass train_if_missing=True")
    from kvlab.train.plan import announce

    announce([variant], shape, cfg)                  # a caller that announced the whole set said it already
    return train_student(variant, shape, cfg, device=device, progress=progress)


def training_data(cfg: TrainConfig, teacher, progress: bool = True):
    """(train examples, held-out examples): the teacher's responses, cached; the held-out slice is the
    last ``cfg.heldout`` of the seeded prompt selection."""
    from kvlab.train.data import load_train_prompts, teacher_responses

    rows = load_train_prompts(cfg.train_prompts)
    ex = teacher_responses(teacher, rows, tokens=cfg.tokens, topk=cfg.topk, batch=53, seed=cfg.data_seed_used,
                           progress=progress)
    n = len(ex) - cfg.heldout
    return ex[:n], ex[n:]


def train_student(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN, *, device=None, progress: bool = True,
                  stop_after: int | None = None, checkpoint_s: float = 180.0) -> Path:
    """Train ``variant`` at ``shape`` (teacher responses generated/cached first) and cache the weights.

    Returns the weights folder; with ``stop_after`` it may stop early (checkpointed) and return the run
    folder instead. Only the student is trained; the teacher is loaded frozen.
    """
    from kvlab.core.models import cache_lock

    shape = _shape(shape)
    if variant not in TRAINED_VARIANTS:
        raise ValueError(f"--student={variant!r}: trained variants are {TRAINED_VARIANTS}")
    target = trained_dir(variant, shape, cfg)
    if (target / "config.json").is_file():
        return target
    # one trainer per student: a second process needing it waits here (saying why), then finds it cached
    with cache_lock(target.name, f"training the {variant} student ({shape.flag}) into {target.parent}"):
        if (target / "config.json").is_file():
            return target
        return _train(variant, shape, cfg, target, device=device, progress=progress, stop_after=stop_after,
                      checkpoint_s=checkpoint_s)


def _train(variant, shape, cfg, target, *, device, progress, stop_after, checkpoint_s) -> Path:
    import torch

    from kvlab.core.models import _atomic_save, cache_dir, load_model, load_teacher, pruned_student_path, resolve_device
    from kvlab.train.trainer import train, write_log

    dev = resolve_device(device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    teacher = load_teacher(dev, torch.float32)
    t0 = time.perf_counter()
    train_ex, held = training_data(cfg, teacher, progress)
    hist = held_long = None
    if cfg.history:         # the long regime: multi-turn histories, teacher-forced (kvlab.train.history)
        from kvlab.train.history import history_data

        hist, held_long = history_data(cfg, teacher, train_ex, held, progress=progress)
    data_s = time.perf_counter() - t0
    student = load_model(pruned_student_path(shape), device=dev, dtype=torch.float32, local_files_only=True)
    if cfg.lora_rank:
        from kvlab.train.lora import with_lora

        student = with_lora(student, cfg.lora_rank, seed=cfg.seed)
    run_dir = cache_dir() / "train" / "runs" / target.name
    key = target.name
    t1 = time.perf_counter()
    if dev.type == "cuda":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            res = train(student, teacher, train_ex, held, variant, cfg, run_dir, key=key, progress=progress,
                        checkpoint_s=checkpoint_s, stop_after=stop_after, history=hist, heldout_long=held_long)
    else:
        res = train(student, teacher, train_ex, held, variant, cfg, run_dir, key=key, progress=progress,
                    checkpoint_s=checkpoint_s, stop_after=stop_after, history=hist, heldout_long=held_long)
    if not res.finished:
        return run_dir
    adapter = None
    if cfg.lora_rank:
        from kvlab.train.lora import adapter_tensors, merged

        adapter = adapter_tensors(student)      # fp16: what the repository ships (kvlab.train.shipped)
        student = merged(student)
    meta = {"variant": variant, "shape": shape.label, "config": cfg.__dict__, "data_key": train_data_key(cfg),
            "train_examples": len(train_ex), "heldout_examples": len(held),
            "response_tokens": sum(len(e.response_ids) for e in train_ex), "train_s_last_session": round(res.seconds, 1),
            "data_s": round(data_s, 1), "device": str(dev), "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine(), "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if hist is not None:
        lens = [len(e.prompt_ids) for e in hist]
        meta.update({"history_examples": len(hist), "heldout_long_examples": len(held_long),
                     "history_prompt_tokens": [min(lens), round(sum(lens) / len(lens), 1), max(lens)]})

    def write(tmp: Path) -> None:
        student.model.config.name_or_path = target.name
        student.model.save_pretrained(tmp)
        student.tokenizer.save_pretrained(tmp)
        write_log(res.log, tmp, meta)
        if adapter is not None:
            from kvlab.train.shipped import write_adapter

            write_adapter(tmp / "adapter.safetensors", *adapter, meta={"variant": variant, "shape": shape.label,
                                                                       "key": target.name})

    _atomic_save(target, write)
    (run_dir / "ckpt.pt").unlink(missing_ok=True)
    return target


def read_log(path: Path) -> list[dict]:
    p = Path(path) / "train_log.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
