# One H200, MPS: N = 4 and 8 at this commit (B = 1, 8, 512; three modes). From the
# repository root: `DCP_GIT_COMMIT=<commit> bash docs/results/h200_n48_v12/call.sh`.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 170 python3 -m bench --mps --world-size 4 8 --batch 1 8 512 --head-dim 512 --backends triton \
  --out $OUT 2>&1 | tee $OUT/bench.log | tail -22
