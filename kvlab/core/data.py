"""Prompt files: JSON Lines, one object per line with a ``prompt`` string field."""
from __future__ import annotations

import json
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[2] / "data"   # kvlab/core/data.py -> the project root


def _packaged(name: str) -> Path:
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} not found at {path}; kvlab expects its repository's data/ folder "
                                "(install with `pip install -e .` from a checkout)")
    return path


def prompts_file() -> Path:
    return _packaged("prompts.jsonl")


def calibration_file() -> Path:
    return _packaged("calibration.jsonl")


# Named prompt sets (``--prompt-set``): the default short ELI5-style prompts (about 65 tokens with the chat
# template, 128-token answers) and the long-prompt / short-answer set OverFill is for (300-800 token
# documents, few-shot prompts and multi-turn histories, each ending in a question answered in 32-64 tokens;
# written by data/long_prompts_source.py).
PROMPT_SETS = {"default": "prompts.jsonl", "long": "long_prompts.jsonl"}
# New tokens per run that fits each set (the long set's answers are 32-64 tokens).
SET_TOKENS = {"default": 128, "long": 48}


def prompt_set_file(name: str) -> Path:
    """The prompts file of a named set (:data:`PROMPT_SETS`)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"--prompt-set={name!r} must be one of {sorted(PROMPT_SETS)} (or pass --prompts-file)")
    return _packaged(PROMPT_SETS[name])


def long_prompts_file() -> Path:
    return prompt_set_file("long")


def load_prompts(path=None, n: int | None = None) -> list[dict]:
    """Rows of a prompts file (default ``data/prompts.jsonl``); the first ``n`` if given."""
    if n is not None and (not isinstance(n, int) or n <= 0):
        raise ValueError(f"n={n!r} must be a positive integer (number of prompts)")
    path = Path(path) if path is not None else prompts_file()
    if not path.is_file():
        raise FileNotFoundError(f"prompts_file={str(path)!r} does not exist; pass a JSON Lines file "
                                "with one {\"prompt\": ...} object per line")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompts_file={str(path)!r} line {lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ValueError(f"prompts_file={str(path)!r} line {lineno}: needs an object with a non-empty "
                             "'prompt' string field")
        rows.append(row)
    if not rows:
        raise ValueError(f"prompts_file={str(path)!r} holds no prompts")
    if n is not None and n > len(rows):
        raise ValueError(f"n={n} but prompts_file={str(path)!r} holds only {len(rows)} prompts; lower --prompts")
    return rows[:n] if n is not None else rows
