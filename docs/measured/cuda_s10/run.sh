#!/usr/bin/env bash
# Session 10's GPU check, on the random-weight stand-in of the embedded teacher (../cuda_h200/make_standin.py builds
# it from the teacher's config and tokenizer files in TOKDIR): the padded-vs-exact key width A/B on new widths, then
# bench evict (batch 8, 4,096 -> 1,024) and bench decode (batch 8). From the repository root:
#   OUT=DIR bash docs/measured/cuda_s10/run.sh TOKDIR
set -uo pipefail
TOK=${1:-.devcarry/tok}
export OUT=${OUT:-docs/measured/cuda_s10} KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/device.txt"
python3 docs/measured/cuda_h200/make_standin.py - "$TOK" || exit 1
PYTHONPATH=. timeout 90 python3 docs/measured/cuda_s10/width_ab.py "$OUT" 4096 8 12 2>&1 | grep -v "Loading weights"
timeout 240 python3 -m kvlab bench evict --batch 8 --cache-len 4096 --tokens 16 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_evict.log"
timeout 120 python3 -m kvlab bench decode --batch 8 --tokens 64 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_decode.log"
