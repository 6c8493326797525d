"""Names and keys of trained students in the model cache: ``<cache>/models/<teacher>-<variant>-<shape>-t<key>/``
(no training code here, so the shipped-adapter check and the up-front plan can use them)."""
from __future__ import annotations

from pathlib import Path

from kvlab.train.config import DEFAULT_TRAIN, TrainConfig


def _shape(shape):
    from kvlab.core.prune import PruneShape

    return PruneShape.parse(shape)


def train_data_key(cfg: TrainConfig) -> str:
    from kvlab.core.models import TEACHER_NAME
    from kvlab.train.data import data_key, load_train_prompts

    return data_key(load_train_prompts(cfg.train_prompts), TEACHER_NAME, cfg.tokens, cfg.topk, cfg.data_seed_used, 53)


def trained_name(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> str:
    from kvlab.core.models import TEACHER_NAME

    shape = _shape(shape)
    return f"{TEACHER_NAME}-{variant}-{shape.label}-t{cfg.key(variant, shape.label, train_data_key(cfg))}"


def trained_dir(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> Path:
    from kvlab.core.models import cache_dir

    return cache_dir() / "models" / trained_name(variant, shape, cfg)


def train_command(variant: str, shape, cfg: TrainConfig = DEFAULT_TRAIN) -> str:
    same = cfg.replace(threads=DEFAULT_TRAIN.threads, eval_every=DEFAULT_TRAIN.eval_every) == DEFAULT_TRAIN
    extra = "" if same else f" --steps {cfg.steps} --batch {cfg.batch} --seed {cfg.seed}"
    if (cfg.lora_rank, cfg.lr) != (DEFAULT_TRAIN.lora_rank, DEFAULT_TRAIN.lr):
        extra += f" --lora-rank {cfg.lora_rank} --lr {cfg.lr:g}"
    if cfg.train_prompts != DEFAULT_TRAIN.train_prompts:
        extra += f" --train-prompts {cfg.train_prompts}"
    if cfg.history != DEFAULT_TRAIN.history:
        extra += f" --history {cfg.history:g}"
    if cfg.data_seed is not None:
        extra += f" --data-seed {cfg.data_seed}"
    return f"python -m kvlab train-student --student {variant} --prune {_shape(shape).flag}{extra}"
