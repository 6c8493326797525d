"""The student's speed-up over the teacher next to its quality, side by side in one run, per prune shape.

For each shape: the trained ``variant`` (cached, or built from the shipped adapter) if there is one, else
the untrained pruned student (the row says which); its held-out KL(p_T ‖ q) per token on the training run's
held-out prompts, teacher-forced on the teacher's responses in the variant's own mode (OverFill: the
teacher's prefill), i.e. the held-out ``kl_forced`` of the training log; and decode ms per cached step of
teacher and student, timed alternately in one process (:func:`kvlab.studies.training.study.decode_speed`), so the
ratio holds on a loaded machine where the absolute times do not.
"""
from __future__ import annotations


def speed_quality(shapes, variant: str = "overfill", cfg=None, *, device=None, dtype=None, steps: int = 32,
                  repeats: int = 3, progress: bool = True):
    """One row per shape: params, held-out KL, teacher / student ms per step and the speed-up (a DataFrame)."""
    import pandas as pd
    import torch

    from kvlab.core.data import load_prompts
    from kvlab.core.models import load_model, load_teacher, pruned_student_path
    from kvlab.train.config import DEFAULT_TRAIN
    from kvlab.train.data import _data_dir, data_key, load_train_prompts
    from kvlab.train.names import _shape, trained_dir
    from kvlab.train.shipped import shipped_entry
    from kvlab.studies.training.study import decode_speed
    from kvlab.train.trainer import heldout_kl
    from kvlab.train.weights import read_log, trained_student_path

    cfg = cfg or DEFAULT_TRAIN
    from kvlab.train.config import DEFAULT_SHAPE

    shapes = [_shape(DEFAULT_SHAPE if s is None else s) for s in shapes]
    teacher = load_teacher(device, dtype)
    prompt = load_prompts(n=1)[0]["prompt"]
    key = data_key(load_train_prompts(cfg.train_prompts), teacher.name, cfg.tokens, cfg.topk, cfg.data_seed_used, 53)
    data = _data_dir(key) / "examples.pt"
    held = None
    if data.is_file():
        from kvlab.train.weights import training_data

        held = training_data(cfg, teacher, progress=False)[1]
    n_t = sum(p.numel() for p in teacher.model.parameters())
    rows = []
    for shape in shapes:
        trained = (trained_dir(variant, shape, cfg) / "config.json").is_file() or \
            shipped_entry(variant, shape, cfg) is not None
        path = trained_student_path(variant, shape, cfg) if trained else pruned_student_path(shape)
        student = load_model(path, device=teacher.device, dtype=teacher.dtype, local_files_only=True)
        kl = None
        if trained:
            logged = [r for r in read_log(path) if "heldout_kl" in r]
            kl = logged[-1]["heldout_kl"] if logged else None
        elif held is not None:
            kl = heldout_kl(student, teacher, held, "overfill")["heldout_kl"]
        sp = decode_speed(teacher, student, prompt, steps=steps, repeats=repeats)
        rows.append({"shape": shape.label, "student": variant if trained else "pruned (untrained)",
                     "params_M": round(sum(p.numel() for p in student.model.parameters()) / 1e6, 1),
                     "teacher_params_M": round(n_t / 1e6, 1),
                     "heldout_kl": None if kl is None else round(float(kl), 4),
                     "teacher_ms_step": round(sp["teacher_ms_step"], 2), "student_ms_step": round(sp["student_ms_step"], 2),
                     "speedup": round(sp["speedup"], 3), "device": str(teacher.device), "threads": torch.get_num_threads()})
        del student
    return pd.DataFrame(rows)
