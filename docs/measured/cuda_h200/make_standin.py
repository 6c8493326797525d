"""A random-weight stand-in for the embedded teacher on the GPU machine (the GGUF is too big to carry there):
SmolLM2-135M-Instruct's own config and tokenizer, weights drawn with the config's initializer (seed 0), saved
where kvlab's teacher_path() looks, so every kvlab command runs its real code path on it.

Usage: KVLAB_CACHE=/tmp/kc python make_standin.py [LAYERS|-] [SRC]. SRC: a folder with the converted teacher's
config.json and tokenizer files (chat_template.jinja, generation_config.json, tokenizer.json,
tokenizer_config.json), copied from <kvlab cache>/models/smollm2-135m-instruct/; LAYERS: fewer layers for a dry
run (default, or -: the config's 30)."""
import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

src = Path(sys.argv[2] if len(sys.argv) > 2 else ".devcarry/tok")
dst = Path(os.environ["KVLAB_CACHE"]) / "models" / "smollm2-135m-instruct"
cfg = AutoConfig.from_pretrained(src)
if len(sys.argv) > 1 and sys.argv[1] != "-":
    cfg.num_hidden_layers = int(sys.argv[1])      # a dry run
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
dst.mkdir(parents=True, exist_ok=True)
model.save_pretrained(dst)
for f in ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(src / f, dst / f)
print("stand-in teacher:", dst, sum(p.numel() for p in model.parameters()) / 1e6, "M params,",
      cfg.num_hidden_layers, "layers")
