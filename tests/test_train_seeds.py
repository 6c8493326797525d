"""Training randomness in the intervals (issue 37, item 5): ``TrainConfig.data_seed`` (same data, other training
seed) without moving any shipped key, the hierarchical bootstrap over seeds × prompts, and the ``train-seeds``
command end to end on tiny random-config models trained for a couple of steps (seconds)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from kvlab.harness.hierarchical import hierarchical_bootstrap, paired_matrix, prompt_only
from kvlab.train.config import BASE_TRAIN, DEFAULT_SHAPE, DEFAULT_TRAIN, RECIPES, TrainConfig

# --------------------------------------------------------------------------- data_seed and the keys


def test_data_seed_leaves_every_shipped_key_and_name_alone():
    from kvlab.train.names import trained_name
    from kvlab.train.shipped import manifest, shipped_entry

    # the default recipe's students, as shipped (kvlab/train/shipped/manifest.json) before data_seed existed
    want = {("overfill", DEFAULT_TRAIN): "dd05051f6b", ("standalone", DEFAULT_TRAIN): "29c76e0686",
            ("refresh-aware", DEFAULT_TRAIN): "def3e85c0a", ("overfill", BASE_TRAIN): "a2a958138c",
            ("standalone", BASE_TRAIN): "b693a7011f", ("refresh-aware", BASE_TRAIN): "34b155997c"}
    shipped = {e["file"].removesuffix(".safetensors") for e in manifest()}
    for (v, cfg), key in want.items():
        for same in (cfg, cfg.replace(data_seed=None), cfg.replace(data_seed=cfg.seed)):
            assert same == cfg and same.data_seed is None                     # data_seed == seed IS the config
            name = trained_name(v, DEFAULT_SHAPE, same)
            assert name.endswith(f"-t{key}") and name in shipped
            assert shipped_entry(v, DEFAULT_SHAPE, same) is not None
    assert "data_seed" not in DEFAULT_TRAIN.recipe() and DEFAULT_TRAIN.data_seed_used == 0
    for cfg in RECIPES.values():
        assert trained_name("overfill", DEFAULT_SHAPE, cfg) == trained_name("overfill", DEFAULT_SHAPE,
                                                                            cfg.replace(data_seed=0))


def test_a_training_seed_over_fixed_data_reuses_the_data_and_gets_its_own_key():
    from kvlab.train.names import train_command, train_data_key, trained_name

    fixed = DEFAULT_TRAIN.replace(seed=1, data_seed=0)
    own = DEFAULT_TRAIN.replace(seed=1)
    assert fixed.data_seed_used == 0 and own.data_seed_used == 1
    assert train_data_key(fixed) == train_data_key(DEFAULT_TRAIN) != train_data_key(own)   # seed 0's teacher data
    names = {trained_name("overfill", DEFAULT_SHAPE, c) for c in (DEFAULT_TRAIN, fixed, own)}
    assert len(names) == 3
    assert fixed.key("overfill", "s", "d") != own.key("overfill", "s", "d")   # same data hash: data_seed is keyed too
    assert "--seed 1 --data-seed 0" in train_command("overfill", DEFAULT_SHAPE, fixed)
    assert "--data-seed" not in train_command("overfill", DEFAULT_SHAPE, own)
    with pytest.raises(ValueError, match="--data-seed"):
        TrainConfig(data_seed="0")


def test_train_student_passes_data_seed():
    from kvlab.cli import build_parser
    from kvlab.train.command import train_config

    args = build_parser().parse_args(["train-student", "--seed", "2", "--data-seed", "0"])
    cfg = train_config(args)
    assert (cfg.seed, cfg.data_seed) == (2, 0)
    assert train_config(build_parser().parse_args(["train-student"])) == DEFAULT_TRAIN


# --------------------------------------------------------------------------- the hierarchical bootstrap


def _crossed(rng, S=4, P=32, mu=0.1, seed_sd=0.2, prompt_sd=0.3, noise=0.05):
    return (mu + rng.normal(0, seed_sd, (S, 1)) + rng.normal(0, prompt_sd, (1, P)) + rng.normal(0, noise, (S, P)))


def test_hierarchical_bootstrap_recovers_the_mean_and_is_deterministic():
    d = _crossed(np.random.default_rng(0))
    h = hierarchical_bootstrap(d, seed=3)
    assert h.d == pytest.approx(d.mean()) and h.lo < h.d < h.hi
    assert (h.n_seeds, h.n_prompts) == (4, 32) and h.mde == pytest.approx(2.8 * h.se)
    assert h.sd_seeds == pytest.approx(d.mean(1).std(ddof=1))
    assert hierarchical_bootstrap(d, seed=3) == h and hierarchical_bootstrap(d, seed=4) != h
    assert hierarchical_bootstrap([list(r) for r in d], seed=3) == h       # lists of per-seed rows work too
    # a large sample of constant shift: the interval sits around it
    big = 0.5 + np.random.default_rng(1).normal(0, 0.1, (8, 200))
    hb = hierarchical_bootstrap(big)
    assert hb.lo < 0.5 < hb.hi and hb.hi - hb.lo < 0.05


def test_seeds_that_differ_widen_the_interval_beyond_the_prompt_bootstrap():
    rng = np.random.default_rng(2)
    wide = _crossed(rng, seed_sd=0.3)
    h = hierarchical_bootstrap(wide)
    lo, hi = prompt_only(wide)
    assert h.hi - h.lo > 1.5 * (hi - lo)
    # seeds that agree (copies of one seed's differences): crossed = the prompt bootstrap; nested would halve it
    one = _crossed(rng, S=1)
    copies = np.repeat(one, 4, axis=0)
    hc, hn = hierarchical_bootstrap(copies), hierarchical_bootstrap(copies, design="nested")
    lo, hi = prompt_only(copies)
    assert hc.hi - hc.lo == pytest.approx(hi - lo, rel=0.1)
    assert hn.hi - hn.lo < 0.7 * (hi - lo)          # independent prompt draws per seed understate a crossed design


def test_one_seed_reduces_to_the_prompt_bootstrap():
    from kvlab.harness.experiment import paired_bootstrap

    d = _crossed(np.random.default_rng(5), S=1, P=40)[0]
    h = hierarchical_bootstrap([d], min_seeds=1)
    per_run = pd.DataFrame({"policy": ["a"] * 40 + ["b"] * 40, "prompt_idx": list(range(40)) * 2,
                            "m": list(d) + [0.0] * 40})
    pb = paired_bootstrap(per_run, "b", metrics=("m",)).set_index("policy").loc["a"]
    assert h.d == pytest.approx(pb.d_m)
    assert h.hi - h.lo == pytest.approx(pb.d_m_hi - pb.d_m_lo, rel=0.1)


@pytest.mark.parametrize("diffs, match", [
    ([[0.1, 0.2, 0.3]], "diffs has 1 training seed"),
    ([[0.1, 0.2, 0.3], [0.1, 0.2]], "diffs is ragged"),
    ([[0.1], [0.2]], "at least 2 prompts"),
    ([[0.1, float("nan")], [0.2, 0.3]], r"diffs\[0\]\[1\]"),
    (np.zeros(5), "2-D"),
])
def test_bad_input_names_the_parameter(diffs, match):
    with pytest.raises(ValueError, match=match):
        hierarchical_bootstrap(diffs)


def test_bad_options_name_the_parameter():
    with pytest.raises(ValueError, match="design="):
        hierarchical_bootstrap(np.zeros((2, 3)), design="pooled")
    with pytest.raises(ValueError, match="n_boot="):
        hierarchical_bootstrap(np.zeros((2, 3)), n_boot=10)


def test_paired_matrix_refuses_a_seed_that_lacks_a_prompt():
    rows = [{"train_seed": s, "policy": p, "prompt_idx": i, "m": s + i + (p == "a")}
            for s in (0, 1) for p in ("a", "b") for i in range(3)]
    seeds, d = paired_matrix(pd.DataFrame(rows), "a", "b", "m")
    assert seeds == [0, 1] and np.array_equal(d, np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"train_seed=1: no 'a' / 'b' run for prompt\(s\) \[2\]"):
        paired_matrix(pd.DataFrame(rows[:-4] + rows[-3:]), "a", "b", "m")


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("argv, flag", [
    (["--seeds", "1"], "--seeds"),
    (["--student", "standalone"], "--student"),
    (["--teacher", "org/model"], "--teacher"),
    (["--train-steps", "0"], "--train-steps"),
])
def test_bad_seed_arguments_fail_before_any_model_loads(argv, flag, monkeypatch, capsys):
    import kvlab.core.models as models
    from kvlab.cli import main

    def boom(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    for name in ("load_model", "load_teacher", "teacher_path", "pruned_student_path"):
        monkeypatch.setattr(models, name, boom)
    assert main(["train-seeds", "--no-progress"] + argv) == 2
    assert flag in capsys.readouterr().err


def _tiny_models(args, variant, shape, recipe, seeds):
    """The embedded models' stand-in: a tiny teacher, and per seed two tiny students really trained (2 steps)
    with that seed over the data of ``--data-seed``, named by their training key like the cached ones."""
    import torch

    from kvlab.core.models import LM
    from kvlab.core.tiny import make_tiny_lm
    from kvlab.studies.training.seeds import seed_config
    from kvlab.train.tiny import tiny_examples
    from kvlab.train.trainer import train

    tiny = TrainConfig(steps=2, batch=3, lr=3e-2, warmup=1, train_prompts=10, heldout=2, eval_every=2, topk=16,
                       lora_rank=0, history=0.0, refresh_gap=(2, 4))
    teacher = make_tiny_lm(seed=0)
    tmp = args.out / "tiny_train"

    def students_for(s):
        cfg = seed_config(tiny, s, args.data_seed)
        data = tiny_examples(teacher, 10, seed=cfg.data_seed_used, tokens=6)
        out = []
        for v in (variant, "standalone"):
            with torch.random.fork_rng():
                lm = make_tiny_lm(seed=1, intermediate_size=48)
            train(lm, teacher, data[:-2], data[-2:], v, cfg, tmp / f"{v}-{s}", progress=False)
            out.append(LM(lm.model, lm.tokenizer, f"tiny-{v}-t{cfg.key(v, 'tiny', 'd')}"))
        return tuple(out)

    return teacher, students_for


def test_the_command_writes_both_comparisons_over_three_trained_seeds(tmp_path, monkeypatch, capsys):
    from kvlab.cli import main
    from kvlab.studies.training import seeds

    monkeypatch.setattr(seeds, "embedded_models", _tiny_models)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hello there", "the cat sat")))
    out = tmp_path / "out"
    argv = ["train-seeds", "--seeds", "3", "--prompts", "2", "--tokens", "4", "--prompts-file", str(prompts),
            "--out", str(out), "--runs", str(tmp_path / "runs"), "--no-progress", "--batch", "2"]
    assert main(argv) == 0
    t = pd.read_csv(out / "train_seeds.csv")
    assert list(t.comparison) == ["overfill − standalone", "overfill − student"]
    assert {"comparison", "n_seeds", "n_prompts", "d", "lo", "hi", "mde", "sd_seeds"} <= set(t.columns)
    assert (t.n_seeds == 3).all() and (t.n_prompts == 2).all() and (t.data_seed.astype(str) == "0").all()
    assert (t.decoder_variant == "overfill").all()
    assert (t.lo <= t.d).all() and (t.d <= t.hi).all()
    runs = pd.read_csv(out / "train_seeds_runs.csv")
    assert len(runs) == 3 * 3 * 2 and set(runs.policy) == {"overfill", "student", "standalone"}
    assert runs.kl_forced.notna().all()
    k = runs.set_index(["train_seed", "policy", "prompt_idx"]).kl_forced
    d = [k[(s, "overfill", i)] - k[(s, "standalone", i)] for s in range(3) for i in range(2)]
    assert t.set_index("comparison").loc["overfill − standalone", "d"] == pytest.approx(np.mean(d))
    assert runs[runs.policy == "standalone"].model.nunique() == 3        # three seeds, three trained students
    assert runs[runs.policy == "overfill"].groupby("train_seed").kl_forced.mean().nunique() == 3
    per_seed = pd.read_csv(out / "train_seeds_seeds.csv")
    assert len(per_seed) == 6 and set(per_seed.train_seed) == {0, 1, 2}
    md = (out / "train_seeds.md").read_text()
    assert "the distillation data fixed" in md and "train-seeds --seeds 3 --prompts 2 --tokens 4 --data-seed 0" in md
    assert "a reduced recipe" not in md and "negative = OverFill better" in md
    # a second call reuses every stored run and gives the same table
    assert main(argv) == 0
    assert pd.read_csv(out / "train_seeds.csv").equals(t)


def test_the_notes_name_the_recipe_and_the_randomness():
    from kvlab.studies.training.seeds import randomness_text, recipe_text, seed_config

    assert recipe_text(seed_config(DEFAULT_TRAIN, 2, 0)).startswith("the default recipe")
    assert recipe_text(BASE_TRAIN).startswith("the base recipe (80 steps")
    assert recipe_text(DEFAULT_TRAIN.replace(steps=40)).startswith("a reduced recipe (40 steps")
    assert "the distillation data fixed" in randomness_text(0)
    assert "each seed's own teacher samples" in randomness_text(None)
