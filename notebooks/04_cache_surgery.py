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
# # 04 · Cache surgery: one tick, two blades
#
# The *Positronic Brain* research request "Step 4 — Atomic KV Cache and Mirror Update": after a token
# is generated, an action list edits the KV cache — delete,
# insert, `replace_pair`, `add` — and the token mirror must receive *exactly* the same cut.
# kvlab's `KVCache` keeps an append-only **ledger** (every entry ever written: token, RoPE
# position, writer, step) and a **live map** (slot → ledger row). `KVCache.apply` validates the
# whole list first, then splices every layer and the live map with one layout (one `torch.cat`
# per layer), in the request's descending order, appends last. On a failure it rebuilds the cache from
# the live map's tokens (no VRAM snapshot).
#
# Positions are **no-shift**: surviving entries keep the position they were written at (nothing
# is re-rotated); inserted tokens continue from their left neighbour; decoding continues at
# `next_position`, taken from the mirror, not from the cache length.

# %% tags=["parameters"]
import os

SMOKE = os.environ.get("KVLAB_SMOKE") == "1"
PROMPT = "Write a short poem about the sea."
PREFIX_TOKENS = 8 if SMOKE else 24     # tokens generated before the tick
AFTER_TOKENS = 6 if SMOKE else 24      # tokens generated after it

# %%
from IPython.display import Markdown, display

from kvlab.viz import readings
from kvlab.decode import Decoding
from kvlab.viz.livemap import live_map_figure
from kvlab.core.models import load_teacher

display(Markdown(readings.smoke_banner(SMOKE)))
lm = load_teacher()  # CUDA (bf16) when present, else CPU
tok = lm.tokenizer
d = Decoding(lm, None, PROMPT, mode="teacher", max_new_tokens=PREFIX_TOKENS)
records = list(d)
cache, pending = d.cache, d.tokens[-1]   # the cache lags the last emitted token by one
print(repr(tok.decode(d.tokens)))
cache

# %% [markdown]
# ## The tick
# Slots refer to the cache *before* the tick. We delete a prompt token, insert a phrase inside the
# generated text, merge two generated tokens into one, and `add` the pending token (the request's way
# of writing the token that was just generated).

# %%
n = len(cache)
L = len(d.prompt_ids)
word = tok(" calm")["input_ids"]
actions = [
    {"action": "delete", "pos": L - 4},
    {"action": "insert", "pos": L + 2, "token_ids": tok(" (quietly)")["input_ids"]},
    {"action": "replace_pair", "original_pos1": n - 3, "original_pos2": n - 2, "new_token_ids": word},
    {"action": "add", "token_id": pending},
]
before_live = list(cache.live)
text_before = tok.decode(cache.token_ids[L - 6:] + [pending])
report = cache.apply(actions, lm.model, writer="teacher", step=PREFIX_TOKENS)
report

# %%
cache.check()
frame = cache.ledger_frame()
fig = live_map_figure(frame, {"before": before_live, "after": cache.live}, labels=lambda t: tok.decode([t]),
                      title="live map before / after one tick")
display(fig)
display(Markdown(readings.read_tick(frame, before_live, list(cache.live), list(cache.positions))))

# %%
frame[(frame["origin"] != "written") | (frame["status"] != "live")]   # rows the tick wrote or retired

# %% [markdown]
# ## Generation continues from the edited cache
# `Decoding.resume` takes the tick's next-token logits (its `add` wrote the pending token) and decodes
# on, passing explicit positions from the mirror (`next_position`).

# %%
recs = list(Decoding.resume(lm, cache, logits=report.logits, max_new_tokens=AFTER_TOKENS,
                          first_step=PREFIX_TOKENS + 1))
print("cache tail before the tick:", repr(text_before))
print("cache tail after the tick: ", repr(tok.decode(cache.token_ids[L - 6:len(cache) - len(recs) + 1])))
print("continued:                 ", repr(tok.decode([r.token_id for r in recs])))
print("positions of the new tokens:", [r.position for r in recs][:8], "…", cache)
