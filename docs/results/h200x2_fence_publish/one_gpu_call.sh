# One H200 under MPS: the publish variants of item 37 (0: main's fence, 4: elect) traced at N = 3
# and 6 from a patched copy, and elect's stress run at N = 3. From the repository root:
# `bash docs/results/h200x2_fence_publish/one_gpu_call.sh`.
ROOT=$PWD
S=$(mktemp -d) && cp -r kernels dcp bench tests pyproject.toml $S && cp $ROOT/docs/results/h200x2_fence_publish/stress.py $S \
  && (cd $S && patch -p1 -s < $ROOT/docs/results/h200x2_fence_publish/publish.patch) || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$S CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
cd $S
for v in 0 4 0 4; do
  echo "== publish variant $v"
  DCP_SCRATCH_FENCE=$v timeout 90 python3 -m bench.trace --world-size 3 6 --batch 1 8 32 --out /tmp/t$v 2>&1 | tee -a $OUT/one_gpu_v$v.log | tail -7
done
DCP_SCRATCH_FENCE=4 timeout 150 python3 stress.py 3 10 2>&1 | tee $OUT/one_gpu_stress_v4.log | tail -4
