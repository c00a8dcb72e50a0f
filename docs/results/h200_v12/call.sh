# One H200: the whole GPU script at this commit, then the publish variants of item 37 (main's fence,
# elect) traced at N = 3 and 6 under MPS from a patched copy. Run from the repository root:
# `DCP_GIT_COMMIT=<commit> bash docs/results/h200_v12/call.sh`.
ROOT=$PWD
bash bench/gpu_all.sh --head-dim 512 > $OUT/gpu_all_stdout.log 2>&1
echo "== gpu_all rc=$?"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; tail -40 $OUT/bench.log
S=$(mktemp -d) && cp -r kernels dcp bench tests pyproject.toml $S && (cd $S && patch -p1 -s < $ROOT/docs/results/h200x2_fence_publish/publish.patch)
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d
for v in 0 4; do
  echo "== publish variant $v"
  (cd $S && DCP_SCRATCH_FENCE=$v PYTHONPATH=$S timeout 60 python3 -m bench.trace --world-size 3 6 --batch 1 8 --out $OUT/publish_v$v 2>&1 | tee $OUT/publish_v$v.log | tail -5)
done
echo quit | nvidia-cuda-mps-control
cd $OUT && tar czf data.tgz results.csv results.json trace.json publish_v* 2>/dev/null && rm -rf results.csv results.json trace.json publish_v* && ls
