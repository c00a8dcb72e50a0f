# Call 2 (one H200, MPS, ec25425): per-rank host time of the eager call under several loops (diag.py; it ran from the root as _diag.py).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=ec25425
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
python3 docs/results/h200_host_diag/diag.py 3 1 2>&1 | tee $OUT/diag_n3_b1.log
python3 docs/results/h200_host_diag/diag.py 6 8 2>&1 | tee $OUT/diag_n6_b8.log
python3 -m bench --world-size 3 --batch 1 8 --modes eager --backends triton --head-dim 512 --iters 2000 --out /tmp/b2000 2>&1 | tail -3 | tee $OUT/bench_iters2000.log
