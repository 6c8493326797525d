"""Training the student (kvlab.train): data hygiene, the variants' forwards, loss going down, exact resume,
argument checks before any model loads. Tiny random models only (seconds)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from kvlab.core.compat import cache_kwarg

from kvlab.core.tiny import make_tiny_lm
from kvlab.train.tiny import tiny_examples
from kvlab.train.config import TrainConfig
from kvlab.train.data import Example
from kvlab.train.forward import spliced_cache, student_forward, teacher_cache, token_losses
from kvlab.train.trainer import heldout_kl, train


# --------------------------------------------------------------------------- data


def test_train_prompts_are_many_and_disjoint_from_eval_and_calibration():
    from kvlab.train.prompts import build_train_prompts, excluded_prompts, near_duplicate, train_prompts_file

    rows = [json.loads(line) for line in train_prompts_file().read_text().splitlines()]
    assert len(rows) >= 400
    assert len({r["prompt"] for r in rows}) == len(rows)
    excluded = excluded_prompts()
    assert len(excluded) == 96
    bad = [(r["prompt"], e) for r in rows for e in excluded if near_duplicate(r["prompt"], e)]
    assert bad == []
    assert rows == build_train_prompts(excluded)   # the committed file is what the code writes


def test_near_duplicate_catches_paraphrases_and_passes_other_subjects():
    from kvlab.train.prompts import near_duplicate

    e = "ELI5: Why is the ocean salty when the rivers that flow into it are fresh?"
    assert near_duplicate("Explain like I'm five: why is the ocean salty if the rivers flowing into it are fresh?", e)
    assert near_duplicate(e.replace("ELI5", "eli5").replace("?", "."), e)
    assert not near_duplicate("ELI5: how do bees make honey? Explain it simply, step by step.", e)


# --------------------------------------------------------------------------- tiny examples


@pytest.fixture(scope="module")
def pair():
    return make_tiny_lm(seed=0), make_tiny_lm(seed=1, intermediate_size=48)


@pytest.fixture(scope="module")
def examples(pair):
    return tiny_examples(pair[0], 14)


def _cfg(**kw):
    base = dict(steps=6, batch=3, lr=3e-3, warmup=1, train_prompts=14, heldout=2, eval_every=3, topk=16, lora_rank=0,
                history=0.0)
    base.update(kw)
    return TrainConfig(**base)


# --------------------------------------------------------------------------- forwards


def test_overfill_forward_reads_the_teachers_prompt_kv(pair, examples):
    from kvlab.cache import KVCache

    teacher, _ = pair
    student = make_tiny_lm(seed=1, intermediate_size=48)
    ex = examples[0]
    P, R = len(ex.prompt_ids), len(ex.response_ids)
    tc = teacher_cache(teacher, ex.prompt_ids)
    assert tc.writers == ["T"] * P
    fw = student_forward(student, teacher, ex, "overfill")
    assert fw.positions.tolist() == list(range(P, P + R - 1))          # positions continue after the prompt
    assert fw.targets.tolist() == list(ex.response_ids[1:])
    # the same logits as the decode-time computation: student steps over the teacher-written cache
    ref = tc.copy()
    with torch.inference_mode():
        want = ref.forward(student.model, list(ex.response_ids[:-1]), writer="s", logits="all")
    assert ref.writers == ["T"] * P + ["s"] * (R - 1)
    torch.testing.assert_close(fw.logits.detach(), want, rtol=1e-4, atol=1e-4)
    # the prompt entries of the forward's cache are the teacher's, not the student's own
    k_t, _ = tc.kv(0)
    torch.testing.assert_close(fw.cache.layers[0].keys[:, :, :P].detach(), k_t)
    with torch.no_grad():
        own = student.model(torch.tensor([list(ex.prompt_ids)]), use_cache=True).past_key_values.layers[0].keys
    assert not torch.allclose(own, k_t, atol=1e-3)
    # and the loss depends on them: gradients reach the student only, and other K/V change the logits
    ce, kl = token_losses(fw, ex)
    (ce.mean() + kl.mean()).backward()
    assert all(p.grad is None for p in teacher.model.parameters())
    assert student.model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    other = spliced_cache(teacher_cache(teacher, [5] * P), P)
    with torch.no_grad():
        out = student.model(input_ids=torch.tensor([list(ex.response_ids[:-1])]), position_ids=fw.positions.view(1, -1),
                            **{cache_kwarg(student.model): other})
    assert not torch.allclose(out.logits[0], fw.logits.detach(), atol=1e-4)


def test_standalone_forward_prefills_its_own_prompt(pair, examples):
    teacher, student = pair
    ex = examples[1]
    P, R = len(ex.prompt_ids), len(ex.response_ids)
    fw = student_forward(student, teacher, ex, "standalone")
    assert fw.positions.tolist() == list(range(P - 1, P + R - 1))
    assert fw.targets.tolist() == list(ex.response_ids)
    with torch.no_grad():
        want = student.model(torch.tensor([list(ex.prompt_ids + ex.response_ids[:-1])])).logits[0, P - 1:]
    torch.testing.assert_close(fw.logits.detach(), want, rtol=1e-4, atol=1e-4)


def test_refresh_aware_forward_splices_teacher_kv_at_refresh_points(pair, examples):
    teacher, student = pair
    ex = examples[2]
    P, R = len(ex.prompt_ids), len(ex.response_ids)
    fw = student_forward(student, teacher, ex, "refresh-aware", random.Random(3), gap=(3, 5), p_none=0.0)
    m = fw.mask
    assert m is not None and m.any() and not m.all() and m[: int(m.sum())].all()   # a prefix: everything before the last refresh
    full = teacher_cache(teacher, ex.prompt_ids + ex.response_ids[:-1])
    for layer in (0, 1):
        k_t, v_t = full.kv(layer)
        keys, vals = fw.cache.layers[layer].keys.detach(), fw.cache.layers[layer].values.detach()
        idx = P + torch.nonzero(m).view(-1)
        torch.testing.assert_close(keys[:, :, idx], k_t[:, :, idx])
        torch.testing.assert_close(vals[:, :, idx], v_t[:, :, idx])
        rest = P + torch.nonzero(~m).view(-1)
        assert not torch.allclose(keys[:, :, rest], k_t[:, :, rest], atol=1e-3)   # student-written
    plain = student_forward(student, teacher, ex, "overfill")
    assert not torch.allclose(plain.logits, fw.logits, atol=1e-4)


# --------------------------------------------------------------------------- training


def test_a_few_steps_lower_the_loss_and_the_heldout_kl(pair, examples, tmp_path):
    teacher = pair[0]
    student = make_tiny_lm(seed=1, intermediate_size=48)
    cfg = _cfg(steps=8, ce_weight=0.5)
    before = heldout_kl(student, teacher, examples[-2:], "overfill")["heldout_kl"]
    res = train(student, teacher, examples[:-2], examples[-2:], "overfill", cfg, tmp_path, progress=False)
    losses = [r["loss"] for r in res.log]
    assert res.finished and len(losses) == 8
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert res.log[-1]["heldout_kl"] < before


@pytest.mark.parametrize("variant,lora", [("overfill", 0), ("refresh-aware", 0), ("overfill", 4)])
def test_resume_after_interrupt_equals_uninterrupted(pair, examples, tmp_path, variant, lora):
    from kvlab.train.lora import with_lora

    def fresh():      # the student as train_student builds it (LoRA: adapters on the pruned model, the default)
        lm = make_tiny_lm(seed=1, intermediate_size=48)
        return with_lora(lm, lora, seed=0) if lora else lm

    teacher = pair[0]
    cfg = _cfg(steps=5, lora_rank=lora)
    a = fresh()
    train(a, teacher, examples[:-2], examples[-2:], variant, cfg, tmp_path / "a", progress=False)
    b = fresh()
    r1 = train(b, teacher, examples[:-2], examples[-2:], variant, cfg, tmp_path / "b", progress=False, stop_after=2)
    assert not r1.finished and (tmp_path / "b" / "ckpt.pt").is_file()
    c = fresh()                                              # a fresh process: weights from the checkpoint
    r2 = train(c, teacher, examples[:-2], examples[-2:], variant, cfg, tmp_path / "b", progress=False)
    assert r2.finished and [r["step"] for r in r2.log] == [1, 2, 3, 4, 5]
    for (n, pa), (_, pc) in zip(a.model.state_dict().items(), c.model.state_dict().items()):
        assert torch.equal(pa, pc), n


def test_same_seed_same_weights_other_seed_other_batches(pair, examples, tmp_path):
    from kvlab.train.trainer import batch_indices

    teacher = pair[0]
    cfg = _cfg(steps=2)
    a, b = make_tiny_lm(seed=1, intermediate_size=48), make_tiny_lm(seed=1, intermediate_size=48)
    train(a, teacher, examples[:-2], examples[-2:], "standalone", cfg, tmp_path / "a", progress=False)
    train(b, teacher, examples[:-2], examples[-2:], "standalone", cfg, tmp_path / "b", progress=False)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    assert batch_indices(0, 12, 6, 0) + batch_indices(1, 12, 6, 0) != list(range(12))
    assert sorted(batch_indices(0, 12, 6, 0) + batch_indices(1, 12, 6, 0)) == list(range(12))   # an epoch = a permutation
    assert batch_indices(0, 12, 6, 0) != batch_indices(0, 12, 6, 1)


# --------------------------------------------------------------------------- pruning


def test_hidden_and_mlp_pruning_keeps_the_kv_geometry(pair):
    from kvlab.core.compat import kv_compat
    from kvlab.core.prune import PruneShape, prune_lm

    teacher = pair[0]
    lm = make_tiny_lm(seed=0)
    prune_lm(lm, "h0.25,i0.5", ["hello world, this is calibration text", "another calibration sentence"])
    cfg = lm.model.config
    assert cfg.hidden_size == 48 and cfg.intermediate_size == 48 and cfg.head_dim == 16
    att = lm.model.model.layers[0].self_attn
    assert (att.q_proj.in_features, att.q_proj.out_features) == (48, 64)
    assert (att.k_proj.in_features, att.k_proj.out_features) == (48, 32)
    assert att.o_proj.out_features == 48
    assert kv_compat(teacher, lm).ok
    tc = teacher_cache(teacher, [5, 6, 7])
    with torch.no_grad():    # the pruned model reads teacher K/V
        out = lm.model(input_ids=torch.tensor([[8, 9]]), position_ids=torch.tensor([[3, 4]]),
                       **{cache_kwarg(lm.model): spliced_cache(tc, 3)})
    assert out.logits.shape == (1, 2, 128) and torch.isfinite(out.logits).all()
    assert PruneShape.parse("h0.45,i0.45") == PruneShape(0.45, 0.45)
    assert PruneShape.parse("i0.3").label == "i0.30" and PruneShape.parse(0.3) == PruneShape(0.0, 0.3)
    assert PruneShape(0.45, 0.45).label == "h0.45-i0.45"


@pytest.mark.parametrize("spec", ["h1.5,i0.45", "i-0.1", "x0.3", "", "h0.45,i1.0"])
def test_bad_prune_shape_names_the_flag(spec):
    from kvlab.core.prune import PruneShape

    with pytest.raises(ValueError, match="--prune"):
        PruneShape.parse(spec)


# --------------------------------------------------------------------------- arguments and cache


@pytest.fixture
def no_model_loads(monkeypatch):
    import kvlab.core.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    for name in ("load_model", "load_teacher", "teacher_path", "pruned_student_path"):
        monkeypatch.setattr(models, name, boom)


@pytest.mark.parametrize("argv, flag", [
    (["train-student", "--student", "bogus"], "--student"),
    (["train-student", "--student", "pruned"], "--student"),
    (["train-student", "--steps", "0"], "--steps"),
    (["train-student", "--batch", "-1"], "--batch"),
    (["train-student", "--prune", "h1.2,i0.3"], "--prune"),
    (["train-student", "--ce-weight", "1.5"], "--ce-weight"),
    (["train-student", "--lr", "0"], "--lr"),
    (["train-student", "--lora-rank", "-2"], "--lora-rank"),
    (["baselines", "--student", "overfil"], "--student"),
    (["baselines", "--prune", "i1.0"], "--prune"),
    (["baselines", "--train-steps", "0"], "--train-steps"),
    (["train-study", "--train-steps", "-3"], "--train-steps"),
    (["refresh", "--student", "standalone", "--student-ratio", "0.3"], "--student-ratio"),
    (["all", "--student", "overfill", "--prune", "h0.45,i7"], "--prune"),
])
def test_bad_arguments_fail_before_any_model_loads(argv, flag, no_model_loads, capsys):
    from kvlab.cli import main

    assert main(argv + ["--no-progress"]) == 2
    assert flag in capsys.readouterr().err


def test_train_recipe_flag_picks_a_shipped_recipe(no_model_loads):
    """The default recipe is the training Pareto's pick (160 steps, half the examples multi-turn histories; pareto
    names it too); --train-recipe base selects the 80-step short-prompt students shipped beside it; with
    --train-steps that recipe's steps change; a bad name fails at parsing, naming the flag."""
    from kvlab.cli import build_parser
    from kvlab.train.command import train_choice
    from kvlab.train.config import BASE_TRAIN, DEFAULT_TRAIN, PARETO_TRAIN
    from kvlab.train.shipped import shipped_entry

    parse = build_parser().parse_args
    assert train_choice(parse(["baselines"])) == DEFAULT_TRAIN
    assert train_choice(parse(["baselines", "--train-recipe", "base"])) == BASE_TRAIN
    assert train_choice(parse(["baselines", "--train-recipe", "pareto"])) == PARETO_TRAIN == DEFAULT_TRAIN
    assert train_choice(parse(["refresh", "--train-recipe", "pareto", "--train-steps", "40"])) == PARETO_TRAIN.replace(
        steps=40)
    assert train_choice(parse(["train-study", "--train-steps", "40"])) == DEFAULT_TRAIN.replace(steps=40)
    for cfg in (DEFAULT_TRAIN, BASE_TRAIN, PARETO_TRAIN):
        for v in ("overfill", "standalone", "refresh-aware"):
            assert shipped_entry(v, "h0.20,i0.50", cfg) is not None
    with pytest.raises(SystemExit):
        parse(["baselines", "--train-recipe", "best"])


def test_missing_trained_student_raises_naming_the_command(tmp_path, monkeypatch, no_model_loads):
    from kvlab.train.pair import load_pair, load_student

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="python -m kvlab train-student --student overfill --prune h0.45,i0.45"):
        load_student("overfill", "h0.45,i0.45")
    with pytest.raises(ValueError, match="--student"):
        load_pair(variant="distilled")
    from kvlab.train.config import DEFAULT_TRAIN

    with pytest.raises(FileNotFoundError, match="--steps 240"):    # a non-default recipe names its own command
        load_student("overfill", "h0.45,i0.45", train=DEFAULT_TRAIN.replace(steps=240))


def test_training_key_separates_what_changes_the_weights():
    from kvlab.train.config import TrainConfig

    base = TrainConfig()
    k = base.key("overfill", "i0.30", "d1")
    assert k == TrainConfig(threads=1, eval_every=3).key("overfill", "i0.30", "d1")
    others = {base.key("standalone", "i0.30", "d1"), base.key("overfill", "h0.45-i0.45", "d1"),
              base.key("overfill", "i0.30", "d2"), base.replace(steps=7).key("overfill", "i0.30", "d1"),
              base.replace(seed=1).key("overfill", "i0.30", "d1")}
    assert k not in others and len(others) == 5


def test_full_weight_keys_did_not_move_when_lora_arrived():
    """Adding ``lora_rank`` must not invalidate trained students in users' caches (full weights: same key)."""
    from kvlab.train.config import BASE_TRAIN, TrainConfig

    full = BASE_TRAIN.replace(lora_rank=0, lr=1e-3)       # 80 steps, short prompts only: the recipe of that era
    assert full.key("overfill", "h0.20-i0.50", "d464f6799ef6") == "9968c83ee2"
    assert full.replace(lora_rank=8).key("overfill", "h0.20-i0.50", "d464f6799ef6") != "9968c83ee2"
    assert TrainConfig().lora_rank == 16 and TrainConfig().key("overfill", "h0.20-i0.50", "d464f6799ef6") not in (
        "9968c83ee2", "618500dc49")        # the default is LoRA, seeded adapters (618500dc49: before the seeding)


def test_lora_init_depends_on_the_seed_only():
    from kvlab.train.lora import with_lora

    def adapters(seed, burn):
        torch.rand(burn)                    # whatever ran before in the process
        lm = with_lora(make_tiny_lm(seed=1, intermediate_size=48), 4, seed=seed)
        return [p.detach().clone() for n, p in lm.model.named_parameters() if "lora_" in n]

    a, b, c = adapters(0, 1), adapters(0, 7), adapters(1, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    with pytest.raises(ValueError, match="--lora-rank"):
        TrainConfig(lora_rank=-1)


def test_lora_trains_only_adapters_and_merges_into_a_plain_model(pair, examples, tmp_path):
    from kvlab.train.lora import adapter_tensors, merge_adapter, merged, with_lora

    teacher = pair[0]
    base = make_tiny_lm(seed=1, intermediate_size=48)
    names = sorted(n for n, _ in base.model.named_parameters())
    before = {n: p.detach().clone() for n, p in base.model.named_parameters()}
    student = with_lora(base, 4)
    trainable = [n for n, p in student.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    held0 = heldout_kl(student, teacher, examples[-2:], "overfill")["heldout_kl"]
    res = train(student, teacher, examples[:-2], examples[-2:], "overfill", _cfg(steps=8, lora_rank=4), tmp_path,
                progress=False)
    assert res.finished and res.log[-1]["heldout_kl"] < held0
    x = torch.tensor([[5, 9, 17, 33, 2]])
    tensors, scale = adapter_tensors(student)
    assert all(t.dtype == torch.float16 for t in tensors.values()) and scale == 2.0      # alpha 2r / r
    with torch.no_grad():
        want = student.model(x).logits
        plain = merged(student)
        got = plain.model(x).logits
    assert sorted(n for n, _ in plain.model.named_parameters()) == names      # saved/loaded like full weights
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)                # fp16 adapters: close, not equal
    rebuilt = make_tiny_lm(seed=1, intermediate_size=48)                      # the pruned base + the fp16 file
    merge_adapter(rebuilt.model, tensors, scale)
    assert all(torch.equal(p, dict(rebuilt.model.named_parameters())[n]) for n, p in plain.model.named_parameters())
    changed = [n for n, p in plain.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed and all("proj" in n for n in changed)                      # embeddings/norms untouched


def test_tiny_training_curves_are_a_real_short_run():
    """The notebooks' fallback curves: the trainer on tiny models; loss falls, refresh-aware refreshes,
    the caller's generator is untouched, and a variant without training is refused by name."""
    from kvlab.studies.training.study import tiny_training_curves

    torch.manual_seed(123)
    before = torch.get_rng_state()
    df = tiny_training_curves(("standalone", "refresh-aware"), steps=6)
    assert torch.equal(torch.get_rng_state(), before)
    assert list(df["variant"].unique()) == ["standalone", "refresh-aware"]
    for _, g in df.groupby("variant"):
        assert list(g["step"]) == list(range(1, 7))
        assert g["loss"].iloc[-2:].mean() < g["loss"].iloc[:2].mean()
        assert g["heldout_kl"].notna().sum() == 2
    assert df.loc[df.variant == "refresh-aware", "refreshed"].sum() > 0
    assert df.loc[df.variant == "standalone", "refreshed"].sum() == 0
    with pytest.raises(ValueError, match="variants=\\['pruned'\\]"):
        tiny_training_curves(("pruned",))
