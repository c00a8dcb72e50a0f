# One H200 under MPS: constructor time with a cold and a warm Triton cache, e34db41 (every rank
# compiles every variant; its tree exported to build/old and carried) against this tree (ranks share
# the compiling). From the repository root: `NEW=<commit> bash docs/results/h200_compile_share/call.sh`.
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d && trap 'echo quit | nvidia-cuda-mps-control' EXIT
here=docs/results/h200_compile_share
for n in 3 6; do
  for tree in build/old .; do
    PYTHONPATH=$tree python3 $here/construct_time.py --world-size $n 2>&1 | grep -v Warning | tee -a $OUT/construct_time.log
  done
done
