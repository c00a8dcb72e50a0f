# Two H200s: the N = 2 GPU tests and `python -m bench --world-size 2 --head-dim 512` (no MPS); then,
# under MPS on GPU 0 alone, N = 6, B = 512 with the mark between graph replays (f5ba0ae, unpacked
# into _ab_old/ by `git archive f5ba0ae kernels dcp bench | tar -x -C _ab_old`) and held by each graph
# (NEW, this tree), in turn new / old / new / old: the order of one H200's call reversed.
# Run from the repository root: `NEW=<commit> bash x2_call.sh`.
export PYTHONUNBUFFERED=1
nvidia-smi topo -m > $OUT/topo.txt
DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests/test_gpu_tier.py -p no:cacheprovider -rA \
  -k "matches_reference_gpu and 2 or nccl_backend_matches_triton_gpu and 2" > $OUT/gpu_tests_n2.log 2>&1
echo "== N = 2 tests rc=$?"; tail -3 $OUT/gpu_tests_n2.log
mkdir -p $OUT/x2
DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD python3 -m bench --world-size 2 --head-dim 512 --out $OUT/x2 > $OUT/x2/bench.log 2>&1
echo "== x2 bench rc=$?"; tail -32 $OUT/x2/bench.log
export CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
B="python3 -m bench --world-size 6 --batch 512 --modes graph8 eager --backends triton --head-dim 512"
for tag in new_1 old_1 new_2 old_2; do
  case $tag in new*) dir=.; commit=$NEW;; old*) dir=_ab_old; commit=f5ba0ae;; esac
  ( cd $dir && DCP_GIT_COMMIT=$commit PYTHONPATH=$PWD $B --out /tmp/ab_$tag ) > /tmp/ab_$tag.log 2>&1
  echo "== $tag rc=$?" | tee -a $OUT/n6_b512_ab.log; grep -E "^ *6 +triton" /tmp/ab_$tag.log | tee -a $OUT/n6_b512_ab.log
done
