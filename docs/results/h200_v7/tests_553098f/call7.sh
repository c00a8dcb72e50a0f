export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=553098f
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA -k "matches_reference_gpu" --timeout 300 2>&1 | tee $OUT/gpu_tests_reference.log | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" | tail -8
