#!/usr/bin/env bash
# The second session-10 GPU call: bench evict at batch 1 and 8 over 4,096- and 8,192-token contexts with the padded
# widths, on the stand-in teacher (as run.sh). From the repository root: OUT=DIR bash docs/measured/cuda_s10/run_long.sh TOKDIR
set -uo pipefail
TOK=${1:-.devcarry/tok}
export OUT=${OUT:-docs/measured/cuda_s10/long} KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/device.txt"
python3 docs/measured/cuda_h200/make_standin.py - "$TOK" || exit 1
timeout 330 python3 -m kvlab bench evict --batch 1,8 --cache-len 4096,8192 --tokens 16 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_evict.log"
