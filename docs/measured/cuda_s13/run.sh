#!/usr/bin/env bash
# Session 13's GPU check, on the random-weight stand-in of the embedded teacher (../cuda_h200/make_standin.py builds
# it from the teacher's config and tokenizer files in TOKDIR): bench evict at batch 1 and 8, 4,096 -> 1,024 entries,
# each policy asked every step and every 16th step (kvlab.eviction.Every; statistics deferred between asked steps,
# whole-period timing), 64 steps. From the repository root:
#   OUT=DIR bash docs/measured/cuda_s13/run.sh TOKDIR
set -uo pipefail
TOK=${1:-.devcarry/tok}
export OUT=${OUT:-docs/measured/cuda_s13} KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/device.txt"
python3 docs/measured/cuda_h200/make_standin.py - "$TOK" || exit 1
start=$(date +%s)
timeout 420 python3 -m kvlab bench evict --batch 8,1 --cache-len 4096 --tokens 64 --repeats 2 --every 1,16 \
  --out "$OUT" 2>&1 | grep -v "Loading weights" | tee "$OUT/bench_evict.log"
echo "wall_s $(( $(date +%s) - start ))" | tee -a "$OUT/device.txt"
