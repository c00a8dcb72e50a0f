# Two H200s: the graph-replay probe; the marks' GPU tests; `python -m bench --world-size 2
# --head-dim 512` (no MPS), whose NCCL graph rows now queue in chunks that fit.
# Run from the repository root: `NEW=<commit> bash docs/results/h200x2_nccl_graph/x2_call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
timeout 300 python3 docs/results/h200x2_nccl_graph/probe.py $OUT > $OUT/probe.log 2>&1
echo "== probe rc=$?"; grep "^rank" $OUT/probe.log
mkdir -p $OUT/dot && mv $OUT/*.dot $OUT/dot/ && tar czf $OUT/dot.tgz -C $OUT dot && rm -rf $OUT/dot
python3 -m pytest -q -m gpu tests/test_bench_gpu.py -p no:cacheprovider 2>&1 | tail -2
mkdir -p $OUT/x2
python3 -m bench --world-size 2 --head-dim 512 --out $OUT/x2 > $OUT/x2/bench.log 2>&1
echo "== x2 bench rc=$?"; tail -61 $OUT/x2/bench.log
