"""Tiny random-config Llama models: fast, offline stand-ins for the embedded pair.
Builds models in memory from a seed; reads and writes no files.

Unit tests use them (``tests/conftest.py``), and so does a sweep grid with ``models = "tiny"``.
They share the KV geometry whatever their MLP width, so a tiny teacher and a narrower tiny student
form a valid OverFill pair.
"""
from __future__ import annotations

import torch


class TinyTokenizer:
    """Enough of a tokenizer for the decode loop: ids <-> strings, no chat template."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos_token_id = 2
        self.chat_template = None

    def __call__(self, text: str):
        return {"input_ids": [3 + (ord(c) % (self.vocab_size - 3)) for c in text]}

    def decode(self, ids, skip_special_tokens: bool = False):
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def get_vocab(self):
        return {f"t{i}": i for i in range(self.vocab_size)}


def make_tiny_lm(seed: int = 0, intermediate_size: int = 96, num_kv_heads: int = 2, layers: int = 2,
                 vocab: int = 128, rope_theta: float = 10000.0, head_dim: int = 16):
    """A random ``LlamaForCausalLM`` (hidden 64, 4 query heads) wrapped as a kvlab ``LM``.

    Seeds torch's global generator with ``seed`` (wrap the call in ``torch.random.fork_rng`` to
    leave the caller's generator alone)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvlab.core.models import LM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=intermediate_size,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=num_kv_heads,
                      head_dim=head_dim, max_position_embeddings=512, rope_theta=rope_theta,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    return LM(model=model, tokenizer=TinyTokenizer(vocab), name=f"tiny-{seed}-{intermediate_size}")
