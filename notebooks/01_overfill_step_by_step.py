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
# # 01 · OverFill, step by step
#
# OverFill (Kim et al. 2025) splits generation in two: a **teacher** prefills the prompt's KV
# cache $C_0 = \mathrm{Prefill}_T(x)$, then a pruned **student** with the same KV geometry decodes
# token by token on that cache. Here the teacher is SmolLM2-135M-Instruct and the student is a
# width-pruned copy of it (MLP channels removed, attention untouched), both embedded in kvlab.
#
# We step the decode loop by hand, look at every token's entropy and at who wrote each cache
# entry, then reproduce the blog's *Baselines* table.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
# the embedded student: pruned (untrained) | standalone | overfill | refresh-aware; the trained ones must be
# trained once first (`python -m kvlab train-student`, ~10 min per variant); smoke runs use the untrained one
STUDENT = "pruned" if SMOKE else "overfill"
N_TOKENS = 12 if SMOKE else 64          # tokens to step through
N_PROMPTS = 1 if SMOKE else 8           # prompts in the baselines table
TABLE_TOKENS = 8 if SMOKE else 128      # tokens per run in the table

# %%
import kvlab
from kvlab.models import load_pair

teacher, student = load_pair(variant=STUDENT)
print(teacher.name, "→", student.name)
print(kvlab.kv_compat(teacher, student))
print("MLP width:", teacher.config.intermediate_size, "→", student.config.intermediate_size)

# %% [markdown]
# ## Stepping the loop
# `Decoding` is a generator: every `next()` runs one forward pass and yields a frozen record.
# In OverFill mode the teacher's prefill logits choose the first token; the student chooses
# the rest.

# %%
from kvlab.data import load_prompts

prompt = load_prompts(n=1)[0]["prompt"]
print(prompt)
dec = kvlab.Decoding(teacher, student, prompt, mode="overfill", max_new_tokens=N_TOKENS)
steps = iter(dec)
first = next(steps)
first

# %% [markdown]
# The prompt is in the cache, written by the teacher; the first token is not in it yet — the
# cache lags the last emitted token by one entry.

# %%
print("prompt tokens:", len(dec.prompt_ids), "| cache:", dec.cache)

# %%
for rec in steps:
    print(f"{rec.step:3d} {rec.token!r:14} H={rec.entropy_bits:5.2f} bits  p1={rec.top1_prob:.2f}  "
          f"cache={rec.cache_len}  by {rec.source}")

# %% [markdown]
# ## Who wrote each cache entry?
# The cache module keeps a ledger beside the tensors: token, absolute position and writer
# of every entry, edited in the same call as the K/V.

# %%
ledger = dec.cache.to_frame()
ledger["text"] = [teacher.tokenizer.decode([t]) for t in ledger["token_id"]]
ledger.tail(N_TOKENS + 3)

# %%
from kvlab.plots import plot_cache_writers

plot_cache_writers(ledger["writer"])

# %% [markdown]
# ## Baselines: Teacher / OverFill / Student
# Each run is scored by one teacher forward over prompt + continuation: teacher-PPL, the mean
# per-step $\mathrm{KL}(p_T\,\|\,q)$ (the blog's *mismatch* term) and repeat@3. PPL alone rewards
# repetition loops, so read it together with KL and repeat@3. Runs are stored by config, so
# re-running this cell is instant.

# %%
from kvlab.baselines import baselines
from kvlab.experiment import RunSpec
from kvlab.store import RunStore

spec = RunSpec(prompts=tuple(r["prompt"] for r in load_prompts(n=N_PROMPTS)), tokens=TABLE_TOKENS)
table, per_run = baselines(teacher, student, spec, RunStore(), progress=False)
table.round(3)

# %%
from kvlab.plots import baselines_figure

baselines_figure({"baselines": table})
