# One H200: the whole GPU script at this commit. From the repository root:
# `DCP_GIT_COMMIT=<commit> bash docs/results/h200_v12/call.sh`.
bash bench/gpu_all.sh --head-dim 512 > $OUT/gpu_all_stdout.log 2>&1
echo "== gpu_all rc=$?"; grep -E "passed|failed" $OUT/gpu_tests.log | tail -2; sed -n 1,12p $OUT/host_time.log; tail -12 $OUT/trace.log; tail -40 $OUT/bench.log
cd $OUT && tar czf data.tgz results.csv results.json trace.json && rm -f results.csv results.json trace.json && ls
