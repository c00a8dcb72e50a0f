# One H200, N = 3 and 6 ranks under MPS, 16 heads per rank, D = 512: small calls with fewer warps
# per program (fewer rows per tile, more programs per call: --num-warps 4, 2, 1) against the
# default tiling, graph8 and graph, in one machine start. From the repository root:
# `NEW=<commit> bash docs/results/h200_warps_small/call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
mkdir -p $OUT/x1; LOG=$OUT/x1/run.log
step() { echo "== $*" | tee -a $LOG; timeout 200 "$@" >> $LOG 2>&1; echo "rc=$?" | tee -a $LOG; }
for w in 8 4 2 1; do
  step python3 -m bench --world-size 3 6 --batch 1 4 8 32 64 --head-dim 512 --backends triton \
    --modes graph8 graph --num-warps $w --out $OUT/x1
done
grep -E "^== |triton" $LOG
