# One H200, MPS: the step-cost probe for N = 1, 2, 3, 6, then the D = 128 sweep of this tree.
# Run from the repository root: `NEW=<commit> bash docs/results/h200_graph_floor/call.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=$NEW
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
python3 docs/results/h200_graph_floor/floor.py > $OUT/floor.log 2>&1; echo "== floor rc=$?"; cat $OUT/floor.log | tail -12
mkdir -p $OUT/d128
python3 -m bench --world-size 3 6 --head-dim 128 --backends triton --out $OUT/d128 > $OUT/d128/bench.log 2>&1
echo "== d128 rc=$?"; grep -E "^ *[36] +triton" $OUT/d128/bench.log | awk '$4 <= 8 || $4 == 512'
