"""Command-line argument helpers shared by the CLI and the train report: the model flags checked
before any model loads, and the :class:`~kvlab.harness.experiment.RunSpec` a command's
flags describe. Torch-free at import.
It touches nothing.
"""
from __future__ import annotations


def check_model_args(args) -> None:
    """Model/device flags, before any model loads (ValueError naming the flag and the fix)."""
    import math

    from kvlab.core.models import check_model_ref, resolve_device, resolve_dtype

    r = args.student_ratio
    if r is not None:
        if math.isnan(r) or not 0.0 <= r < 1.0:
            raise ValueError(f"--student-ratio={r} must be in [0, 1): the fraction of the embedded student's MLP "
                             "channels pruned away (e.g. 0.3)")
    from kvlab.train.command import student_choice

    variant, _ = student_choice(args)   # --student variant / --prune shape (ValueError naming the flag)
    from kvlab.train.command import train_choice

    train_choice(args)                  # --train-steps
    for flag, ref in (("--teacher", args.teacher), ("--student", None if variant else args.student)):
        if ref is not None:
            try:
                check_model_ref(ref)
            except (ValueError, FileNotFoundError) as e:
                raise type(e)(f"{flag}: {e}") from None
    try:
        resolve_dtype(args.dtype, resolve_device(args.device))
    except ValueError as e:
        raise ValueError(f"--device/--dtype: {e}") from None


def run_spec(args):
    from kvlab.core.data import load_prompts
    from kvlab.decode import Sampling
    from kvlab.harness.experiment import RunSpec

    from kvlab.core.data import SET_TOKENS, prompt_set_file

    check_model_args(args)
    pset = getattr(args, "prompt_set", None) or "default"
    path = args.prompts_file if args.prompts_file is not None else prompt_set_file(pset)
    rows = load_prompts(path, n=args.prompts)
    sampling = Sampling(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    tokens = args.tokens if args.tokens is not None else SET_TOKENS[pset]
    return RunSpec(prompts=tuple(r["prompt"] for r in rows), tokens=tokens, sampling=sampling,
                   batch=getattr(args, "batch", None))
