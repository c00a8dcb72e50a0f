# Call 1 (one H200, MPS): host time of the eager call, old (156955d, unpacked into _ab_old/) vs new
# (ec25425), OMP threads unset vs 1. Run from the repository root with `bash ab_call.sh`.
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
(nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz"; python3 -c "import torch; print(torch.get_num_threads(), torch.__config__.parallel_info())") > $OUT/host.txt 2>&1
run() {  # tree commit tag omp args...
  local dir=$1 commit=$2 tag=$3 omp=$4; shift 4
  ( cd $dir && if [ $omp = 1 ]; then export OMP_NUM_THREADS=1; fi; DCP_GIT_COMMIT=$commit PYTHONPATH=$PWD "$@" ) > $OUT/$tag.log 2>&1
  echo "== $tag rc=$?"; grep -E "^lse_reduce|_validate|_operands|transport.launch|torch add_|^ *[36] +triton" $OUT/$tag.log
}
run _ab_old 156955d probe_old x python3 -m bench.host_time --world-size 3 --batch 1
run . ec25425 probe_new x python3 -m bench.host_time --world-size 3 --batch 1
B="python3 -m bench --world-size 3 6 --batch 1 8 --modes eager --backends triton --head-dim 512"
run _ab_old 156955d bench_old_omp x $B --out $OUT/bench_old_omp
run . ec25425 bench_new_omp x $B --out $OUT/bench_new_omp
run _ab_old 156955d bench_old_omp1 1 $B --out $OUT/bench_old_omp1
run . ec25425 bench_new_omp1 1 $B --out $OUT/bench_new_omp1
run . ec25425 bench_new_omp_again x $B --out $OUT/bench_new_omp_again
