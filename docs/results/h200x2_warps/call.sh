# Two H200s, one rank each, 16 heads per rank, D = 512: small calls with fewer warps per program,
# which gives fewer rows per tile and so more programs per call (--num-warps 1, 2, 4 against the
# default tiling), benchmark (triton, graph8 and graph) and bench.trace, in one machine start.
# From the repository root: `NEW=<commit> bash docs/results/h200x2_warps/call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
mkdir -p $OUT/x2; LOG=$OUT/x2/run.log
step() { echo "== $*" | tee -a $LOG; timeout 200 "$@" >> $LOG 2>&1; echo "rc=$?" | tee -a $LOG; tail -n 8 $LOG | grep -v "^\[#"; }
for w in 8 4 2 1 8; do
  step python3 -m bench --world-size 2 --batch 1 8 32 --head-dim 512 --backends triton --modes graph8 graph \
    --num-warps $w --out $OUT/x2
done
for w in 4 2 1; do
  step python3 -m bench.trace --world-size 2 --batch 1 8 32 --num-warps $w --out $OUT/x2
done
