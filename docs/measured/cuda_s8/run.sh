#!/usr/bin/env bash
# bench evict / bench decode on a CUDA machine in bf16 (kvlab's default there) on the random-weight stand-in of the
# embedded teacher (../cuda_h200/make_standin.py, from the teacher's config and tokenizer files in TOKDIR), then a
# torch.profiler view of one batch-8 eviction step per policy. From the repository root:
#   OUT=DIR bash docs/measured/cuda_s8/run.sh TOKDIR
set -uo pipefail
TOK=${1:-.devcarry/tok}
OUT=${OUT:-docs/measured/cuda_s8}
export KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null || git rev-parse --short HEAD; } | tee "$OUT/device.txt"
python3 docs/measured/cuda_h200/make_standin.py - "$TOK" || exit 1
timeout 200 python3 -m kvlab bench evict --batch 1,8 --cache-len 4096 --tokens 16 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_evict.log"
timeout 100 python3 -m kvlab bench decode --batch 1,8 --tokens 64 --repeats 2 --out "$OUT" \
  2>&1 | grep -v "Loading weights" | tee "$OUT/bench_decode.log"
PYTHONPATH=. timeout 150 python3 docs/measured/cuda_s8/profile_step.py "$OUT" sliding,h2o,confkv 4096 8 \
  2>&1 | grep -v "Loading weights" > "$OUT/profile.log"
