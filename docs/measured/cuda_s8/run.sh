#!/usr/bin/env bash
# bench evict / bench decode on a CUDA machine in bf16 on the random-weight stand-in of the embedded teacher (the
# H100 run's script, ../cuda_h100/run.sh: it builds the stand-in from the teacher's config and tokenizer files in
# TOKDIR), then a torch.profiler view of batch-8 eviction steps per policy. From the repository root:
#   OUT=DIR bash docs/measured/cuda_s8/run.sh TOKDIR
set -uo pipefail
export OUT=${OUT:-docs/measured/cuda_s8} KVLAB_CACHE=${KVLAB_CACHE:-/tmp/kc} PYTHONUNBUFFERED=1
bash docs/measured/cuda_h100/run.sh "${1:-.devcarry/tok}"
PYTHONPATH=. timeout 150 python3 docs/measured/cuda_s8/profile_step.py "$OUT" sliding,h2o,confkv 4096 8 \
  2>&1 | grep -v "Loading weights" > "$OUT/profile.log"
