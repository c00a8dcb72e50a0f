# One H200, MPS: the eager rows with the benchmark's clock mark launched through Triton's JIT entry
# (OLD, in _ab_old/) and through the compiled kernel's launcher (NEW, this tree), in turn, twice;
# then this tree's host-time probe and graph-floor probe. From the repository root, with OLD's files
# in _ab_old/: `OLD=<commit> NEW=<commit> bash docs/results/h200_mark_launch/ab_call.sh`.
export PYTHONUNBUFFERED=1
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d; trap 'echo quit | nvidia-cuda-mps-control' EXIT
ROOT=$PWD; AB=$OUT/ab; mkdir -p $AB
python3 -m pytest -q -m gpu tests/test_bench_gpu.py -p no:cacheprovider 2>&1 | tail -3
for round in 1 2; do
  for side in old new; do
    if [ $side = old ]; then tree=$ROOT/_ab_old; commit=$OLD; else tree=$ROOT; commit=$NEW; fi
    (cd $tree && PYTHONPATH=$tree DCP_GIT_COMMIT=$commit python3 -m bench --world-size 3 6 --batch 1 8 \
      --modes eager --backends triton --head-dim 512 --out $AB/${side}_$round > $AB/${side}_$round.log 2>&1)
    echo "== $side $round rc=$?"; grep -E "^ *[36] +triton" $AB/${side}_$round.log
  done
done
PYTHONPATH=$ROOT DCP_GIT_COMMIT=$NEW python3 -m bench.host_time --world-size 3 > $AB/host_time.log 2>&1
echo "== host_time rc=$?"; sed -n 1,13p $AB/host_time.log
PYTHONPATH=$ROOT python3 docs/results/h200_graph_floor/floor.py > $AB/floor.log 2>&1
echo "== floor rc=$?"; tail -8 $AB/floor.log
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $AB
