"""kvlab.core.prune keeps MLP channels by importance: a random choice of channels must do worse."""
from __future__ import annotations

import copy

import pytest
import torch

from kvlab.core.data import calibration_file, load_prompts
from kvlab.core.metrics import kl_rows
from kvlab.core.models import LM
from kvlab.core.prune import prune_lm, prune_mlp

from conftest import make_tiny_lm


@torch.inference_mode()
def _kl_to_teacher(teacher: LM, student: LM, prompts) -> float:
    """Mean per-token KL(p_T || q_S) over every position of ``prompts`` (teacher-forced)."""
    total, n = 0.0, 0
    for p in prompts:
        ids = torch.tensor([teacher.encode_prompt(p)], device=teacher.device)
        t = torch.log_softmax(teacher.model(input_ids=ids).logits[0].float(), -1)   # (T, V)
        s = torch.log_softmax(student.model(input_ids=ids).logits[0].float(), -1)
        kl = kl_rows(t, s)
        total, n = total + float(kl.sum()), n + len(kl)
    return total / n


def _importance_vs_random(teacher: LM, ratio: float, calib, held_out, n_random: int):
    pruned = prune_lm(LM(copy.deepcopy(teacher.model), teacher.tokenizer, "pruned"), ratio, calib)
    n_inter = teacher.model.config.intermediate_size
    n_keep = pruned.model.config.intermediate_size
    assert n_keep == round(n_inter * (1 - ratio))
    g = torch.Generator().manual_seed(0)
    randoms = []
    for _ in range(n_random):
        m = copy.deepcopy(teacher.model)
        prune_mlp(m, [torch.sort(torch.randperm(n_inter, generator=g)[:n_keep]).values
                      for _ in m.model.layers])
        randoms.append(_kl_to_teacher(teacher, LM(m, teacher.tokenizer, "random"), held_out))
    return _kl_to_teacher(teacher, pruned, held_out), randoms


def test_importance_pruning_beats_random_channels_tiny():
    """Tiny random-config model: importance-kept channels give about half the KL of random ones."""
    prompts = [r["prompt"] for r in load_prompts(calibration_file())]
    for seed in (0, 1):
        teacher = make_tiny_lm(seed=seed, intermediate_size=96)
        imp, randoms = _importance_vs_random(teacher, 0.5, prompts[:8], prompts[8:16], n_random=4)
        assert imp < 0.8 * min(randoms), (seed, imp, randoms)


@pytest.mark.integration
def test_importance_pruning_beats_random_channels_real(real_pair):
    """The embedded teacher at the default ratio: the pruned student is far closer than random channels."""
    from kvlab.core.models import DEFAULT_PRUNE

    teacher, _ = real_pair
    prompts = [r["prompt"] for r in load_prompts(calibration_file())]
    imp, randoms = _importance_vs_random(teacher, DEFAULT_PRUNE, prompts[:4], prompts[4:6], n_random=1)
    assert imp < 0.5 * randoms[0], (imp, randoms)
