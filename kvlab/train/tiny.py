"""Training examples from a tiny random-config teacher (:mod:`kvlab.core.tiny`): fast, offline stand-ins for the
teacher's responses, for unit tests and the tiny training study."""
from __future__ import annotations

import torch

from kvlab.train.data import Example


def tiny_examples(teacher, n: int, seed: int = 0, k: int = 16, tokens: int = 12) -> list:
    """``n`` training examples whose responses and top-``k`` targets come from the tiny ``teacher`` itself.

    Each prompt is 4-8 random ids; the response is ``tokens`` ids sampled from the teacher with a generator
    seeded by ``seed`` (the global generator is left alone)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(4, 9, (1,), generator=g))
        prompt = torch.randint(3, teacher.tokenizer.vocab_size, (P,), generator=g).tolist()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(tokens):
                logits = teacher.model(torch.tensor([ids])).logits[0, -1]
                ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=g)))
            lp = teacher.model(torch.tensor([ids])).logits[0, P - 1:-1].log_softmax(-1)   # (R, V)
        v, ix = lp.topk(k, -1)
        out.append(Example(f"x{i}", tuple(prompt), tuple(ids[P:]), ix, v))
    return out
