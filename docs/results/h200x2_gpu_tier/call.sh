# Two H200s under MPS: the whole GPU tier. `World` puts rank r on GPU r % 2, so N = 2 has a rank per
# GPU and N = 3 and 6 share each GPU among 2 + 1 and 3 + 3 ranks; in every case some peers are on the
# other GPU, so the kernel runs with system-scope flags and fences, the path of multi-GPU machines,
# which the one-GPU runs of this tier (GPU scope) do not take. From the repository root:
# `NEW=<commit> bash docs/results/h200x2_gpu_tier/call.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=$NEW
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
nvidia-smi -L > $OUT/gpus.txt
timeout 530 python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA -s --timeout 240 > $OUT/gpu_tests.log 2>&1
echo "== GPU tier rc=$?"; grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|^soak|Error" $OUT/gpu_tests.log | tail -40
