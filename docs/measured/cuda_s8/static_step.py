"""How launch-bound is a decode step of the embedded model's shape on this device? HF `generate` on the same model
and prompt, dynamic cache vs a static cache (transformers compiles the static-cache step where it can), per-token
time the median gap between consecutive logits-processor calls (one per generated token, the device synced
there), 32 new tokens, batch 8, a 4,096-token random prompt.

Usage: python static_step.py OUT_DIR [MODEL_DIR] [CONTEXT] [BATCH]"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

out = Path(sys.argv[1])
src = sys.argv[2] if len(sys.argv) > 2 else "/tmp/kc/models/smollm2-135m-instruct"
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
B = int(sys.argv[4]) if len(sys.argv) > 4 else 8
dev = "cuda" if torch.cuda.is_available() else "cpu"
dt = torch.bfloat16 if dev == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(src, dtype=dt).to(dev).eval()
ids = torch.randint(0, model.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(0)).to(dev)


class Stamp:
    """A logits processor that only records when it is called (once per new token), after syncing the device."""

    def __init__(self):
        self.t = []

    def __call__(self, input_ids, scores):
        if dev == "cuda":
            torch.cuda.synchronize()
        self.t.append(time.perf_counter())
        return scores


def run(**kw):
    st = Stamp()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([st]), **kw)
    return statistics.median(b - a for a, b in zip(st.t[1:], st.t[2:]))   # decode steps 2..32


rows = []
for name, kw in (("dynamic", {}), ("static", {"cache_implementation": "static"})):
    run(**kw)                                                # warm-up (the static cache's compile happens here)
    step = min(run(**kw) for _ in range(2))
    row = {"cache": name, "device": dev, "dtype": str(dt), "batch": B, "context": ctx, "step_ms": round(1000 * step, 2)}
    rows.append(row)
    print(json.dumps(row), flush=True)
out.mkdir(parents=True, exist_ok=True)
(out / "static_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

try:                                                         # kvlab's own full-cache step, same process and prompt length
    from kvlab.core.models import load_model
    from kvlab.studies.bench.evict_batch import batch_evict_policies, bench_evict_batch

    lm = load_model(src, dev, dt)
    r = bench_evict_batch(lm, batches=(B,), cache_len=ctx, steps=16, repeats=1,
                          policies={"full": batch_evict_policies(ctx)["full"]})[0]
    row = {"cache": "kvlab full (bench evict)", "device": dev, "dtype": str(dt), "batch": B, "context": ctx,
           "step_ms": r["step_ms"]}
    rows.append(row)
    print(json.dumps(row), flush=True)
except Exception as e:                                        # the HF rows stand on their own
    print("kvlab row failed:", repr(e), flush=True)
(out / "static_step.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
