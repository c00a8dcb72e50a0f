#!/usr/bin/env bash
# The whole GPU tier and a benchmark pass, with and without batch metadata, in one call (for the lent
# H200); prints short tables last.
# Runs under the CUDA MPS daemon (started here, stopped on exit) so that rank processes sharing one
# GPU run concurrently. Usage: bash bench/gpu_all.sh [extra `python -m bench` arguments]
# GPU_ALL_TESTS=0 or GPU_ALL_BENCH=0 leaves out one half (to fit a device's per-call limit);
# PYTEST_ARGS adds pytest arguments, quoted as in a shell (PYTEST_ARGS='-k "not graphs"').
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DCP_GIT_COMMIT="${DCP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"  # the device copy has no .git: pass it in
OUT="${OUT:-/tmp/dcp-gpu}"
mkdir -p "$OUT"
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
# (split by Python's shlex, so quotes group; appended last, so they override the options before them)
mapfile -t extra < <(python3 -c 'import os, shlex; [print(a) for a in shlex.split(os.environ.get("PYTEST_ARGS", ""))]')
[ "${GPU_ALL_TESTS:-1}" = 0 ] || python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA -s --timeout 900 --durations=25 \
  "${extra[@]}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|^soak|Error:|assert" | tail -40
[ "${GPU_ALL_BENCH:-1}" = 0 ] && exit 0
python3 -m bench.host_time 2>&1 | tee "$OUT/host_time.log" | sed -n 1,11p
python3 -m bench.trace --out "$OUT" 2>&1 | tee "$OUT/trace.log" | tail -10
# The sweep without metadata (a plain run passes it by default), then with it: the rows beside each other.
python3 -m bench --out "$OUT" "$@" --no-metadata 2>&1 | tee "$OUT/bench.log" | tail -40
# The same sweep with vLLM's batch metadata on every combine, the path its MLA layers call (the
# gather takes none): rows marked meta in the same results.
python3 -m bench --out "$OUT" "$@" --metadata --op combine layer 2>&1 | tee "$OUT/bench_metadata.log" | tail -24
