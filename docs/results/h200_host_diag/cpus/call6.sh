export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=6d45bc9
python3 docs/results/h200_host_diag/cpus/cpu_speed.py 2>&1 | tee $OUT/cpu_speed.log
FAST=$(grep ^FAST= $OUT/cpu_speed.log | cut -d= -f2); SLOW=$(grep ^SLOW= $OUT/cpu_speed.log | cut -d= -f2)
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
for set in FAST SLOW FAST SLOW; do
  cpus=${!set}; echo "== ranks on the $set vCPUs ($cpus)"
  taskset -c $cpus python3 -m bench.host_time --world-size 3 --batch 1 2>&1 | tee -a $OUT/host_time_pinned_$set.log | sed -n 3,9p
done
