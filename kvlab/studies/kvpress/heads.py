"""What kvlab's head-mean costs a press that scores per KV head, measured (issue 38, item 1).

kvpress keeps a top-k per KV head; kvlab's cache keeps one live set per layer, so the bridge averages a press's
scores over heads (:mod:`kvlab.eviction.scorer`). For prompt compression at the same budget on the same prompts:

* ``kl_head_mean`` — kvlab's own path: ``ScorerPolicy(press, budget, sinks=0)`` (one cut of the prompt to the
  top ``budget`` head-mean scores per layer), teacher-forced on the full cache's continuation through kvlab's
  cache and batched decode loop (the kvpress table's ``kl_forced``, :func:`kvlab.studies.kvpress.table.forced_kl_runs`);
* ``kl_per_head`` — kvpress's own selection: a full prefill of the prompt (the forward kvpress's hooks see:
  each layer's input kwargs captured, its cache after the forward), then per layer ``press.compress(...)`` at
  ``compression_ratio`` such that ``budget`` entries survive per KV head (``(1, H_kv, budget, D)``: a top-k per
  head), put into an HF ``DynamicCache``; the continuation is fed teacher-forced through the model on that cache
  (absolute positions ``T, T+1, …`` for RoPE). Row 0 is the prefill's own distribution in both (compression
  follows the prefill forward, as in kvpress and kvlab). KL(p_full ‖ q) averaged over the continuation.
* ``kl_head_mean_hf`` — a check of the second path: the same HF-cache construction with the head-mean kept set
  (the press's ``score`` averaged over heads, top-``budget``, the same set on every head); it should equal
  ``kl_head_mean`` up to float error and ties.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import pandas as pd
import torch

from kvlab.harness.experiment import RunSpec, paired_bootstrap, write_table
from kvlab.store import RunStore
from kvlab.studies.kvpress.presses import PER_HEAD, make_press
from kvlab.studies.kvpress.table import forced_kl_runs, references

COLUMNS = ["press", "budget", "kl_head_mean", "kl_per_head", "d", "lo", "hi", "mde", "n_prompts", "kl_head_mean_hf",
           "check_max_abs"]


def capture_prefill(model, ids: list[int]):
    """``(first_logprobs (V,), cache, kwargs per layer)``: the full prefill of ``ids`` in an HF ``DynamicCache`` and each
    attention module's input kwargs (what kvpress's forward hook reads), captured by removable pre-hooks."""
    from transformers import DynamicCache

    from kvlab.cache.attention import attention_modules
    from kvlab.core.compat import cache_kwarg

    got, handles = {}, []
    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(
            lambda mod, a, kw, i=m.layer_idx: got.__setitem__(i, dict(kw)), with_kwargs=True))
    cache = DynamicCache()
    try:
        out = model(input_ids=torch.tensor([ids], device=model.device), **{cache_kwarg(model): cache}, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return torch.log_softmax(out.logits[0, -1].float(), -1).cpu(), cache, got


def _head_mean_select(press, mod, hidden, keys, values, kw, budget: int):
    scores = press.score(mod, hidden, keys, values, None, kw).float().mean(dim=1)            # (1, T)
    idx = scores.topk(budget, dim=-1).indices.sort(dim=-1).values                           # (1, budget)
    idx = idx[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
    return keys.gather(2, idx).contiguous(), values.gather(2, idx).contiguous()


@torch.inference_mode()
def hf_forced_logprobs(teacher, press, prompt_ids: list[int], reference: Sequence[int], budget: int,
                       per_head: bool = True) -> torch.Tensor:
    """``(N, V)`` log-distributions over ``reference`` after the prompt's cache is compressed to ``budget``
    entries per KV head by kvpress's ``compress`` (``per_head``) or to the head-mean top-``budget``."""
    from transformers import DynamicCache

    from kvlab.cache.attention import attention_modules
    from kvlab.core.compat import cache_kwarg
    from kvlab.eviction.kvpress.call import PressModule

    model = teacher.model
    T, y = len(prompt_ids), [int(t) for t in reference]
    if budget >= T:
        raise ValueError(f"budget={budget} must be below the prompt's {T} tokens (nothing would be compressed)")
    press.post_init_from_model(model)
    first, cache, got = capture_prefill(model, list(prompt_ids))
    press.compression_ratio = 1.0 - (budget + 0.5) / T       # kvpress keeps int(T * (1 - ratio)) = budget
    small = DynamicCache()
    for m in attention_modules(model):
        i = m.layer_idx
        kw, keys, values = got[i], cache.layers[i].keys, cache.layers[i].values
        mod = PressModule(m, model.model.rotary_emb)
        if per_head:
            k2, v2 = press.compress(mod, kw["hidden_states"], keys, values, None, kw)
        else:
            k2, v2 = _head_mean_select(press, mod, kw["hidden_states"], keys, values, kw, budget)
        if k2.shape[2] != budget:
            raise RuntimeError(f"{type(press).__name__}.compress kept {k2.shape[2]} entries, not {budget}")
        small.update(k2, v2, i)
    n = len(y) - 1
    rows = [first.view(1, -1)]
    if n > 0:
        dev = model.device
        out = model(input_ids=torch.tensor([y[:-1]], device=dev), **{cache_kwarg(model): small}, use_cache=True,
                    position_ids=torch.arange(T, T + n, device=dev).view(1, -1),
                    cache_position=torch.arange(budget, budget + n, device=dev))
        rows.append(torch.log_softmax(out.logits[0].float(), -1).cpu())
    return torch.cat(rows)


def per_head_scores(teacher, press_name: str, prompt: str, reference: Sequence[int], budget: int,
                    store: RunStore) -> dict:
    """``{"kl_per_head", "kl_head_mean_hf"}`` of one prompt (stored under the reference's hash)."""
    from kvlab.core.metrics import kl_rows, teacher_logprobs
    from kvlab.decode.keys import policy_dict
    from kvlab.eviction.scorer import ScorerPolicy

    ref = [int(t) for t in reference]
    key = {"kind": "kvpress_per_head", "teacher": teacher.fingerprint, "prompt": prompt, "budget": budget,
           "press": policy_dict(ScorerPolicy(make_press(press_name), budget=budget)),
           "reference": hashlib.sha256(str(ref).encode()).hexdigest()[:16], "ref_tokens": len(ref)}

    def compute() -> dict:
        x = teacher.encode_prompt(prompt, chat=True)
        p = teacher_logprobs(teacher, x, ref)
        out = {}
        for col, per_head in (("kl_per_head", True), ("kl_head_mean_hf", False)):
            q = hf_forced_logprobs(teacher, make_press(press_name), x, ref, budget, per_head=per_head)
            out[col] = float(kl_rows(p, q).mean())
        return out

    return store.get_or_run(key, compute)


def heads_runs(teacher, spec: RunSpec, presses: Sequence[str], budget: int, store: RunStore,
               progress: bool = False) -> pd.DataFrame:
    """Per (press, prompt): ``kl_head_mean`` (kvlab's path), ``kl_per_head`` and ``kl_head_mean_hf``."""
    from kvlab.eviction.scorer import ScorerPolicy

    refs = references(teacher, spec, store)
    rows, p_full = [], {}
    for name in presses:
        if progress:
            print(f"heads: {name}", flush=True)
        pol = ScorerPolicy(make_press(name), budget=budget, sinks=0)
        got = forced_kl_runs(teacher, spec, pol, refs, store, p_full)
        for i, (p, r) in enumerate(zip(spec.prompts, got)):
            hf = per_head_scores(teacher, name, p, refs[i], budget, store)
            rows.append({"press": name, "prompt_idx": i, "kl_head_mean": float(r["kl_forced"]), **hf})
    return pd.DataFrame(rows)


def heads_summary(per_run: pd.DataFrame, budget: int) -> pd.DataFrame:
    """Per press: means, ``d`` = kl_per_head − kl_head_mean (paired over prompts; bootstrap 95 % ``lo``/``hi``;
    ``mde``), the check column and its largest per-prompt gap to ``kl_head_mean``."""
    from kvlab.core.metrics import mde

    out = []
    for name, g in per_run.groupby("press", sort=False):
        long = pd.concat([g.assign(policy="head_mean", kl=g.kl_head_mean), g.assign(policy="per_head", kl=g.kl_per_head)])
        pb = paired_bootstrap(long, "head_mean", metrics=("kl",)).set_index("policy").loc["per_head"]
        out.append({"press": name, "budget": budget, "kl_head_mean": g.kl_head_mean.mean(),
                    "kl_per_head": g.kl_per_head.mean(), "d": pb["d_kl"], "lo": pb["d_kl_lo"], "hi": pb["d_kl_hi"],
                    "mde": mde((g.kl_per_head - g.kl_head_mean).to_numpy()), "n_prompts": g.prompt_idx.nunique(),
                    "kl_head_mean_hf": g.kl_head_mean_hf.mean(),
                    "check_max_abs": float((g.kl_head_mean_hf - g.kl_head_mean).abs().max())})
    return pd.DataFrame(out, columns=COLUMNS)


def heads_table(teacher, spec: RunSpec, presses: Sequence[str] = PER_HEAD, budget: int = 128,
                store: RunStore | None = None, progress: bool = False) -> pd.DataFrame:
    if store is None:
        raise ValueError("store is required: a kvlab.store.RunStore (e.g. RunStore('runs')) so a rerun is free")
    return heads_summary(heads_runs(teacher, spec, presses, budget, store, progress), budget)


def heads_notes(spec: RunSpec, budget: int, command: str | None = None, prompt_note: str = "") -> list[str]:
    notes = [
        f"Prompt compression at {budget} entries per layer (per KV head for `kl_per_head`), no sinks, on the "
        f"embedded teacher (CPU, fp32), {len(spec.prompts)} prompts{prompt_note}, {spec.tokens} tokens of the full "
        "cache's own sampled continuation (the kvpress table's references), teacher-forced.",
        "`kl_head_mean`: kvlab's path — `ScorerPolicy(press, budget, sinks=0)`, one live set per layer ranked by the "
        "press's scores averaged over KV heads, through kvlab's cache and decode loop. `kl_per_head`: kvpress's own "
        "selection — per layer `press.compress(...)` on the full prefill (a top-k per KV head), those keys/values put "
        "in an HF DynamicCache, the continuation fed through the model on it. Both: mean KL(p_full ‖ q) in nats over "
        "the continuation (row 0 is the prefill's distribution in both).",
        "`d` = kl_per_head − kl_head_mean, paired over prompts (negative: per-head kept sets are closer to the full "
        "cache, i.e. what the head-mean costs); `lo`/`hi`: paired bootstrap 95 % interval "
        "(kvlab.harness.experiment.paired_bootstrap); `mde`: 2.8 × SD / √n.",
        "`kl_head_mean_hf`: the HF-cache path with the head-mean kept set — a check that the two paths agree; "
        "`check_max_abs`: its largest per-prompt gap to `kl_head_mean` (float error and score ties).",
    ]
    if command:
        notes.append(f"Command: `{command}`")
    return notes


def write_heads(table: pd.DataFrame, out: Path, notes: Sequence[str], name: str = "evict_kvpress_heads") -> list[Path]:
    return write_table(table.round(5), Path(out), name, notes=list(notes))


__all__ = ["COLUMNS", "heads_runs", "heads_summary", "heads_table", "heads_notes", "hf_forced_logprobs",
           "per_head_scores", "write_heads"]
