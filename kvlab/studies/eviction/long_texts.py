"""The long texts of the long-context eviction study: ``data/long_texts.jsonl`` (written, with provenance and
licenses, by ``data/long_texts_source.py``) cut into (context, continuation) cases.

Document ``i`` gives every context length the same continuation: its tokens ``[P, P + M + 1)`` with
``P = limit - M - 1`` (``limit``: the model's positions, 8,192 for the embedded model; every forward then stays
within them), and the context ``[P - C, P)`` — so the contexts of one document are nested (the 2,048-token
context is the last 2,048 tokens of the 4,096-token one). ``C`` larger than ``P`` is clipped to ``P``: at
``--contexts 8192`` with ``--tokens 32`` the prompt holds 8,159 tokens (column ``prompt_tokens``)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kvlab.studies.eviction.long import Prompt

POSITIONS = 8192


def texts_file() -> Path:
    from kvlab.core.data import _packaged

    return _packaged("long_texts.jsonl")


def load_texts(path=None) -> list[dict]:
    """The documents ``{"id", "text", "sources"}`` (default ``data/long_texts.jsonl``)."""
    p = Path(path) if path is not None else texts_file()
    return [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]


def position_limit(model) -> int:
    return min(POSITIONS, int(getattr(model.config, "max_position_embeddings", POSITIONS) or POSITIONS))


def cases(tokenizer, docs: list[dict], context: int, tokens: int, n: int, limit: int = POSITIONS) -> list[Prompt]:
    """The first ``n`` documents as :class:`~kvlab.studies.eviction.long.Prompt` cases at ``context`` tokens
    with a continuation of ``tokens + 1`` (module docstring). Documents too short are an error."""
    if n > len(docs):
        raise ValueError(f"--prompts {n}: only {len(docs)} long texts are shipped (data/long_texts.jsonl)")
    p = limit - tokens - 1
    if p < 2:
        raise ValueError(f"tokens={tokens} leaves no context within {limit} positions")
    out = []
    for d in docs[:n]:
        ids = [int(i) for i in tokenizer(d["text"])["input_ids"]]
        if len(ids) < p + tokens + 1:
            p_doc = len(ids) - tokens - 1
            if p_doc < context:
                raise ValueError(f"document {d['id']} has {len(ids)} tokens: too short for a {context}-token "
                                 f"context and {tokens + 1} continuation tokens")
            q = p_doc
        else:
            q = p
        c = min(context, q)
        out.append(Prompt(doc=d["id"], context=int(context), ctx=tuple(ids[q - c:q]), cont=tuple(ids[q:q + tokens + 1])))
    return out


def digest(case: Prompt) -> str:
    """A short hash of a case's token ids (its run key names the exact text it ran)."""
    h = hashlib.sha256(json.dumps([case.ctx, case.cont]).encode()).hexdigest()
    return h[:16]
