#!/usr/bin/env bash
# An A/B of kernel variants on one machine start (for the lent GPU): each NAME=TREE source tree runs
# the same `python -m bench` points back to back under one CUDA MPS daemon; CSVs and logs to $OUT.
# Usage: bash bench/ab.sh "NAME=TREE ..." [python -m bench arguments]   (TREE: a checkout, e.g. ab/old)
set -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/dcp-ab}"
mkdir -p "$OUT"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
variants="$1"; shift
for v in $variants; do
  name="${v%%=*}" tree="${v#*=}"
  echo "=== $name ($tree)"
  (cd "$tree" && DCP_GIT_COMMIT="$name" PYTHONPATH="$PWD" python3 -m bench --out "/tmp/dcp-ab-runs/$name" "$@" 2>&1) \
    | tee "$OUT/$name.log" | grep -E "^ *[0-9]+ +(push|pull|auto|triton|nccl) |^ *N backend"
  cp "/tmp/dcp-ab-runs/$name/results.csv" "$OUT/$name.csv" 2>/dev/null
done
