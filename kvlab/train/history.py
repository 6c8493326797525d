"""Long-regime training examples (issue 27): multi-turn histories built from the cached teacher responses, so a
student learns to read a long, teacher-written prefix (OverFill's regime: long prompts, short answers).
Writes only its cache under ``<kvlab cache>/train/history-<key>/``.

A history example is ``k`` earlier (training prompt, the teacher's cached response to it) turns rendered as chat
turns with the tokenizer's chat template (:meth:`kvlab.core.models.LM.encode_chat`: the template's default system
prompt once, exactly as a single prompt is encoded), then a final user prompt. Its response is the final prompt's
cached teacher response; the teacher's top-k log-probs over it are recomputed teacher-forced with the whole
history as context (one teacher forward per example; nothing is generated).

Turns per example: a target length ``L ~ U[lo, hi]`` tokens (``TrainConfig.history_tokens``, default 300-800, the
range of ``data/long_prompts.jsonl``) is drawn from a generator seeded by ``(seed, final prompt id)``; earlier turns
(distinct training examples other than the final one, in a seeded random order) are added while the rendered
prompt is shorter than ``L``, skipping a turn that would take it past ``hi`` (at most :data:`MAX_SKIPS` skips).
With the embedded teacher's ~65-token prompts (~35 without the system prompt) and <=128-token responses (~104 on
average) a turn is about 150 tokens, so an example should get about 2 (near 300 tokens) to 5 (near 800) earlier
turns (an estimate; ``meta.json`` in the cache records the turns and prompt lengths actually drawn).

Earlier turns always come from the *training* split, never from a held-out prompt, and the final prompts are
training prompts (training set) or held-out prompts (held-out long set): no text of ``data/long_prompts.jsonl``
or of the evaluation prompts enters (the training prompts are disjoint from both, ``tests/test_long_prompts.py``).
"""
from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch

from kvlab.train.config import HISTORY_VERSION
from kvlab.train.data import Example

MAX_SKIPS = 32          # turns skipped (too long for `hi`) before an example settles for what it has
PART = 32               # examples per part file: an interrupted build resumes from the last finished part


def plan_history(lm, final: Example, pool: list[Example], texts: dict, lo: int, hi: int, seed: int):
    """``(prompt ids, ids of the earlier turns' examples)`` of the history ending in ``final``'s prompt (module doc)."""
    rng = random.Random(f"history-{seed}-{final.id}")
    target = rng.randint(lo, hi)
    order = [i for i in rng.sample(range(len(pool)), len(pool)) if pool[i].id != final.id]
    answers: dict[int, str] = {}

    def render(chosen: list[int]) -> list[int]:
        msgs = []
        for i in chosen:
            if i not in answers:
                answers[i] = lm.tokenizer.decode(list(pool[i].response_ids), skip_special_tokens=True).strip()
            msgs += [{"role": "user", "content": texts[pool[i].id]}, {"role": "assistant", "content": answers[i]}]
        return lm.encode_chat(msgs + [{"role": "user", "content": texts[final.id]}])

    chosen, ids, skips = [], render([]), 0
    for i in order:
        if len(ids) >= target or skips >= MAX_SKIPS:
            break
        cand = render(chosen + [i])
        if len(cand) > hi:
            skips += 1
            continue
        chosen, ids = chosen + [i], cand
    return ids, tuple(pool[i].id for i in chosen)


@torch.inference_mode()
def forced_topk(teacher, prompt_ids, response_ids, topk: int):
    """The teacher's top-``topk`` next-token log-probs at every response position, teacher-forced on
    ``prompt + response`` in one forward: row ``t`` is the distribution ``response[t]`` is scored under."""
    R = len(response_ids)
    ids = torch.tensor([list(prompt_ids) + list(response_ids[:-1])], device=teacher.device)      # (1, P+R-1)
    logits = teacher.model(input_ids=ids, use_cache=False, logits_to_keep=R).logits[0]           # (R, V)
    val, idx = logits.float().log_softmax(-1).topk(topk, dim=-1)                                 # (R, k)
    return idx.cpu(), val.cpu()


def _digest(examples: list[Example], texts: dict) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.id, texts.get(e.id), list(e.response_ids)]).encode())
    return h.hexdigest()[:16]


def history_key(teacher_name: str, finals, pool, texts, lo: int, hi: int, seed: int, topk: int) -> str:
    blob = json.dumps({"v": HISTORY_VERSION, "teacher": teacher_name, "lo": lo, "hi": hi, "seed": seed, "topk": topk,
                       "finals": _digest(finals, texts), "pool": _digest(pool, texts)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def history_set(teacher, finals: list[Example], pool: list[Example], texts: dict, *, lo: int = 300, hi: int = 800,
                seed: int = 0, topk: int = 32, tag: str = "train", progress: bool = True) -> list[Example]:
    """One history example per ``finals`` entry (same order), earlier turns drawn from ``pool``; cached under
    ``<cache>/train/history-<key>/`` (part files, so an interrupted build resumes). ``texts``: prompt text by
    example id (every id of ``finals`` and ``pool``)."""
    missing = [e.id for e in [*finals, *pool] if e.id not in texts]
    if missing:
        raise ValueError(f"texts has no prompt text for {missing[:3]}…: pass the rows the examples were built from")
    if not 1 <= lo <= hi:
        raise ValueError(f"history_tokens=({lo}, {hi}) must satisfy 1 <= lo <= hi")
    from kvlab.core.models import cache_dir, cache_lock

    key = history_key(teacher.name, finals, pool, texts, lo, hi, seed, topk)
    root = cache_dir() / "train" / f"history-{key}"
    final = root / "examples.pt"
    if not final.is_file():
        with cache_lock(root.name, f"building {len(finals)} {tag} history examples (one teacher forward each)"):
            if not final.is_file():
                _build_all(teacher, finals, pool, texts, root, final, key, lo, hi, seed, topk, tag, progress)
    rows = torch.load(final)
    return [Example(r["id"], tuple(r["prompt_ids"]), tuple(r["response_ids"]), r["topk_idx"].long(),
                    r["topk_logp"].float()) for r in rows]


def _build_all(teacher, finals, pool, texts, root: Path, final: Path, key: str, lo, hi, seed, topk, tag,
               progress) -> None:
    root.mkdir(parents=True, exist_ok=True)
    chunks = [list(range(i, min(i + PART, len(finals)))) for i in range(0, len(finals), PART)]
    t0 = time.perf_counter()
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(finals), desc=f"history examples ({tag}, {lo}-{hi} tokens)")
    for ci, chunk in enumerate(chunks):
        part = root / f"part-{ci:04d}.pt"
        if not part.is_file():
            res = []
            for j in chunk:
                ex = finals[j]
                ids, turns = plan_history(teacher, ex, pool, texts, lo, hi, seed)
                idx, val = forced_topk(teacher, ids, ex.response_ids, topk)
                res.append({"id": f"hist-{ex.id}", "final": ex.id, "turns": list(turns), "prompt_ids": ids,
                            "response_ids": list(ex.response_ids), "topk_idx": idx, "topk_logp": val})
            torch.save(res, part.with_suffix(".tmp"))
            part.with_suffix(".tmp").rename(part)
        if bar is not None:
            bar.update(len(chunk))
    if bar is not None:
        bar.close()
    rows = [r for ci in range(len(chunks)) for r in torch.load(root / f"part-{ci:04d}.pt")]
    lens = [len(r["prompt_ids"]) for r in rows]
    turns = [len(r["turns"]) for r in rows]
    meta = {"key": key, "tag": tag, "teacher": teacher.name, "n": len(rows), "history_tokens": [lo, hi],
            "seed": seed, "topk": topk, "prompt_tokens": {"min": min(lens, default=0), "max": max(lens, default=0),
                                                          "mean": round(sum(lens) / max(len(lens), 1), 1)},
            "turns": {"min": min(turns, default=0), "max": max(turns, default=0),
                      "mean": round(sum(turns) / max(len(turns), 1), 2)},
            "in_range": sum(lo <= n <= hi for n in lens), "build_s_this_run": round(time.perf_counter() - t0, 1)}
    torch.save(rows, final.with_suffix(".tmp"))
    final.with_suffix(".tmp").rename(final)
    (root / "meta.json").write_text(json.dumps(meta, indent=1))
    for ci in range(len(chunks)):
        (root / f"part-{ci:04d}.pt").unlink(missing_ok=True)


def history_data(cfg, teacher, train_ex: list[Example], held: list[Example], *, train: bool = True,
                 progress: bool = True) -> tuple[list[Example] | None, list[Example]]:
    """(training history examples aligned with ``train_ex`` — example ``i`` ends in ``train_ex[i]``'s prompt —
    or None without ``train``; held-out long examples, one per ``held`` prompt), turns from ``train_ex``."""
    from kvlab.train.data import load_train_prompts

    texts = {r["id"]: r["prompt"] for r in load_train_prompts(cfg.train_prompts)}
    lo, hi = cfg.history_tokens
    kw = dict(lo=lo, hi=hi, seed=cfg.data_seed_used, topk=cfg.topk, progress=progress)   # data: the data seed
    tr = history_set(teacher, train_ex, train_ex, texts, tag="train", **kw) if train else None
    return tr, history_set(teacher, held, train_ex, texts, tag="heldout", **kw)
