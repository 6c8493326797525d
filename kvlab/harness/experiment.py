"""Running and storing decode runs over a prompt set: the building block of every table.
It writes runs into the run store and tables (CSV + Markdown) where it is told.

A *run* is one generation scored by the teacher. Its config (model fingerprints, prompt,
decode settings, policy) keys it in the run store (:class:`kvlab.store.results.Store`, also importable as
``kvlab.store.RunStore``), so a rerun of a table reuses finished runs, an interrupted one loses only
the run in progress, and a sweep or the playground asking for the same run gets the same row.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import pandas as pd

from kvlab.decode import BatchError, DecodeConfig, Sampling, run, run_batch
from kvlab.core.metrics import score
from kvlab.harness.costs import run_costs
from kvlab.store.results import Store as RunStore

# Per-run numbers averaged into tables; "spread" columns hold their per-prompt std.
# ``kl``: student-chosen steps only; ``kl_all``: every step (kvlab.core.metrics explains why).
METRICS = ["ttft_s", "tps", "tokens", "total_s", "e2e_tps", "teacher_ppl", "kl", "kl_all", "repeat3",
           "tail_logprob", "chars"]
SPREAD = ["teacher_ppl", "kl", "repeat3", "total_s"]
# Refresh cost per run (kvlab.harness.costs.run_costs); zero for runs without a refresh policy.
COSTS = ["refreshes", "teacher_tokens", "probe_tokens", "delta_tokens", "spliced", "teacher_s", "teacher_pct"]


# Rows per batched decode when a table computes missing runs (``--batch``; 1 = one run at a time, the
# unbatched loop). Chosen by measurement: ``python -m kvlab bench decode --batch 1,4,8,16`` (README).
DEFAULT_BATCH = 8


def check_batch(batch) -> int:
    """``batch`` as a positive int (ValueError naming ``--batch`` otherwise); None -> :data:`DEFAULT_BATCH`."""
    if batch is None:
        return DEFAULT_BATCH
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch={batch!r} must be a positive int (rows decoded together; 1 = one run at a time)")
    return batch


@dataclass(frozen=True)
class RunSpec:
    """What a table is run over: prompts, length, sampling (seed = base seed + prompt index), and how
    many runs are decoded together (``batch``; None = :data:`DEFAULT_BATCH`). ``batch`` changes how
    runs are computed, never what they are: it is not part of a run's key."""

    prompts: tuple[str, ...]
    tokens: int = 128
    sampling: Sampling = field(default_factory=lambda: Sampling(temperature=0.7, top_p=0.9, seed=0))
    batch: int | None = None

    def __post_init__(self):
        if not self.prompts:
            raise ValueError("prompts must hold at least one prompt")
        if not isinstance(self.tokens, int) or self.tokens <= 0:
            raise ValueError(f"tokens={self.tokens!r} must be a positive int")
        check_batch(self.batch)

    def sampling_for(self, i: int) -> Sampling:
        """Paired seeds: prompt ``i`` uses the same seed under every policy."""
        return replace(self.sampling, seed=self.sampling.seed + i)


def run_config(teacher, student, prompt: str, cfg: DecodeConfig, extra: dict | None = None) -> dict:
    """The full config that keys a stored run (models as :attr:`kvlab.core.models.LM.fingerprint`, which
    includes dtype and device type). ``teacher``/``student`` may also be fingerprint strings
    (a sweep driver keys runs its workers compute)."""
    def fp(m):
        return m if m is None or isinstance(m, str) else m.fingerprint

    return {"kind": "decode", "teacher": fp(teacher), "student": fp(student), "prompt": prompt,
            "decode": cfg.to_dict(), **(extra or {})}


def stored_config(teacher, student, prompt: str, cfg: DecodeConfig) -> dict:
    """The config :func:`scored_run` stores ``cfg``'s run under (it always keeps distributions)."""
    return run_config(teacher, student, prompt, replace(cfg, keep_dists=True))


def records_columns(records) -> dict:
    """Per-step records as compact columns (what figures of traces need)."""
    keep = ("token_id", "logprob", "entropy_bits", "top1_prob", "margin", "cache_len", "source",
            "refreshed", "evicted", "cache_bytes", "cache_bytes16", "meta_bytes", "forward_bytes", "wall_s", "spliced",
            "teacher_tokens", "probe_tokens", "probed")
    rows = [asdict(r) for r in records]
    out = {k: [r[k] for r in rows] for k in keep}
    out["signals"] = [dict(r.signals) for r in records]
    return out


def scored_run(teacher, student, prompt: str, cfg: DecodeConfig, store: RunStore, **run_kwargs) -> dict:
    """One stored, scored generation (computed only if the store lacks it).

    ``run_kwargs`` go to :func:`kvlab.decode.run` (e.g. ``on_step=`` to stream records; if it raises,
    e.g. to cancel, nothing is stored). The result also holds ``live``: the final cache's
    positions and writers per slot (the provenance strip).
    """
    cfg = replace(cfg, keep_dists=True)

    def compute() -> dict:
        return trace_result(run(teacher, student, prompt, cfg, **run_kwargs), teacher)

    return store.get_or_run(run_config(teacher, student, prompt, cfg), compute, extra=_extra(teacher, student, 1))


def trace_result(trace, teacher) -> dict:
    """What the store keeps of one finished generation: the teacher's scores, refresh costs, text,
    per-step columns and the final cache's provenance strip."""
    result = score(trace, teacher)
    result.update(run_costs(trace.records))
    result["text"] = trace.text
    result["steps"] = records_columns(trace.records)
    result["live"] = trace.live
    return result


def _extra(teacher, student, batch: int) -> dict:
    device = getattr(teacher, "device", None) or getattr(student, "device", None)
    return {"engine": "inline" if batch == 1 else f"inline-batch{batch}", "worker": f"pid{os.getpid()}",
            "device": str(device) if device is not None else None}


def scored_runs(teacher, student, jobs: Sequence[tuple[str, DecodeConfig]], store: RunStore, *,
                batch: int | None = None, progress: bool = False, on_step=None) -> list[dict]:
    """:func:`scored_run` for each ``(prompt, cfg)`` of ``jobs`` (results in order): stored runs are
    reused; the missing ones are decoded ``batch`` at a time (:func:`kvlab.decode.run_batch`, rows
    grouped by mode) and each is stored as soon as its row finishes, under the same key a single
    run has (the batch size is not part of it). ``batch=1``: one :func:`kvlab.decode.run` per job
    (the unbatched loop). If rows fail, the other rows are stored, then :class:`BatchError` is raised.
    ``on_step(j, record, decoding)`` (``j``: the index in ``jobs``) is called after every step of a
    decoded run; an exception it raises (a cancellation) stops the decode, and only the runs that
    finished before it are stored."""
    from tqdm.auto import tqdm

    batch = check_batch(batch)
    jobs = [(p, replace(c, keep_dists=True)) for p, c in jobs]
    configs = [run_config(teacher, student, p, c) for p, c in jobs]
    results: list[dict | None] = [store.reused(k) if batch > 1 else None for k in configs]   # counted as reused
    bar = tqdm(total=len(jobs), disable=not progress, desc="runs", unit="run")
    if batch == 1:
        for j, (p, c) in enumerate(jobs):
            step = None if on_step is None else (lambda rec, d, j=j: on_step(j, rec, d))
            results[j] = scored_run(teacher, student, p, c, store, on_step=step)
            bar.update()
        bar.close()
        return results
    bar.update(sum(r is not None for r in results))
    missing: dict[str, list[int]] = {}
    for j, r in enumerate(results):
        if r is None:
            missing.setdefault(jobs[j][1].mode, []).append(j)
    errors = {}
    for idx in missing.values():
        for k in range(0, len(idx), batch):
            chunk = idx[k:k + batch]

            def stored(b: int, trace, chunk=chunk) -> None:
                j = chunk[b]
                res = trace_result(trace, teacher)
                results[j] = store.get_or_run(configs[j], lambda: res, extra=_extra(teacher, student, len(chunk)))
                bar.update()

            def step(b: int, rec, d, chunk=chunk) -> None:
                on_step(chunk[b], rec, d)

            try:
                run_batch(teacher, student, [jobs[j][0] for j in chunk], [jobs[j][1] for j in chunk], on_row=stored,
                          on_step=None if on_step is None else step)
            except BatchError as e:
                errors.update({chunk[b]: err for b, err in e.errors.items()})
    bar.close()
    if errors:
        raise BatchError(errors, results)
    return results


def run_policies(teacher, student, spec: RunSpec, policies: dict[str, DecodeConfig], store: RunStore,
                 progress: bool = True, batch: int | None = None) -> pd.DataFrame:
    """Every (prompt, policy) run as one row of per-run metrics; missing runs are decoded ``batch``
    at a time (default ``spec.batch``, then :data:`DEFAULT_BATCH`; see :func:`scored_runs`)."""
    keys = [(i, p, name, replace(cfg, max_new_tokens=spec.tokens, sampling=spec.sampling_for(i)))
            for i, p in enumerate(spec.prompts) for name, cfg in policies.items()]
    res_all = scored_runs(teacher, student, [(p, cfg) for _, p, _, cfg in keys], store,
                          batch=batch if batch is not None else spec.batch, progress=progress)
    rows = []
    for (i, _, name, _), res in zip(keys, res_all):
        rows.append({"policy": name, "prompt_idx": i, **{k: res.get(k, float("nan")) for k in METRICS},
                     **{k: res.get(k, float("nan")) for k in COSTS}})
    return pd.DataFrame(rows)


MIN_PAIRS = 5   # fewer paired prompts than this: no interval ("n too small")


def ci_text(lo: float, hi: float, n: int, fmt: str = "+.3f") -> str:
    """``"[lo, hi]"``, or ``"n too small (n=…)"`` when the interval was refused."""
    import math

    if n < MIN_PAIRS or math.isnan(lo) or math.isnan(hi):
        return f"n too small (n={n})"
    return f"[{lo:{fmt}}, {hi:{fmt}}]"


def paired_bootstrap(per_run: pd.DataFrame, base: str, metrics=("kl", "teacher_ppl"), suffix: str = "",
                     n_boot: int = 2000, seed: int = 0) -> pd.DataFrame:
    """Per policy: the mean paired difference of each metric to policy ``base`` on the same prompts
    (``prompt_idx``) and its bootstrap 95 % interval over prompts, as columns ``d_<m><suffix>``,
    ``d_<m><suffix>_lo``, ``d_<m><suffix>_hi`` and the printable ``d_<m><suffix>_ci``. With fewer
    than ``MIN_PAIRS`` (5) pairs the interval is refused: ``_lo``/``_hi`` are NaN and ``_ci`` says
    "n too small"."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b = per_run[per_run.policy == base].set_index("prompt_idx")
    out = []
    for name, g in per_run.groupby("policy", sort=False):
        g = g.set_index("prompt_idx").loc[b.index]
        row = {"policy": name}
        for m in metrics:
            d = (g[m] - b[m]).to_numpy()
            boots = rng.choice(d, size=(n_boot, len(d)), replace=True).mean(1)
            row[f"d_{m}{suffix}"] = d.mean()
            if len(d) < MIN_PAIRS:       # a "95 % interval" of 2-4 resamples is just the differences themselves
                row[f"d_{m}{suffix}_lo"] = row[f"d_{m}{suffix}_hi"] = float("nan")
            else:
                row[f"d_{m}{suffix}_lo"], row[f"d_{m}{suffix}_hi"] = np.percentile(boots, [2.5, 97.5])
            row[f"d_{m}{suffix}_ci"] = ci_text(row[f"d_{m}{suffix}_lo"], row[f"d_{m}{suffix}_hi"], len(d))
        out.append(row)
    return pd.DataFrame(out)


def summarize(per_run: pd.DataFrame, by: str = "policy", order: list | None = None) -> pd.DataFrame:
    """Mean per group, with ``<metric>_std`` (per-prompt std) beside the quality/time columns."""
    metrics = [c for c in METRICS if c in per_run]
    g = per_run.groupby(by, sort=False)
    out = g[metrics].mean()
    for m in SPREAD:
        if m in per_run:
            out[f"{m}_std"] = g[m].std(ddof=1).fillna(0.0)
    out["n_prompts"] = g.size()
    out = out.reset_index()
    if order is not None:
        out = out.set_index(by).loc[[o for o in order if o in set(out[by])]].reset_index()
    return out


def to_markdown(df: pd.DataFrame, floatfmt: str = ".3f") -> str:
    """A GitHub-style Markdown table (no extra dependency)."""
    def fmt(v):
        if isinstance(v, float):
            s = format(v, floatfmt)
            return format(0.0, floatfmt) if s.lstrip("-").strip("0.") == "" and v == v else s   # no "-0.000"
        return str(v)

    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def provenance_note() -> str:
    """The line every written table ends with: code version, commit, machine. Runs come from the
    store, which reuses only runs of this code version timed on this hardware (kvlab.store)."""
    from kvlab.store import provenance

    return (f"kvlab code {provenance.CODE_VERSION}, commit {provenance.source_label()}, on "
            f"{provenance.describe_machine()} (stored runs are reused only from this code version and hardware).")


def write_table(df: pd.DataFrame, out: Path, name: str, notes: Sequence[str] | None = None) -> list[Path]:
    """``<name>.csv`` and ``<name>.md`` under ``out``. The ``.md`` has ``notes`` (what columns mean;
    default :func:`kl_notes`: which steps the ``kl``/``kl_all`` columns average — pass your own for
    a ``kl`` of another meaning) and :func:`provenance_note` under the table; the CSV is data only."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv, md = out / f"{name}.csv", out / f"{name}.md"
    df.to_csv(csv, index=False)
    notes = kl_notes(df) if notes is None else list(notes)
    lines = [f"- {n}" for n in notes] + [f"- {provenance_note()}"]
    md.write_text(to_markdown(df) + "\n" + "\n".join(lines) + "\n")
    return [csv, md]


def kl_notes(df: pd.DataFrame) -> list[str]:
    """The KL captions for the KL columns ``df`` shows."""
    from kvlab.core.metrics import KL_ALL_NOTE, KL_NOTE

    cols = set(df.columns)
    return ([KL_NOTE] if "kl" in cols else []) + ([KL_ALL_NOTE] if "kl_all" in cols else [])
