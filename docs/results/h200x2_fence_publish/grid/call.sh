# Two H200s, main's kernel: N = 2 traces with the grid capped at k programs (sitecustomize.py),
# and with 16 warps per program. From the repository root:
# `bash docs/results/h200x2_fence_publish/grid/call.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/docs/results/h200x2_fence_publish/grid:$PWD
for k in "" 1 2 4 8; do
  echo "== programs at most ${k:-default}"
  DCP_SCRATCH_PROGRAMS=$k timeout 60 python3 -m bench.trace --world-size 2 --batch 1 8 32 --out /tmp/g$k 2>&1 | tee -a $OUT/grid.log | tail -4
done
echo "== 16 warps"
timeout 60 python3 -m bench.trace --world-size 2 --batch 1 8 32 --num-warps 16 --out /tmp/w16 2>&1 | tee -a $OUT/grid.log | tail -4
