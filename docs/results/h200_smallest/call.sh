# One H200, N = 3 and 6 ranks under MPS: the smallest call the communicator takes (B = 1, one head
# per rank, D = 8: 32-byte rows) against the user's shape (16 heads per rank, D = 512), in one
# machine start: the benchmark (triton, three modes), bench.trace (graphs of 8 and of one) and the
# graph-floor probe (a graph of one clock kernel, nothing exchanged). From the repository root:
# `NEW=<commit> bash docs/results/h200_smallest/call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
mkdir -p $OUT/x1; LOG=$OUT/x1/run.log
step() { echo "== $*" | tee -a $LOG; timeout 240 "$@" >> $LOG 2>&1; echo "rc=$?" | tee -a $LOG; tail -n 14 $LOG | grep -v "^\[#"; }
step python3 -m bench --world-size 3 6 --batch 1 --heads-per-rank 1 --head-dim 8 --backends triton --out $OUT/x1
step python3 -m bench --world-size 3 6 --batch 1 8 --head-dim 512 --backends triton --out $OUT/x1
step python3 -m bench.trace --world-size 3 6 --batch 1 --heads-per-rank 1 --head-dim 8 --out $OUT/x1
step python3 -m bench.trace --world-size 3 6 --batch 1 --heads-per-rank 1 --head-dim 8 --calls 1 --replays 200 --out $OUT/x1
step python3 -m bench.trace --world-size 3 6 --batch 1 8 --calls 1 --replays 200 --out $OUT/x1
step python3 docs/results/h200_graph_floor/floor.py 3 6
