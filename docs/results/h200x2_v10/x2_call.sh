# Two H200s: the N = 2 GPU tests, then `python -m bench --world-size 2 --head-dim 512` (no MPS).
# Run from the repository root: `NEW=<commit> bash docs/results/h200x2_v10/x2_call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
nvidia-smi topo -m > $OUT/topo.txt
python3 -m pytest -q -m gpu tests/test_gpu_tier.py -p no:cacheprovider -rA \
  -k "matches_reference_gpu and 2 or nccl_backend_matches_triton_gpu and 2" > $OUT/gpu_tests_n2.log 2>&1
echo "== N = 2 tests rc=$?"; tail -3 $OUT/gpu_tests_n2.log
mkdir -p $OUT/x2
python3 -m bench --world-size 2 --head-dim 512 --out $OUT/x2 > $OUT/x2/bench.log 2>&1
echo "== x2 bench rc=$?"; tail -61 $OUT/x2/bench.log
