"""Training data: the teacher's sampled responses (T = 0.7, top-p 0.9) to the training prompts, with its top-k log-probs.
Writes only its cache of responses under ``<kvlab cache>/train/``.

Responses come from batched greedy generation on the embedded teacher (left padding, prompts sorted
by length so a batch pads little). For every response position the teacher's top-``topk`` log-probs
are kept, so the distillation KL needs no teacher forward during training. The result is cached in
``<kvlab cache>/train/`` keyed by the prompts' content, the teacher, the length and ``DATA_VERSION``;
generation writes one part file per batch, so an interrupted run resumes.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

DATA_VERSION = "1"
TEMPERATURE, TOP_P = 0.7, 0.9


@dataclass(frozen=True)
class Example:
    """One training example. ``topk_logp[t]`` / ``topk_idx[t]``: the teacher's top-k next-token
    log-probs given prompt + ``response[:t]`` (so row ``t`` is the distribution ``response[t]`` came from)."""

    id: str
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    topk_idx: torch.Tensor    # (R, k) int64
    topk_logp: torch.Tensor   # (R, k) float32


def data_key(prompts: list[dict], teacher_name: str, tokens: int, topk: int, seed: int, batch: int) -> str:
    blob = json.dumps({"v": DATA_VERSION, "teacher": teacher_name, "tokens": tokens, "topk": topk, "seed": seed,
                       "batch": batch, "sampling": [TEMPERATURE, TOP_P],
                       "prompts": [[r["id"], r["prompt"]] for r in prompts]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _data_dir(key: str) -> Path:
    from kvlab.core.models import cache_dir

    return cache_dir() / "train" / f"data-{key}"


@torch.inference_mode()
def _generate_batch(teacher, rows: list[dict], tokens: int, topk: int, seed: int) -> list[dict]:
    tok = teacher.tokenizer
    ids = [teacher.encode_prompt(r["prompt"]) for r in rows]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    width = max(len(x) for x in ids)
    inp = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=teacher.device)        # (B, P)
    att = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=teacher.device)
    eos = teacher.model.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or [tok.eos_token_id]))
    torch.manual_seed(seed)   # sampled like the evaluation runs (T=0.7, top-p 0.9), one seed per batch
    out = teacher.model.generate(input_ids=inp, attention_mask=att, max_new_tokens=tokens, do_sample=True,
                                 temperature=TEMPERATURE, top_p=TOP_P, top_k=None, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=pad)
    seqs = out.sequences[:, width:]                                                             # (B, R)
    logp = torch.stack(out.logits, dim=1).float().log_softmax(-1)                               # (B, R, V)
    val, idx = logp.topk(topk, dim=-1)                                                          # (B, R, k)
    res = []
    for b, r in enumerate(rows):
        resp = seqs[b].tolist()
        n = next((i + 1 for i, t in enumerate(resp) if t in eos), len(resp))
        res.append({"id": r["id"], "prompt_ids": ids[b], "response_ids": resp[:n],
                    "topk_idx": idx[b, :n].cpu(), "topk_logp": val[b, :n].cpu()})
    return res


def teacher_responses(teacher, prompts: list[dict], tokens: int = 128, topk: int = 32, batch: int = 53,
                      seed: int = 0, progress: bool = True) -> list[Example]:
    """The teacher's greedy responses (≤ ``tokens`` each) to ``prompts``, cached; resumes part files."""
    if tokens <= 0 or topk <= 0 or batch <= 0:
        raise ValueError(f"tokens={tokens}, topk={topk}, batch={batch} must all be positive")
    key = data_key(prompts, teacher.name, tokens, topk, seed, batch)
    root = _data_dir(key)
    final = root / "examples.pt"
    if not final.is_file():
        from kvlab.core.models import cache_lock

        with cache_lock(root.name, f"generating the teacher's training responses ({len(prompts)} prompts)"):
            if not final.is_file():
                _generate_all(teacher, prompts, root, final, key, tokens, topk, batch, seed, progress)
    rows = torch.load(final)
    return [Example(r["id"], tuple(r["prompt_ids"]), tuple(r["response_ids"]), r["topk_idx"].long(),
                    r["topk_logp"].float()) for r in rows]


def _generate_all(teacher, prompts, root: Path, final: Path, key: str, tokens: int, topk: int, batch: int,
                  seed: int, progress: bool) -> None:
    """Generate every batch (part files, so an interrupted run resumes), then write ``examples.pt``."""
    root.mkdir(parents=True, exist_ok=True)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]["prompt"]), i))
    chunks = [order[i:i + batch] for i in range(0, len(order), batch)]
    t0, done_tokens = time.perf_counter(), 0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(chunks), desc=f"teacher responses ({len(prompts)} prompts × ≤{tokens})")
    for ci, chunk in enumerate(chunks):
        part = root / f"part-{ci:04d}.pt"
        if not part.is_file():
            res = _generate_batch(teacher, [prompts[i] for i in chunk], tokens, topk, seed + ci)
            tmp = part.with_suffix(".tmp")
            torch.save(res, tmp)
            tmp.rename(part)
            done_tokens += sum(len(r["response_ids"]) for r in res)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(tok_s=f"{done_tokens / max(time.perf_counter() - t0, 1e-9):.0f}")
    if bar is not None:
        bar.close()
    rows = {r["id"]: r for ci in range(len(chunks)) for r in torch.load(root / f"part-{ci:04d}.pt")}
    ordered = [rows[p["id"]] for p in prompts]
    meta = {"key": key, "teacher": teacher.name, "tokens": tokens, "topk": topk, "n": len(ordered),
            "response_tokens": sum(len(r["response_ids"]) for r in ordered),
            "generation_s_this_run": round(time.perf_counter() - t0, 1)}
    torch.save(ordered, final.with_suffix(".tmp"))
    final.with_suffix(".tmp").rename(final)
    (root / "meta.json").write_text(json.dumps(meta, indent=1))
    for ci in range(len(chunks)):
        (root / f"part-{ci:04d}.pt").unlink(missing_ok=True)


def load_train_prompts(n: int | None = None, path=None) -> list[dict]:
    """``n`` rows of ``data/train_prompts.jsonl`` (all if None), a fixed seeded selection."""
    import random

    from kvlab.core.data import load_prompts
    from kvlab.train.prompts import train_prompts_file

    rows = load_prompts(path if path is not None else train_prompts_file())
    if n is None:
        return rows
    if not isinstance(n, int) or not 0 < n <= len(rows):
        raise ValueError(f"--train-prompts={n!r} must be in [1, {len(rows)}]")
    idx = sorted(random.Random(0).sample(range(len(rows)), n))
    return [rows[i] for i in idx]
