#!/usr/bin/env bash
# The eviction and decode benchmarks on a CUDA machine in bf16 (kvlab's default there), on a random-weight
# stand-in of the embedded teacher (its GGUF does not travel; ../cuda_h200/make_standin.py builds the stand-in from
# the teacher's config and tokenizer files in TOKDIR). Run from the repository root:
#   OUT=docs/measured/cuda_h100 bash docs/measured/cuda_h100/run.sh TOKDIR
set -uo pipefail
TOK=${1:-.devcarry/tok}
OUT=${OUT:-docs/measured/cuda_h100}
export KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/device.txt"
python3 docs/measured/cuda_h200/make_standin.py - "$TOK" || exit 1
timeout 330 python3 -m kvlab bench evict --batch 1,8 --cache-len 4096 --tokens 16 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_evict.log"
timeout 120 python3 -m kvlab bench decode --batch 1,8 --tokens 64 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_decode.log"
