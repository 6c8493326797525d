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
# **Why OverFill exists.** Generating text has two phases. *Prefill* reads the whole prompt in one
# parallel pass and writes its KV cache; *decode* then produces one token per forward pass. Decode is
# bound by memory bandwidth and dominates the wall-clock time, so a smaller model decodes much more
# cheaply — but writes worse text. [OverFill (Kim et al. 2025)](https://arxiv.org/abs/2508.08446) buys
# back some of that quality: a large **teacher** prefills the prompt's cache once,
# $C_0 = \mathrm{Prefill}_T(x)$, and a pruned **student** with the same KV geometry decodes token by token
# on that cache. A cheaper decoder, bought with (some of) the teacher's quality: the question is how much
# of it survives. Here the teacher is SmolLM2-135M-Instruct and the student a width-pruned copy of it
# (hidden and MLP channels removed, the KV geometry kept so it can read the teacher's cache), distilled from
# the teacher unless `STUDENT = "pruned"` (the untrained copy smoke runs use); both are built inside kvlab.
#
# We step the decode loop by hand, look at every token's entropy and at who wrote each cache entry, then
# build the *Baselines* table of the blog *KV-Cache Refresh Methods for Long Generation* (Emara, Kim &
# Abdelfattah 2025; code: [friendshipkim/overfill](https://github.com/friendshipkim/overfill)). Every table
# and figure is followed by a **How to read this** computed from the numbers above it.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
# the embedded student: pruned (untrained) | standalone | overfill | refresh-aware; the trained ones must be
# trained once first (`python -m kvlab train-student`, ~10 min per variant); smoke runs use the untrained one
STUDENT = "pruned" if SMOKE else "overfill"
N_TOKENS = 12 if SMOKE else 64          # tokens to step through
N_PROMPTS = 2 if SMOKE else 8           # prompts in the baselines table (2: a spread even in smoke mode)
TABLE_TOKENS = 8 if SMOKE else 128      # tokens per run in the table

# %%
from IPython.display import Markdown, display

from kvlab.viz import readings

display(Markdown(readings.smoke_banner(SMOKE)))

# %%
import kvlab
from kvlab.train.pair import load_pair

teacher, student = load_pair(variant=STUDENT)
print(teacher.name, "→", student.name)
print(kvlab.kv_compat(teacher, student))
print("MLP width:", teacher.config.intermediate_size, "→", student.config.intermediate_size)

# %% [markdown]
# `kv_compat` lists every way the two models' caches could disagree (layers, KV heads, head size,
# RoPE); empty means the student can read the teacher's cache as it is.
#
# ## Stepping the loop
# `Decoding` is a generator: every `next()` runs one forward pass and yields a frozen record.
# In OverFill mode the teacher's prefill logits choose the first token; the student chooses
# the rest.

# %%
from kvlab.core.data import load_prompts

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
records = [first]
for rec in steps:
    records.append(rec)
    print(f"{rec.step:3d} {rec.token!r:14} H={rec.entropy_bits:5.2f} bits  p1={rec.top1_prob:.2f}  "
          f"cache={rec.cache_len}  by {rec.source}")
display(Markdown(readings.read_steps(records)))

# %% [markdown]
# ## Who wrote each cache entry?
# The cache module keeps a ledger beside the tensors: token, absolute position and writer
# of every entry, edited in the same call as the K/V.

# %%
ledger = dec.cache.to_frame()
ledger["text"] = [teacher.tokenizer.decode([t]) for t in ledger["token_id"]]
display(ledger.head(4))
display(ledger.tail(N_TOKENS + 3))
display(Markdown(readings.read_ledger(ledger, len(dec.prompt_ids))))

# %%
from kvlab.viz.plots import plot_cache_writers

plot_cache_writers(ledger["writer"])

# %% [markdown]
# **How to read this.** One bar per cache slot, left to right in cache order: green slots hold K/V the
# teacher computed (the prompt), orange ones K/V the student computed (everything it generated, y₁
# included — see above). Without a refresh (notebook 02) the green part never grows.
#
# ## Baselines: Teacher / OverFill / Student
# Each run is scored by one teacher forward over prompt + continuation:
# * **teacher-PPL** — how surprised the teacher is by the text (lower = text the teacher finds likely);
# * **KL(p_T‖q)** — the mean per-step divergence of the decoder's next-token distribution from the
#   teacher's, in nats (the blog's *mismatch* term; 0 for the teacher itself);
# * **repeat@3** — the fraction of the text's 3-token sequences that repeat an earlier one
#   (`1 − unique/total`; 0 = no repetition). PPL alone rewards repetition loops, so read it together
#   with KL and repeat@3.
#
# Runs are stored by config, so re-running this cell is instant.

# %%
from kvlab.studies.baselines.table import baselines
from kvlab.harness.experiment import RunSpec
from kvlab.store import RunStore
from kvlab.harness.tableview import show

spec = RunSpec(prompts=tuple(r["prompt"] for r in load_prompts(n=N_PROMPTS)), tokens=TABLE_TOKENS)
table, per_run = baselines(teacher, student, spec, RunStore(), progress=True)
view = show(table, {"decoder": "policy", "teacher-PPL ↓": ("teacher_ppl", "teacher_ppl_std"),
                    "KL(p_T‖q) nats ↓": ("kl", "kl_std"), "repeat@3 ↓": ("repeat3", "repeat3_std"),
                    "tokens": "tokens", "prompts": "n_prompts"})
view           # every column: view.full

# %%
display(Markdown(readings.read_baselines(table)))

# %%
from kvlab.viz.plots import baselines_figure

baselines_figure({"baselines": table})

# %% [markdown]
# **How to read this.** The same three columns as bars (lower is better in each); the whiskers are the
# per-prompt standard deviation, so overlapping whiskers mean the prompts disagree about the order — the
# reading above says which order the means give and whether it matches the blog.
