"""Long-regime training data (kvlab.train.history, issue 27): multi-turn histories of cached teacher responses
rendered with the chat template, teacher-forced top-k over the final response, cached and resumable; mixed into
training at --history's share (the default recipe and its keys unchanged); the long held-out KL in the log.
Tiny random models and a character-level chat tokenizer only (seconds)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from kvlab.core.models import LM
from kvlab.core.tiny import make_tiny_lm
from kvlab.train.tiny import tiny_examples
from kvlab.train.config import DEFAULT_SHAPE, DEFAULT_TRAIN, TrainConfig
from kvlab.train.data import Example

# SmolLM2-135M-Instruct's chat template (from the GGUF's tokenizer.chat_template): a default system prompt when the
# first message is not a system message, then every turn
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


class CharChat:
    """A character-level tokenizer with the real chat template: ids are code points (invertible)."""

    chat_template = SMOL_TEMPLATE
    eos_token_id = 2

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
        import jinja2

        text = jinja2.Template(self.chat_template).render(messages=messages, add_generation_prompt=add_generation_prompt)
        return [ord(c) for c in text] if tokenize else text

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _chat_lm():
    return LM(model=None, tokenizer=CharChat(), name="char-chat")


def _pool(n=12, seed=0):
    """Examples whose responses are text (code points) and their prompt texts by id."""
    rng = random.Random(seed)
    texts, out = {}, []
    for i in range(n):
        texts[f"p{i}"] = f"Question {i}: how does thing {rng.randint(0, 999)} work?"
        resp = [ord(c) for c in f"Answer {i} " + "w" * rng.randint(20, 60)]
        out.append(Example(f"p{i}", tuple(ord(c) for c in texts[f"p{i}"]), tuple(resp), torch.zeros(len(resp), 1,
                                                                                                   dtype=torch.long),
                           torch.zeros(len(resp), 1)))
    return out, texts


# --------------------------------------------------------------------------- keys and flags


def test_history_zero_keeps_the_keys_from_before_history_and_the_default_is_shipped():
    """history = 0 must not move any key (the students trained before the option existed keep their names and
    their shipped adapters: --train-recipe base); the default recipe (160 steps, history 0.5, the training
    Pareto's pick) is its own student, shipped for every trained variant."""
    from kvlab.train.config import BASE_TRAIN, PARETO_TRAIN, RECIPES
    from kvlab.train.names import train_data_key, trained_name
    from kvlab.train.shipped import manifest, recipe, shipped_entry

    assert DEFAULT_TRAIN.history == 0.5 and DEFAULT_TRAIN.steps == 160
    assert PARETO_TRAIN == DEFAULT_TRAIN == RECIPES["default"] == RECIPES["pareto"]
    assert BASE_TRAIN == DEFAULT_TRAIN.replace(steps=80, history=0.0) == RECIPES["base"]
    assert "history" not in recipe(BASE_TRAIN) and "history_tokens" not in recipe(BASE_TRAIN)
    for cfg, overfill_tail in ((BASE_TRAIN, "-ta2a958138c"), (DEFAULT_TRAIN, "-tdd05051f6b")):
        names = {e["variant"]: e["name"] for e in manifest() if e["recipe"] == recipe(cfg)}
        assert set(names) == {"overfill", "standalone", "refresh-aware"}
        assert names["overfill"].endswith(overfill_tail)
        for v, name in names.items():
            assert trained_name(v, DEFAULT_SHAPE, cfg) == name
            assert shipped_entry(v, DEFAULT_SHAPE, cfg)["name"] == name
    for v in ("overfill", "standalone", "refresh-aware"):     # history 0: the history settings do not matter
        assert trained_name(v, DEFAULT_SHAPE, BASE_TRAIN.replace(history_tokens=(10, 20))) == trained_name(
            v, DEFAULT_SHAPE, BASE_TRAIN)
    assert train_data_key(DEFAULT_TRAIN) == "d464f6799ef6" == train_data_key(BASE_TRAIN)
    assert recipe(DEFAULT_TRAIN)["history"] == 0.5
    # full weights: the key from before LoRA and history existed
    assert BASE_TRAIN.replace(lora_rank=0, lr=1e-3).key("overfill", "h0.20-i0.50", "d464f6799ef6") == "9968c83ee2"
    # history > 0: the history settings matter
    keys = {trained_name("overfill", DEFAULT_SHAPE, c) for c in
            (BASE_TRAIN.replace(steps=160), DEFAULT_TRAIN, DEFAULT_TRAIN.replace(history=0.25),
             DEFAULT_TRAIN.replace(history_tokens=(300, 600)))}
    assert len(keys) == 4
    assert shipped_entry("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN.replace(history=0.25)) is None


@pytest.mark.parametrize("kw, match", [
    ({"history": 1.5}, "--history=1.5 must be a number in"), ({"history": -0.1}, "--history"),
    ({"history": float("nan")}, "--history"), ({"history": "half"}, "--history"), ({"history": True}, "--history"),
    ({"history_tokens": (800, 300)}, "history_tokens"), ({"history_tokens": (0, 10)}, "history_tokens"),
])
def test_bad_history_settings_name_the_flag(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kw)


def test_cli_history_flag(monkeypatch, capsys):
    import kvlab.core.models as models
    from kvlab.cli import build_parser, main
    from kvlab.train.command import train_config
    from kvlab.train.names import train_command

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    for name in ("load_model", "load_teacher", "teacher_path", "pruned_student_path"):
        monkeypatch.setattr(models, name, boom)
    assert main(["train-student", "--student", "overfill", "--history", "2", "--no-progress"]) == 2
    assert "--history=2.0 must be a number in [0, 1]" in capsys.readouterr().err
    args = build_parser().parse_args(["train-student", "--student", "overfill", "--history", "0"])
    cfg = train_config(args)
    assert cfg.history == 0.0 and cfg.replace(history=0.5) == DEFAULT_TRAIN
    assert train_command("overfill", DEFAULT_SHAPE, cfg).endswith("--history 0")       # not the default: said
    assert "--history" not in train_command("overfill", DEFAULT_SHAPE, DEFAULT_TRAIN)
    assert build_parser().parse_args(["train-student"]).history == DEFAULT_TRAIN.history == 0.5


def test_plan_says_it_builds_the_history_examples(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    from kvlab.train.plan import plan

    msg = plan(["overfill"], DEFAULT_SHAPE, DEFAULT_TRAIN.replace(history=0.25)).message()
    assert "history examples (--history 0.25" in msg and "--history 0.25`" in msg
    # the default recipe builds them too (at a shape whose students are not shipped)
    assert "history examples (--history 0.5" in plan(["overfill"], "i0.30", DEFAULT_TRAIN).message()


# --------------------------------------------------------------------------- rendering a history


def test_encode_chat_renders_like_encode_prompt():
    lm = _chat_lm()
    one = [{"role": "user", "content": "Why?"}]
    assert lm.encode_chat(one) == lm.encode_prompt("Why?")
    text = lm.tokenizer.decode(lm.encode_chat([{"role": "user", "content": "A?"}, {"role": "assistant", "content": "a."},
                                               {"role": "user", "content": "B?"}]))
    assert text == (SYSTEM + "<|im_start|>user\nA?<|im_end|>\n<|im_start|>assistant\na.<|im_end|>\n"
                    "<|im_start|>user\nB?<|im_end|>\n<|im_start|>assistant\n")
    tiny = make_tiny_lm(seed=0)                 # no chat template: the turns' tokens concatenated
    assert tiny.encode_chat(one) == tiny.encode_prompt("Why?")
    assert tiny.encode_chat([{"role": "user", "content": "ab"}, {"role": "assistant", "content": "c"},
                             {"role": "user", "content": "d"}]) == tiny.encode_prompt("abcd")
    with pytest.raises(ValueError, match="ending in a user turn"):
        lm.encode_chat([{"role": "assistant", "content": "x"}])


def test_a_history_is_earlier_training_turns_then_the_final_prompt_within_the_length_range():
    from kvlab.train.history import plan_history

    lm = _chat_lm()
    pool, texts = _pool(14)
    lo, hi = 300, 800
    counts = []
    for final in pool:
        ids, turns = plan_history(lm, final, pool, texts, lo, hi, seed=0)
        assert lo <= len(ids) <= hi
        assert final.id not in turns and len(set(turns)) == len(turns) and set(turns) <= {e.id for e in pool}
        text = lm.tokenizer.decode(ids)
        want = SYSTEM
        for t in turns:      # each earlier turn: its prompt, then the teacher's cached response as the answer
            ans = lm.tokenizer.decode(pool[int(t[1:])].response_ids)
            want += f"<|im_start|>user\n{texts[t]}<|im_end|>\n<|im_start|>assistant\n{ans}<|im_end|>\n"
        assert text == want + f"<|im_start|>user\n{texts[final.id]}<|im_end|>\n<|im_start|>assistant\n"
        assert text.count("<|im_start|>system") == 1
        assert plan_history(lm, final, pool, texts, lo, hi, seed=0) == (ids, turns)       # seeded
        counts.append(len(turns))
    assert min(counts) >= 1 and len(set(counts)) > 1          # the number of turns varies with the drawn target
    others = [plan_history(lm, f, pool, texts, lo, hi, seed=1)[1] for f in pool]
    assert others != [plan_history(lm, f, pool, texts, lo, hi, seed=0)[1] for f in pool]


def test_held_out_long_examples_take_their_turns_from_the_training_split_only(monkeypatch):
    """history_data on the real training prompts: held-out prompts end the held-out histories and never appear as
    an earlier turn; the texts are training prompts (disjoint from data/long_prompts.jsonl: test_long_prompts)."""
    from kvlab.train.data import load_train_prompts
    from kvlab.train.history import history_data, plan_history

    cfg = DEFAULT_TRAIN.replace(train_prompts=20, heldout=4, history=0.5, history_tokens=(600, 1500), topk=4)
    rows = load_train_prompts(cfg.train_prompts)
    texts = {r["id"]: r["prompt"] for r in rows}
    lm = _chat_lm()
    exs = [Example(r["id"], (), tuple(ord(c) for c in "An answer " * 8), torch.zeros(80, 1, dtype=torch.long),
                   torch.zeros(80, 1)) for r in rows]
    train_ex, held = exs[:16], exs[16:]
    for final in held:
        ids, turns = plan_history(lm, final, train_ex, texts, 600, 1500, cfg.seed)
        assert turns and not set(turns) & {e.id for e in held}
        assert lm.tokenizer.decode(ids).endswith(f"<|im_start|>user\n{texts[final.id]}<|im_end|>\n<|im_start|>assistant\n")

    calls = []

    def fake_set(teacher, finals, pool, texts_, **kw):
        calls.append(([e.id for e in finals], [e.id for e in pool], kw["tag"], kw["lo"], kw["hi"]))
        assert all(texts_[e.id] == texts[e.id] for e in finals + pool)
        return list(finals)

    import kvlab.train.history as history

    monkeypatch.setattr(history, "history_set", fake_set)
    history_data(cfg, lm, train_ex, held)
    assert history_data(cfg, lm, train_ex, held, train=False)[0] is None
    assert calls[0] == ([e.id for e in train_ex], [e.id for e in train_ex], "train", 600, 1500)
    assert calls[1] == ([e.id for e in held], [e.id for e in train_ex], "heldout", 600, 1500)


# --------------------------------------------------------------------------- teacher-forced data, cached


@pytest.fixture(scope="module")
def tiny():
    teacher = make_tiny_lm(seed=0)
    ex = tiny_examples(teacher, 12, tokens=8)
    texts = {e.id: f"question {i} about thing {i * 7}" for i, e in enumerate(ex)}
    return teacher, ex, texts


def test_history_examples_are_teacher_forced_on_the_whole_history_and_cached(tiny, tmp_path, monkeypatch):
    import kvlab.train.history as history

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(history, "PART", 3)
    teacher, ex, texts = tiny
    calls = {"n": 0}
    real = history.forced_topk

    def crashing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("interrupted")        # an interrupted build: the finished parts stay on disk
        return real(*a, **k)

    monkeypatch.setattr(history, "forced_topk", crashing)
    kw = dict(lo=60, hi=140, seed=0, topk=8, tag="train", progress=False)
    with pytest.raises(RuntimeError, match="interrupted"):
        history.history_set(teacher, ex, ex, texts, **kw)
    calls["n"] = 100
    got = history.history_set(teacher, ex, ex, texts, **kw)
    assert calls["n"] == 100 + len(ex) - 6            # resumed: the two finished parts (6 examples) were kept
    assert len(got) == len(ex)
    for h, e in zip(got, ex):
        assert h.response_ids == e.response_ids and h.id == f"hist-{e.id}"
        assert 60 <= len(h.prompt_ids) <= 140 and len(h.prompt_ids) > len(teacher.encode_prompt(texts[e.id]))
        assert list(h.prompt_ids[-len(teacher.encode_prompt(texts[e.id])):]) == teacher.encode_prompt(texts[e.id])
        with torch.no_grad():        # the teacher's distribution at each response position, given the whole history
            lp = teacher.model(torch.tensor([list(h.prompt_ids + h.response_ids)])).logits[0].log_softmax(-1)
        P = len(h.prompt_ids)
        v, i = lp[P - 1:-1].topk(8, -1)
        torch.testing.assert_close(h.topk_logp, v, rtol=1e-4, atol=1e-4)
        assert torch.equal(h.topk_idx, i)
        assert not torch.allclose(h.topk_logp[:, 0], e.topk_logp[:, 0], atol=1e-3)     # context changed them
    root = next(tmp_path.glob("train/history-*"))
    meta = json.loads((root / "meta.json").read_text())
    assert meta["n"] == len(ex) and meta["in_range"] == len(ex) and meta["turns"]["min"] >= 1
    assert not list(root.glob("part-*"))
    monkeypatch.setattr(history, "forced_topk", lambda *a, **k: pytest.fail("recomputed a cached set"))
    again = history.history_set(teacher, ex, ex, texts, **kw)
    assert all(torch.equal(a.topk_logp, b.topk_logp) and a.prompt_ids == b.prompt_ids for a, b in zip(again, got))
    with pytest.raises(ValueError, match="texts has no prompt text"):
        history.history_set(teacher, ex, ex, {}, **kw)


# --------------------------------------------------------------------------- training with histories


@pytest.fixture(scope="module")
def hist(tiny, tmp_path_factory):
    import os

    from kvlab.train.history import history_set

    teacher, ex, texts = tiny
    old = os.environ.get("KVLAB_CACHE")
    os.environ["KVLAB_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    try:
        return history_set(teacher, ex, ex[:-2], texts, lo=60, hi=140, seed=0, topk=16, progress=False)
    finally:
        os.environ.pop("KVLAB_CACHE") if old is None else os.environ.__setitem__("KVLAB_CACHE", old)


def _cfg(**kw):
    base = dict(steps=6, batch=3, lr=3e-3, warmup=1, train_prompts=12, heldout=2, eval_every=3, topk=16, lora_rank=0,
                history=0.0)
    base.update(kw)
    return TrainConfig(**base)


def test_overfill_forward_on_a_history_reads_the_teachers_prefill_of_the_whole_history(tiny, hist):
    from kvlab.train.forward import student_forward, teacher_cache

    teacher = tiny[0]
    student = make_tiny_lm(seed=1, intermediate_size=48)
    h = hist[0]
    P, R = len(h.prompt_ids), len(h.response_ids)
    fw = student_forward(student, teacher, h, "overfill")
    assert fw.n_prompt == P and fw.positions.tolist() == list(range(P, P + R - 1))
    tc = teacher_cache(teacher, h.prompt_ids)
    for layer in range(2):
        k_t, v_t = tc.kv(layer)
        torch.testing.assert_close(fw.cache.layers[layer].keys[:, :, :P].detach(), k_t)
        torch.testing.assert_close(fw.cache.layers[layer].values[:, :, :P].detach(), v_t)


def test_training_mixes_history_examples_at_the_share_and_logs_the_long_heldout_kl(tiny, hist, tmp_path):
    from kvlab.train.trainer import heldout_kl, pick_example, train

    teacher, ex = tiny[0], tiny[1]
    tr, held, tr_h, held_h = ex[:-2], ex[-2:], hist[:-2], hist[-2:]

    def run(cfg, name, **kw):
        s = make_tiny_lm(seed=1, intermediate_size=48)
        return s, train(s, teacher, tr, held, "overfill", cfg, tmp_path / name, progress=False, **kw)

    _, plain = run(_cfg(), "plain")
    _, zero = run(_cfg(), "zero", history=tr_h)          # history = 0: the history examples are never used
    assert [r["loss"] for r in zero.log] == [r["loss"] for r in plain.log]
    assert "history" not in plain.log[0] and "heldout_kl_long" not in plain.log[-1]
    cfg = _cfg(history=0.5)
    s, half = run(cfg, "half", history=tr_h, heldout_long=held_h)
    per_step = [r["history"] for r in half.log]
    want = [sum(pick_example(tr, tr_h, 0, cfg, st, j)[1] for j in range(cfg.batch)) for st in range(cfg.steps)]
    assert per_step == want and 0 < sum(per_step) < cfg.steps * cfg.batch
    assert [r["loss"] for r in half.log] != [r["loss"] for r in plain.log]
    evals = [r for r in half.log if "heldout_kl" in r]
    assert [r["step"] for r in evals] == [3, 6] and all("heldout_kl_long" in r and "heldout_ce_long" in r for r in evals)
    assert evals[-1]["heldout_kl_long"] == pytest.approx(heldout_kl(s, teacher, held_h, "overfill")["heldout_kl"])
    assert evals[-1]["heldout_kl"] == pytest.approx(heldout_kl(s, teacher, held, "overfill")["heldout_kl"])
    _, full = run(_cfg(history=1.0), "full", history=tr_h)
    assert [r["history"] for r in full.log] == [3] * 6
    with pytest.raises(ValueError, match="--history=0.5: train\\(\\) needs history examples"):
        run(cfg, "none")


def test_train_student_builds_the_history_data_and_logs_both_heldout_kls(tmp_path, monkeypatch):
    """train_student's wiring with --history (tiny models stand in for the embedded pair): the short data, then
    the training and held-out history sets (cached), then the trainer with both; stopped after one step."""
    import kvlab.core.models as models
    import kvlab.train.weights as weights
    from kvlab.train.data import load_train_prompts

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    cfg = DEFAULT_TRAIN.replace(train_prompts=10, heldout=2, steps=3, batch=2, eval_every=1, topk=8, lora_rank=0,
                                history=0.5, history_tokens=(150, 400))
    teacher = make_tiny_lm(seed=0)
    rows = load_train_prompts(cfg.train_prompts)
    exs = [Example(r["id"], tuple(teacher.encode_prompt(r["prompt"])), e.response_ids, e.topk_idx[:, :8],
                   e.topk_logp[:, :8]) for r, e in zip(rows, tiny_examples(teacher, len(rows), tokens=6))]
    monkeypatch.setattr(models, "load_teacher", lambda *a, **k: teacher)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: make_tiny_lm(seed=1, intermediate_size=48))
    monkeypatch.setattr(models, "pruned_student_path", lambda shape: tmp_path / "pruned")
    monkeypatch.setattr(weights, "training_data", lambda cfg_, t, progress=True: (exs[:-2], exs[-2:]))
    run = weights.train_student("overfill", DEFAULT_SHAPE, cfg, progress=False, stop_after=1)
    log = torch.load(run / "ckpt.pt", weights_only=False)["log"]
    assert len(log) == 1 and "history" in log[0] and log[0]["heldout_kl_long"] > 0 and log[0]["heldout_kl"] > 0
    sets = {json.loads((d / "meta.json").read_text())["tag"]: json.loads((d / "meta.json").read_text())
            for d in (tmp_path / "train").glob("history-*")}
    assert sets["train"]["n"] == 8 and sets["heldout"]["n"] == 2
    assert sets["train"]["history_tokens"] == [150, 400] and sets["train"]["turns"]["min"] >= 1
    assert run.name == weights.trained_name("overfill", DEFAULT_SHAPE, cfg) and "-t" in run.name
