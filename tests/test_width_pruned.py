"""Width-pruned checkpoints (OverFill's ``pruned-h0.45-i0.45`` decoders): a plain LlamaForCausalLM config that
keeps its heads and an explicit ``head_dim`` but has a hidden size that is not a multiple of the head count.
transformers 5 rejects that config; kvlab loads it (no attention patching) and reports any other failure by path."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvlab import kv_compat, run
from kvlab.core.models import is_width_pruned, load_model
from kvlab.core.prune import prune_hidden
from conftest import make_tiny_lm

VOCAB = 128


def _tokenizer():
    """A real (saveable) fast tokenizer over the tiny models' 128 ids: one token per character."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(97 + i % 26) + ("" if i < 26 else str(i)) for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def _save(lm, folder: Path, tok) -> Path:
    """config.json + model.safetensors as a plain LlamaForCausalLM checkpoint (transformers 5's
    save_pretrained validates the config first, so a width-pruned one is written by hand, as older
    transformers wrote the OverFill decoders)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    cfg = lm.model.config.to_dict()
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in lm.model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pruned_folders(tmp_path_factory):
    """(teacher folder, student folder): the tiny teacher (hidden 64, 4 heads × 16) and a width-pruned copy
    keeping 45 hidden channels (45 % 4 != 0), saved by save_pretrained like the OverFill decoder."""
    root = tmp_path_factory.mktemp("pruned")
    tok = _tokenizer()
    teacher = make_tiny_lm(seed=0)
    student = make_tiny_lm(seed=0)
    keep = torch.sort(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:45]).values
    prune_hidden(student.model, keep)
    return _save(teacher, root / "teacher", tok), _save(student, root / "student", tok)


def test_the_saved_student_is_the_format_transformers_rejects(pruned_folders):
    from transformers import AutoConfig

    cfg = json.loads((pruned_folders[1] / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (45, 4, 16)
    assert is_width_pruned(cfg) and not is_width_pruned(json.loads((pruned_folders[0] / "config.json").read_text()))
    with pytest.raises(Exception, match="not a multiple"):
        AutoConfig.from_pretrained(pruned_folders[1])


def test_width_pruned_pair_loads_passes_kv_compat_and_decodes_overfill(pruned_folders):
    from transformers import LlamaForCausalLM

    teacher, student = (load_model(p, device="cpu") for p in pruned_folders)
    assert type(student.model) is LlamaForCausalLM                       # the architecture's own code
    att = student.model.model.layers[0].self_attn
    assert (att.q_proj.in_features, att.q_proj.out_features, att.o_proj.out_features) == (45, 64, 45)
    assert student.config.head_dim == 16 and student.config.hidden_size == 45
    assert kv_compat(teacher, student).ok
    tr = run(teacher, student, "why is the sky blue", mode="overfill", max_new_tokens=6, ignore_eos=True)
    assert [r.source for r in tr.records] == ["teacher"] + ["student"] * 5
    assert all(torch.isfinite(torch.tensor(r.logprob)) for r in tr.records)
    # the loaded weights are the saved ones: same logits as the in-memory pruned model
    ref = make_tiny_lm(seed=0)
    keep = torch.sort(torch.randperm(64, generator=torch.Generator().manual_seed(0))[:45]).values
    prune_hidden(ref.model, keep)
    ids = torch.tensor([[5, 9, 17, 33]])
    with torch.no_grad():
        torch.testing.assert_close(student.model(ids).logits, ref.model(ids).logits)


def test_width_pruned_student_from_the_command_line(pruned_folders, tmp_path):
    """``--teacher PATH --student PATH``: the blog's setup in one command (here on CPU, tiny stand-ins)."""
    from kvlab.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "why is the sky blue"}) + "\n")
    rc = main(["baselines", "--teacher", str(pruned_folders[0]), "--student", str(pruned_folders[1]),
               "--prompts", "1", "--tokens", "4", "--prompts-file", str(prompts), "--out", str(tmp_path / "out"),
               "--runs", str(tmp_path / "runs"), "--no-progress"])
    table = (tmp_path / "out" / "baselines.md").read_text()
    assert "overfill" in table.lower() and "student" in table.lower()
    assert rc in (0, None)


@pytest.mark.parametrize("breakage,cause", [
    ("no_weights", "weights could not be loaded"),
    ("bad_json", "config could not be read"),
    ("wrong_shape", "weights could not be loaded"),
    ("bad_heads", "not a valid config"),
    ("missing_layer", "does not cover the config"),
])
def test_any_other_load_failure_names_the_path_and_the_cause(pruned_folders, tmp_path, breakage, cause):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(pruned_folders[1], bad)
    cfg = json.loads((bad / "config.json").read_text())
    if breakage == "no_weights":
        (bad / "model.safetensors").unlink()
    elif breakage == "bad_json":
        (bad / "config.json").write_text("{not json")
    elif breakage == "wrong_shape":
        cfg["intermediate_size"] = 50
        (bad / "config.json").write_text(json.dumps(cfg))
    elif breakage == "missing_layer":
        cfg["num_hidden_layers"] = 3              # a layer the weights do not have: not random-initialised
        (bad / "config.json").write_text(json.dumps(cfg))
    elif breakage == "bad_heads":
        cfg["num_key_value_heads"] = 3            # 4 query heads cannot share 3 KV heads
        (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=cause) as e:
        load_model(bad, device="cpu")
    assert str(bad) in str(e.value)


def test_a_student_folder_without_tokenizer_reads_the_teachers(pruned_folders, tmp_path):
    import shutil

    from kvlab.train.pair import load_pair

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(pruned_folders[1] / f, bare / f)
    t, s = load_pair(str(pruned_folders[0]), str(bare), device="cpu")
    assert s.tokenizer is t.tokenizer and kv_compat(t, s).ok
