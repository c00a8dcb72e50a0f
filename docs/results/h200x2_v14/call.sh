# Two H200s: the whole GPU tier under MPS (docs/results/h200x2_gpu_tier/call.sh: system-scope flags
# and fences throughout), then without MPS the N = 2 GPU tests and `python -m bench --world-size 2
# --head-dim 512` (docs/results/h200x2_v10/x2_call.sh) and bench.trace with graphs of 8 and of one.
# From the repository root: `NEW=<commit> bash docs/results/h200x2_v14/call.sh`; everything but the
# two main logs comes back in data.tgz.
bash docs/results/h200x2_gpu_tier/call.sh
bash docs/results/h200x2_v10/x2_call.sh | tail -40
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
timeout 100 python3 -m bench.trace --world-size 2 --batch 1 8 32 --out $OUT/x2 > $OUT/x2/trace.log 2>&1
timeout 100 python3 -m bench.trace --world-size 2 --batch 1 8 32 --calls 1 --replays 200 --out $OUT/x2 >> $OUT/x2/trace.log 2>&1
echo "== traces rc=$?"; grep -A5 "^median" $OUT/x2/trace.log
cp $OUT/x2/bench.log $OUT/bench_x2.log
cd $OUT && tar czf data.tgz gpus.txt topo.txt gpu_tests_n2.log x2 && rm -rf gpus.txt topo.txt gpu_tests_n2.log x2 && ls
