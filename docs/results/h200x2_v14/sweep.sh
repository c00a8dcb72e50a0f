# Two H200s, no MPS: the N = 2 GPU tests and `python -m bench --world-size 2 --head-dim 512`
# (docs/results/h200x2_v10/x2_call.sh), then bench.trace with graphs of 8 and of one. These are
# the commands of call 5 of the session of 4f14513-f2dcd69 (its output was filtered to the rows).
# From the repository root: `NEW=<commit> bash docs/results/h200x2_v14/sweep.sh`.
export NEW
bash docs/results/h200x2_v10/x2_call.sh | grep -E "^==|triton|nccl" | tail -40
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
timeout 100 python3 -m bench.trace --world-size 2 --batch 1 8 32 --out $OUT/x2 > $OUT/x2/trace.log 2>&1
timeout 100 python3 -m bench.trace --world-size 2 --batch 1 8 32 --calls 1 --replays 200 --out $OUT/x2 \
  >> $OUT/x2/trace.log 2>&1
echo "== traces rc=$?"; grep -A4 "^median" $OUT/x2/trace.log
