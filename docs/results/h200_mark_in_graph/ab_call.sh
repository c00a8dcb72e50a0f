# One H200, MPS: the benchmark with its clock mark launched between graph replays (f5ba0ae, unpacked
# into _ab_old/ by `git archive f5ba0ae kernels dcp bench | tar -x -C _ab_old`) and held by each
# graph as its first node (NEW, this tree), in turn old / new / old / new; then the benchmark's GPU
# tests of this tree. Run from the repository root: `NEW=<commit> bash ab_call.sh`.
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
run() {  # tree commit tag args...
  local dir=$1 commit=$2 tag=$3; shift 3
  ( cd $dir && DCP_GIT_COMMIT=$commit PYTHONPATH=$PWD "$@" ) > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "^ *[36] +triton" $OUT/$tag.log
}
B="python3 -m bench --world-size 3 6 --batch 1 2 4 8 512 --modes graph graph8 eager --backends triton --head-dim 512"
run _ab_old f5ba0ae bench_old_1 $B --out $OUT/bench_old_1
run . $NEW bench_new_1 $B --out $OUT/bench_new_1
run _ab_old f5ba0ae bench_old_2 $B --out $OUT/bench_old_2
run . $NEW bench_new_2 $B --out $OUT/bench_new_2
PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/test_bench_gpu.py -rA -s -p no:cacheprovider > $OUT/bench_gpu_tests.log 2>&1
echo "== bench gpu tests rc=$?"; grep -E "PASSED|FAILED|passed|failed|slept|replay" $OUT/bench_gpu_tests.log
