# Two H200s, one rank each: the smallest call the communicator takes (B = 1, one head per rank,
# D = 8: 32-byte rows) against the user's shape (16 heads per rank, D = 512), in one machine start:
# the benchmark (both backends, three modes) and bench.trace (graphs of 8 and of one). From the
# repository root: `NEW=<commit> bash docs/results/h200x2_smallest/call.sh`.
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=$NEW PYTHONPATH=$PWD
mkdir -p $OUT/x2; LOG=$OUT/x2/run.log
step() { echo "== $*" | tee -a $LOG; timeout 200 "$@" >> $LOG 2>&1; echo "rc=$?" | tee -a $LOG; tail -n 12 $LOG | grep -v "^\[#"; }
step python3 -m bench --world-size 2 --batch 1 --heads-per-rank 1 --head-dim 8 --out $OUT/x2
step python3 -m bench --world-size 2 --batch 1 8 32 --head-dim 512 --out $OUT/x2
step python3 -m bench.trace --world-size 2 --batch 1 --heads-per-rank 1 --head-dim 8 --out $OUT/x2
step python3 -m bench.trace --world-size 2 --batch 1 --heads-per-rank 1 --head-dim 8 --calls 1 --replays 200 --out $OUT/x2
step python3 -m bench.trace --world-size 2 --batch 1 8 32 --out $OUT/x2
step python3 -m bench.trace --world-size 2 --batch 1 8 32 --calls 1 --replays 200 --out $OUT/x2
