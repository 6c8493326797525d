# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     notebook_metadata_filter: -jupytext.text_representation.jupytext_version
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Cache eviction: Conf-KV, fixed budgets, and what they forget
#
# Two sources: the Conf-KV paper (*Conf-KV: Confidence-Aware KV Cache Eviction with Mixed-Precision
# Storage for Long-Horizon LLM*, Li & Miao 2026) and
# [OpenVINO GenAI's KV-cache eviction](https://github.com/openvinotoolkit/openvino.genai/blob/master/site/docs/concepts/optimization-techniques/kvcache-eviction-algorithm.md)
# (block-wise, H2O-style accumulated attention). An eviction policy *decides* which cache entries
# survive a step (`kvlab.eviction`, one frozen dataclass per file); the cache module removes them
# from the tensors and the live map in the same call (`KVCache.evict`). Survivors keep their RoPE
# positions, so the model still sees the right distances.
#
# **Conf-KV** turns the next-token distribution into a confidence score; a confident step
# (score ≥ γ) gets the *tight* budget, an uncertain one the *loose* budget. Within the budget,
# entries are ranked by EMA attention mass and recency, and the newest `protect` entries always
# stay. The cache therefore follows a **sawtooth**: it grows while the model is unsure, and is
# cut back when it becomes confident again.
#
# This notebook: (1) one run step by step with the live map shrinking, (2) the confidence trace
# with γ and the budget switching, (3) the sawtooth of every policy on one prompt, (4) the
# matched-memory table, (5) passkey retrieval. All logic lives in `kvlab.eviction.tables`,
# `kvlab.eviction.needle`, `kvlab.eviction.plots`; the readings in `kvlab.viz.readings`.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
# the embedded student: pruned (untrained) | standalone | overfill | refresh-aware; the trained ones must be
# trained once first (`python -m kvlab train-student`); smoke runs use the untrained one
STUDENT = "pruned" if SMOKE else "overfill"
PROMPTS = 1 if SMOKE else 8            # prompts of the matched-memory table (< 5: no interval)
TOKENS = 24 if SMOKE else 128          # new tokens per run
STEP_TOKENS = 24 if SMOKE else 96      # the single run stepped through
GAMMA = 0.9                            # Conf-KV confidence threshold γ (0.9 here, see docs/eviction.md)
# Budgets in cache entries. The same in smoke mode: the loose budget must hold the whole prompt (~70
# tokens with the chat template) or the prompt is gone at the first eviction, and every row degenerates.
TIGHT, LOOSE, PROTECT = 48, 112, 16
NEEDLE_LENGTHS = (128,) if SMOKE else (256, 512)
NEEDLE_DEPTHS = (0.0, 1.0) if SMOKE else (0.0, 0.5, 1.0)
NEEDLE_BUDGET = 64 if SMOKE else 128
SEED = 0

# %%
# %matplotlib inline
from IPython.display import Markdown, display

from kvlab.viz import readings
from kvlab.core.data import load_prompts
from kvlab.decode import DecodeConfig, Decoding, Sampling
from kvlab.eviction import ConfKV
from kvlab.eviction.plots import evict_needle_figure, evict_sawtooth_figure, plot_confidence_trace
from kvlab.eviction.tables import EvictStudy, NeedleGrid, evict_tables
from kvlab.studies.experiment import RunSpec
from kvlab.viz.livemap import live_map_figure
from kvlab.train.pair import load_pair
from kvlab.eviction.needle import needle_markdown
from kvlab.store import RunStore
from kvlab.viz.tableview import show

display(Markdown(readings.smoke_banner(SMOKE)))
teacher, student = load_pair(variant=STUDENT)  # CUDA (bf16) when present, else CPU
sampling = Sampling(temperature=0.7, top_p=0.9, seed=SEED)
prompt = load_prompts(n=1)[0]["prompt"]
policy = ConfKV(gamma=GAMMA, tight=TIGHT, loose=LOOSE, protect=PROTECT)
L = len(teacher.encode_prompt(prompt))
if LOOSE < L:
    raise ValueError(f"LOOSE={LOOSE} must be at least the prompt's {L} tokens, or the prompt is evicted at once")
print(f"prompt: {L} tokens; budgets: tight {TIGHT}, loose {LOOSE}, protect {PROTECT}")
policy

# %% [markdown]
# ## 1 · One run, step by step
# Each `next(d)` emits one token, then runs the loop's evict phase. The record says how long the
# cache is *after* that phase, how many entries left, and the confidence / budget Conf-KV chose.

# %%
d = Decoding(teacher, None, prompt, DecodeConfig(mode="teacher", max_new_tokens=STEP_TOKENS, sampling=sampling,
                                                  evict=policy))
records = []
snapshots = {"prefill": list(range(len(d.prompt_ids)))}   # prefill writes ledger rows 0..L-1 in slot order
for rec in d:
    records.append(rec)
    if (rec.evicted and len(snapshots) == 1) or rec.step == STEP_TOKENS // 2:   # first eviction, half-way
        snapshots[f"after step {rec.step} ({rec.cache_len} entries)"] = list(d.cache.live)
    if rec.step <= 12:
        print(f"t={rec.step:3d} {rec.token!r:>12}  conf={rec.signals.get('confidence', float('nan')):.2f} "
              f"budget={rec.signals.get('budget', float('nan')):4.0f}  cache={rec.cache_len:4d}  evicted={rec.evicted}")
snapshots[f"end ({len(d.cache)} entries)"] = list(d.cache.live)
print(repr(teacher.tokenizer.decode(d.tokens)))

# %% [markdown]
# The live map maps each cache slot to the ledger row it holds. After an eviction the slots point at a
# thinning subset of rows; the lower panel shows their RoPE positions, unchanged by eviction.

# %%
fig = live_map_figure(d.cache.ledger_frame(), snapshots, title="Conf-KV: the live map shrinking")
display(fig)
display(Markdown(readings.read_survivors(d.cache.ledger_frame(), list(d.cache.live), len(d.prompt_ids))))

# %% [markdown]
# ## 2 · Confidence, γ and the budget
# Steps at or above γ take the tight budget; the cache is cut back there (dots). Below γ the loose
# budget lets it grow.

# %%
fig = plot_confidence_trace(records, GAMMA, title=f"Conf-KV(γ={GAMMA}, tight={TIGHT}, loose={LOOSE}, protect={PROTECT})")
display(fig)
display(Markdown(readings.read_confidence(records, GAMMA)))

# %% [markdown]
# ## 3 · The sawtooth, and 4 · the matched-memory table
# Every policy runs on the same prompts with the same seeds (stored runs: a rerun reuses them).
# Conf-KV's achieved mean KV memory is the target; each fixed-budget family's budget is solved so
# its measured mean memory matches (the table shows target, achieved and their ratio). KL is to the
# full-cache teacher on the run's own tokens; Δ columns are paired with a bootstrap 95 % interval.
# This cell runs every policy and the passkey grid (minutes on a CPU) and prints its progress.

# %%
spec = RunSpec(prompts=tuple(r["prompt"] for r in load_prompts(n=PROMPTS)), tokens=TOKENS, sampling=sampling)
study = EvictStudy(gamma=GAMMA, tight=TIGHT, loose=LOOSE, protect=PROTECT, block_size=4 if SMOKE else 8)
grid = NeedleGrid(NEEDLE_LENGTHS, NEEDLE_DEPTHS, 1, NEEDLE_BUDGET)
tables = evict_tables(teacher, student, spec, RunStore(), study, grid, progress=True)
display(evict_sawtooth_figure(tables))
display(Markdown(readings.read_sawtooth(tables["evict_sawtooth"])))

# %%
matched = show(tables["evict_matched"], {
    "policy": "policy", "matched by": "matched_by", "mean KV MiB": "mean_mb", "memory vs target": "mem_vs_target",
    "peak entries": "peak_len", "teacher-PPL ↓": ("teacher_ppl", "teacher_ppl_std"),
    "Δ PPL vs full (95 % CI)": ("d_teacher_ppl_vs_full", "d_teacher_ppl_vs_full_lo", "d_teacher_ppl_vs_full_hi"),
    "KL to full cache ↓": ("kl", "kl_std"), "repeat@3 ↓": "repeat3", "tokens/s": "tps", "prompts": "n_prompts"})
matched        # every column (budgets found, solver probes, policy parameters): matched.full

# %%
display(Markdown(readings.read_evict_matched(tables["evict_matched"])))

# %% [markdown]
# ## 5 · Passkey retrieval
# A passkey hidden at a depth of a filler haystack; every policy has the same peak budget. The reading
# checks whether the full cache retrieves it at these lengths, so that a miss is the policy's.

# %%
display(Markdown(needle_markdown(tables["evict_needle"])))
display(evict_needle_figure(tables))
display(Markdown(readings.read_needle(tables["evict_needle"])))

# %% [markdown]
# ## 6 · Your own policy in one cell
# An eviction policy is one short class with a `keep(view) -> Keep` method; `kvlab.register_eviction`
# makes it a family everywhere kvlab offers policies by name: the matched-memory table, the sawtooth,
# sweeps (`[evict.tova]`) and the playground's menu (docs/custom_policies.md). Here a TOVA-like rule:
# keep the entries that recent queries attended to most.

# %%
from dataclasses import dataclass

import torch

import kvlab
from kvlab.eviction import Keep


@kvlab.register_eviction("tova")
@dataclass(frozen=True)
class Tova:
    """TOVA-like: over `budget` entries keep the newest one and the others that recent queries attended
    to most (the cache's EMA of attention mass, mean over layers)."""

    budget: int
    ema_decay: float = 0.5       # β of the cache's EMA: low = "what the last few queries looked at"
    needs_attention = True       # class attribute, not a field: the loop measures attention for this policy

    def __post_init__(self):
        if not isinstance(self.budget, int) or self.budget < 2:
            raise ValueError(f"budget={self.budget!r} must be an int >= 2 (cache entries)")

    def keep(self, view) -> Keep:
        n = view.length
        if n <= self.budget:
            return Keep(tuple(range(n)), budget=self.budget)
        ema = torch.stack(list(view.attn["ema"])).mean(0)[: n - 1]          # (n-1,): all but the newest
        top = torch.topk(ema, self.budget - 1).indices.sort().values.tolist()
        return Keep((*top, n - 1), budget=self.budget)

# %% [markdown]
# Its budget is solved like every fixed-budget family's, against the same Conf-KV target; the full-cache,
# Conf-KV and H2O runs of sections 3-4 are read back from the run store, only Tova's are new.

# %%
from kvlab.eviction.tables import matched_runs, matched_table, sawtooth_frame, sawtooth_runs

mine_study = EvictStudy(gamma=GAMMA, tight=TIGHT, loose=LOOSE, protect=PROTECT, block_size=study.block_size,
                        only=("h2o", "tova"))
per_run, info, mine_policies = matched_runs(teacher, spec, RunStore(), mine_study, progress=True)
mine = matched_table(per_run, info)
display(show(mine[mine.policy.isin(["full", "confkv", "h2o", "tova"])], {
    "policy": "policy", "budget found": "knob", "mean KV MiB": "mean_mb", "memory vs target": "mem_vs_target",
    "KL to full cache ↓": ("kl", "kl_std"), "teacher-PPL ↓": ("teacher_ppl", "teacher_ppl_std"), "prompts": "n_prompts"}))
saw = sawtooth_frame(sawtooth_runs(teacher, None, spec, RunStore(), mine_policies, mine_study,
                                   names=("full", "confkv", "h2o", "tova")), gamma=GAMMA)
display(evict_sawtooth_figure({"evict_sawtooth": saw}))
