# One H200 under MPS: the tiling rule of f2dcd69 where it had not run on a GPU. N = 4, 5, 7, 8 at
# D = 512 (graph8 and eager; every point checked against the float64 reference first), then graph8 with
# 8 warps fixed (the tiling before f2dcd69) at the same points; N = 3 and 6 at D = 128, graph8, the
# rule and 8 warps fixed. From the repository root: `NEW=<commit> bash docs/results/h200_rule_n4578/call.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=$NEW
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
B="1 2 4 8 16 32 64"
run() { local name=$1 limit=$2; shift 2; mkdir -p $OUT/$name
  timeout $limit python3 -m bench --backends triton --batch $B --out $OUT/$name "$@" > $OUT/$name/bench.log 2>&1
  echo "== $name rc=$?"; grep -E "^ +[0-9]+ +triton" $OUT/$name/bench.log; }
run n4578_rule 220 --world-size 4 5 7 8 --head-dim 512 --modes graph8 eager
run n4578_w8 120 --world-size 4 5 7 8 --head-dim 512 --modes graph8 --num-warps 8
run d128_rule 100 --world-size 3 6 --head-dim 128 --modes graph8
run d128_w8 100 --world-size 3 6 --head-dim 128 --modes graph8 --num-warps 8
cd $OUT && tar czf data.tgz */results.csv */results.json */*.png 2>/dev/null; rm -f */results.csv */results.json */*.png; find . -type f
