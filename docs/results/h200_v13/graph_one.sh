# One H200, MPS: graphs of one call traced (N = 3, 6, 8), graphs of 8 traced at N = 8, and the
# graph-floor probe at N = 8. From the repository root:
# `DCP_GIT_COMMIT=<commit> bash docs/results/h200_v13/graph_one.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
timeout 240 python3 -m bench.trace --world-size 3 6 8 --batch 1 8 --calls 1 --replays 200 --out $OUT > $OUT/trace_one.log 2>&1
echo "== trace, graphs of one: rc=$?"; tail -8 $OUT/trace_one.log
timeout 120 python3 -m bench.trace --world-size 8 --batch 1 8 --out $OUT > $OUT/trace_n8.log 2>&1
echo "== trace, graphs of 8, N = 8: rc=$?"; tail -4 $OUT/trace_n8.log
timeout 150 python3 docs/results/h200_graph_floor/floor.py 8 > $OUT/floor_n8.log 2>&1
echo "== floor N = 8: rc=$?"; tail -8 $OUT/floor_n8.log
