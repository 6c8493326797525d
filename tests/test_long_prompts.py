"""The long-prompt / short-answer prompt set: what data/long_prompts_source.py writes, its lengths,
disjoint from the training prompts, and usable as --prompt-set long."""
from __future__ import annotations

import importlib.util
import json

import pytest

from kvlab.core.data import DATA_DIR, PROMPT_SETS, SET_TOKENS, load_prompts, long_prompts_file, prompt_set_file


def _source():
    spec = importlib.util.spec_from_file_location("long_prompts_source", DATA_DIR / "long_prompts_source.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_file_is_what_the_source_writes():
    assert long_prompts_file().read_text(encoding="utf-8") == _source().render()


def test_long_set_is_large_long_and_mixed():
    rows = load_prompts(long_prompts_file())
    assert len(rows) >= 40 and len({r["prompt"] for r in rows}) == len(rows)
    assert {r["kind"] for r in rows} == {"document", "few-shot", "multi-turn"}
    assert {r["kind"] for r in rows[:3]} == {"document", "few-shot", "multi-turn"}      # the first n mix the kinds
    for r in rows:       # 300-800 tokens ≈ 1,200-3,600 characters of English (checked with the tokenizer below)
        assert 1200 <= len(r["prompt"]) <= 3600, r["id"]
        assert "two or three sentences" in r["prompt"] and r["prompt"].rstrip().endswith(("A:", "Assistant:", "sentences."))
    assert SET_TOKENS["long"] in range(32, 65) and PROMPT_SETS["long"] == "long_prompts.jsonl"


def test_long_set_is_disjoint_from_the_training_prompts():
    from kvlab.train.prompts import near_duplicate, train_prompts_file

    train = [json.loads(line)["prompt"] for line in train_prompts_file().read_text().splitlines()]
    src = _source()
    pool = [q for pairs in src.TOPICS.values() for q, _ in pairs]
    for r in load_prompts(long_prompts_file()):
        for t in train:
            assert not near_duplicate(r["question"], t), (r["id"], t)
            assert not near_duplicate(r["prompt"], t), (r["id"], t)
    bad = [(q, t) for q in pool for t in train if near_duplicate(q, t)]
    assert bad == []
    ev = [r["prompt"] for r in load_prompts()]
    assert not set(ev) & {r["prompt"] for r in load_prompts(long_prompts_file())}


def test_prompt_set_names_and_errors():
    assert prompt_set_file("default").name == "prompts.jsonl"
    with pytest.raises(ValueError, match="--prompt-set='short' must be one of"):
        prompt_set_file("short")


def test_cli_prompt_set_long_picks_the_file_and_the_answer_length():
    from kvlab.cli import build_parser
    from kvlab.harness.args import run_spec

    args = build_parser().parse_args(["baselines", "--prompt-set", "long", "--prompts", "3", "--student", "pruned"])
    spec = run_spec(args)
    rows = load_prompts(long_prompts_file(), n=3)
    assert spec.prompts == tuple(r["prompt"] for r in rows) and spec.tokens == SET_TOKENS["long"]
    args = build_parser().parse_args(["baselines", "--prompts", "2", "--student", "pruned"])
    assert run_spec(args).tokens == 128 and run_spec(args).prompts[0] == load_prompts()[0]["prompt"]


@pytest.mark.integration
def test_long_prompts_are_300_to_800_tokens_with_the_teacher_tokenizer():
    from kvlab.core.models import load_teacher

    tok = load_teacher().tokenizer
    for r in load_prompts(long_prompts_file()):
        n = len(tok(r["prompt"])["input_ids"])
        assert 300 <= n <= 800, (r["id"], n)
