# The call that produced this folder (it was docs/results/h200_v12/call.sh then; body unchanged).
# On the device, from the repository root, with $OUT the folder to fill:
#   DCP_GIT_COMMIT=5f6c04c bash docs/results/h200/call.sh     (one H200; 429.8 s)
# data.tgz (results.csv, results.json, trace.json) has been unpacked into this folder.
bash bench/gpu_all.sh --head-dim 512 > $OUT/gpu_all_stdout.log 2>&1
echo "== gpu_all rc=$?"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; sed -n 1,12p $OUT/host_time.log; tail -12 $OUT/trace.log; tail -40 $OUT/bench.log
cd $OUT && tar czf data.tgz results.csv results.json trace.json && rm -f results.csv results.json trace.json && ls
