# Scratch (not a mode of the library): ways to publish after the pushes, two H200s, N = 2.
# DCP_SCRATCH_FENCE: 0 base, 1 GPU-scope fence (timing only), 2 thread 0 st.release.sys per flag,
# 3 program 0 fences only (timing only), 4 elect (GPU-scope release count, last program fences once).
cd _scratch
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD DCP_GIT_COMMIT=scratch-on-4cdac20
for v in 0 1 2 3 4; do
  echo "== variant $v"
  DCP_SCRATCH_FENCE=$v timeout 120 python3 -m bench.trace --world-size 2 --batch 1 8 32 --out $OUT/t$v 2>&1 | tee $OUT/trace_v$v.log | tail -5
done
for v in 2 4 0; do
  echo "== stress variant $v"
  DCP_SCRATCH_FENCE=$v timeout 200 python3 stress.py 2 40 2>&1 | tee $OUT/stress_v$v.log | tail -4
done
for v in 0 2 4; do
  echo "== bench variant $v"
  DCP_SCRATCH_FENCE=$v timeout 150 python3 -m bench --world-size 2 --batch 1 8 32 --head-dim 512 --backends triton --modes graph8 graph --out $OUT/b$v 2>&1 | tee $OUT/bench_v$v.log | tail -8
done
cd $OUT && tar czf all.tgz t* b* stress_* 2>/dev/null; find . -mindepth 1 -not -name all.tgz -delete; ls $OUT
