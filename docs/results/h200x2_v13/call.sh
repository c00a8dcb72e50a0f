# Two H200s: the N = 2 GPU tests and the sweep (docs/results/h200x2_v10/x2_call.sh), then the
# trace of graphs of 8 and of graphs of one call. From the repository root:
# `NEW=<commit> bash docs/results/h200x2_v13/call.sh`.
bash docs/results/h200x2_v10/x2_call.sh
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
timeout 150 python3 -m bench.trace --world-size 2 --batch 1 8 32 --out $OUT/x2 > $OUT/x2/trace.log 2>&1
echo "== trace, graphs of 8: rc=$?"; tail -4 $OUT/x2/trace.log
timeout 150 python3 -m bench.trace --world-size 2 --batch 1 8 32 --calls 1 --replays 200 --out $OUT/x2 \
  > $OUT/x2/trace_one.log 2>&1
echo "== trace, graphs of one: rc=$?"; tail -4 $OUT/x2/trace_one.log
