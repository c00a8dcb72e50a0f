export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=6d45bc9
lscpu > $OUT/lscpu.txt 2>&1; lscpu -e >> $OUT/lscpu.txt 2>&1
python3 docs/results/h200_host_diag/cpus/smt.py 2>&1 | tee $OUT/smt.log
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
python3 docs/results/h200_host_diag/cpus/pdl_host.py 2>&1 | tee $OUT/pdl_host.log
