# Two H200s: `python -m bench --world-size 2 --head-dim 512` (no MPS) and the marks' GPU tests.
# Run from the repository root: `NEW=<commit> bash docs/results/h200x2_v10/x2_bench.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
python3 -m pytest -q -m gpu tests/test_bench_gpu.py -p no:cacheprovider 2>&1 | tail -2
mkdir -p $OUT/x2
python3 -m bench --world-size 2 --head-dim 512 --out $OUT/x2 > $OUT/x2/bench.log 2>&1
echo "== x2 bench rc=$?"; tail -61 $OUT/x2/bench.log
