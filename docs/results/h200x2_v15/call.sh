# Two H200s, one call: the whole GPU tier under MPS (tier/, as docs/results/h200x2_gpu_tier/call.sh),
# then the N = 2 tests, the N = 2 sweep and traces (docs/results/h200x2_v14/sweep.sh). What does not
# fit the device's 8 returned files is packed in extra.tgz. From the repository root:
# `NEW=<commit> bash docs/results/h200x2_v15/call.sh`.
export NEW
OUT0=$OUT
OUT=$OUT0/tier bash -c 'mkdir -p $OUT; bash docs/results/h200x2_gpu_tier/call.sh'
OUT=$OUT0 bash docs/results/h200x2_v14/sweep.sh
cd $OUT0 && tar czf extra.tgz tier/gpus.txt topo.txt x2/results.csv x2/results.json x2/trace.json x2/*.png \
  && rm -f tier/gpus.txt topo.txt x2/results.csv x2/results.json x2/trace.json x2/*.png && find . -type f
