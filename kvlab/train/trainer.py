"""The training loop: AdamW over the student only, per-step log, held-out KL, exact resume.
Writes checkpoints under the kvlab cache dir while it trains; the trained weights are saved by
:mod:`kvlab.train.weights`.

Determinism: the batch of step ``s`` and its refresh points are functions of ``(seed, s)`` alone, the
model has no dropout, and a checkpoint holds the student's and the optimiser's state plus the log;
so a run resumed from a checkpoint reaches the same weights as an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvlab.train.config import TrainConfig
from kvlab.train.forward import student_forward, token_losses


def batch_indices(step: int, n: int, batch: int, seed: int) -> list[int]:
    """Example indices of ``step``: consecutive slices of one seeded permutation per epoch."""
    out = []
    for j in range(step * batch, (step + 1) * batch):
        epoch, i = divmod(j, n)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        out.append(int(torch.randperm(n, generator=g)[i]))
    return out


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


@torch.no_grad()
def heldout_kl(student, teacher, examples, variant: str) -> dict:
    """Mean per-token KL(p_T ‖ q) and CE of the student on ``examples`` in ``variant``'s own forward
    (refresh-aware is scored without refresh, like overfill)."""
    was = student.model.training
    student.model.eval()
    kl_sum = ce_sum = n = 0.0
    try:
        for ex in examples:
            fw = student_forward(student, teacher, ex, variant, random.Random(0), p_none=1.0)
            ce, kl = token_losses(fw, ex)
            kl_sum, ce_sum, n = kl_sum + float(kl.sum()), ce_sum + float(ce.sum()), n + kl.numel()
    finally:
        student.model.train(was)
    return {"heldout_kl": kl_sum / max(n, 1), "heldout_ce": ce_sum / max(n, 1)}


@dataclass
class TrainResult:
    steps_done: int
    finished: bool
    log: list
    seconds: float


def _save_ckpt(path: Path, student, opt, step: int, log: list, key: str) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "step": step, "model": student.model.state_dict(), "opt": opt.state_dict(),
                "log": log}, tmp)
    tmp.replace(path)


def pick_example(examples: list, history: list | None, i: int, cfg: TrainConfig, step: int, j: int):
    """``(example, is_history)`` for slot ``j`` of ``step``: the history version of example ``i`` with probability
    ``cfg.history`` (a coin seeded by ``(seed, step, j)``), else example ``i`` itself. ``history=0`` draws no coin:
    the short-only run is exactly the one from before history examples existed."""
    if cfg.history and random.Random(f"{cfg.seed}-{step}-{j}-history").random() < cfg.history:
        return history[i], True
    return examples[i], False


def train(student, teacher, examples: list, heldout: list, variant: str, cfg: TrainConfig, run_dir: Path, *,
          key: str = "", progress: bool = True, checkpoint_s: float = 180.0, stop_after: int | None = None,
          history: list | None = None, heldout_long: list | None = None) -> TrainResult:
    """Train ``student`` (in place) for ``cfg.steps`` optimiser steps; resumes from ``run_dir/ckpt.pt``.

    ``stop_after``: stop (checkpointing first) once that many steps are done, as an interruption would.
    The log (one JSON row per step, plus held-out rows every ``cfg.eval_every`` steps) is returned and
    kept in the checkpoint; KeyboardInterrupt checkpoints before it propagates.
    ``history`` (needed when ``cfg.history > 0``): multi-turn examples aligned with ``examples`` (entry ``i``
    ends in example ``i``'s prompt, :mod:`kvlab.train.history`), mixed in at the share ``cfg.history``;
    ``heldout_long``: long held-out examples, scored beside ``heldout`` (``heldout_kl_long`` in the log).
    """
    if cfg.history and (history is None or len(history) != len(examples)):
        raise ValueError(f"--history={cfg.history}: train() needs history examples aligned with the {len(examples)} "
                         f"training examples (kvlab.train.history.history_data), got "
                         f"{'none' if history is None else len(history)}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt = run_dir / "ckpt.pt"
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    model = student.model
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    start, log = 0, []
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        if state["key"] != key:
            raise ValueError(f"checkpoint {ckpt} belongs to another training run ({state['key']} != {key}); delete it")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start, log = state["step"], state["log"]
    torch.manual_seed(cfg.seed)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train {variant}")
    t_start = last_ckpt = time.perf_counter()
    step = start
    try:
        while step < cfg.steps:
            if stop_after is not None and step >= stop_after:
                break
            t0 = time.perf_counter()
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            idx = batch_indices(step, len(examples), cfg.batch, cfg.seed)
            picked = [pick_example(examples, history, i, cfg, step, j) for j, i in enumerate(idx)]
            fws = []
            n_tok = n_in = 0
            ce_sum = kl_sum = 0.0
            # token-mean over the whole step: scale each example by 1 / (tokens in the step)
            total = sum(len(ex.response_ids) - (0 if variant == "standalone" else 1) for ex, _ in picked)
            for j, (ex, _) in enumerate(picked):
                rng = random.Random(f"{cfg.seed}-{step}-{j}")
                fw = student_forward(student, teacher, ex, variant, rng, gap=cfg.refresh_gap, p_none=cfg.refresh_none)
                ce, kl = token_losses(fw, ex)
                loss = (cfg.ce_weight * ce + (1 - cfg.ce_weight) * kl).sum() / total
                loss.backward()
                ce_sum, kl_sum, n_tok = ce_sum + float(ce.detach().sum()), kl_sum + float(kl.detach().sum()), n_tok + ce.numel()
                n_in += fw.positions.numel() + (len(ex.prompt_ids) - 1 if variant == "standalone" else 0)
                fws.append(fw.mask is not None and bool(fw.mask.any()))
                del fw
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            ce_m, kl_m = ce_sum / n_tok, kl_sum / n_tok
            row = {"step": step + 1, "loss": cfg.ce_weight * ce_m + (1 - cfg.ce_weight) * kl_m, "ce": ce_m,
                   "kl": kl_m, "lr": opt.param_groups[0]["lr"], "grad_norm": gnorm, "tokens": n_tok,
                   "tok_s": n_in / dt, "seconds": dt, "refreshed": sum(fws)}
            if cfg.history:
                row["history"] = sum(h for _, h in picked)      # history examples in this step's batch
            step += 1
            if step % cfg.eval_every == 0 or step == cfg.steps:
                row.update(heldout_kl(student, teacher, heldout, variant))
                if heldout_long:
                    row.update({f"{k}_long": v for k, v in heldout_kl(student, teacher, heldout_long, variant).items()})
            log.append(row)
            if bar is not None:
                bar.update(1)
                post = {"loss": f"{row['loss']:.3f}", "tok/s": f"{row['tok_s']:.0f}"}
                for k in ("heldout_kl", "heldout_kl_long"):
                    if k in row:
                        post[k] = f"{row[k]:.3f}"
                bar.set_postfix(post)
            if time.perf_counter() - last_ckpt >= checkpoint_s:
                _save_ckpt(ckpt, student, opt, step, log, key)
                last_ckpt = time.perf_counter()
    except KeyboardInterrupt:
        _save_ckpt(ckpt, student, opt, step, log, key)
        raise
    finally:
        if bar is not None:
            bar.close()
    finished = step >= cfg.steps
    if not finished:
        _save_ckpt(ckpt, student, opt, step, log, key)
    model.eval()
    return TrainResult(step, finished, log, time.perf_counter() - t_start)


def write_log(log: list, folder: Path, meta: dict) -> None:
    folder = Path(folder)
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (folder / "train_meta.json").write_text(json.dumps(meta, indent=1, default=str))


def config_dict(cfg: TrainConfig) -> dict:
    return asdict(cfg)
