# Two H200s: the N = 2 GPU tests, the host-time probe of 156955d and of this commit, the N = 2 sweep (D = 512).
export PYTHONUNBUFFERED=1 DCP_GIT_COMMIT=2274914
nvidia-smi topo -m > $OUT/topo.txt 2>&1
PYTHONPATH=$PWD python3 -m pytest -q -m gpu tests -p no:cacheprovider -rA -k "2]" --timeout 600 > $OUT/gpu_tests_n2.log 2>&1
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/gpu_tests_n2.log | tail -6
(cd _ab_old && DCP_GIT_COMMIT=156955d PYTHONPATH=$PWD python3 -m bench.host_time --world-size 2 --batch 8) > $OUT/host_time_156955d.log 2>&1
PYTHONPATH=$PWD python3 -m bench.host_time --world-size 2 --batch 8 > $OUT/host_time_2274914.log 2>&1
(cd _ab_old && DCP_GIT_COMMIT=156955d PYTHONPATH=$PWD python3 -m bench.host_time --world-size 2 --batch 8) > $OUT/host_time_156955d_again.log 2>&1
for f in host_time_156955d host_time_2274914 host_time_156955d_again; do echo "== $f"; sed -n 3,9p $OUT/$f.log; done
PYTHONPATH=$PWD python3 -m bench --world-size 2 --head-dim 512 --out $OUT > $OUT/bench.log 2>&1
tail -62 $OUT/bench.log | grep -E "^ *2 +triton" | awk '{print $4,$5,$7,$16,$19,$20,$21}'
