# The calls that made this folder (one H100, one machine start, 2026-12-06), from a checkout of 79673e8
# with ab/old an archive of it, ab/new and ab/new32 the same with ChannelLayout.row_elems padding
# combine rows to 64 and 16 lanes (128 and 32 bytes) instead of 8 (row128.patch, row32.patch).
# Call 1 (before the GPU tier):       python3 probe_copy.py
# Call 4 (after the sweep):           python3 probe_stride.py, then
bash bench/ab.sh "old=ab/old row128=ab/new old2=ab/old" --world-size 3 6 --head-dim 512 --heads-per-rank 16 \
  --op combine --modes graph8 --backends push --iters 100 --batch 64 512 --metadata
# Call 5:
bash bench/ab.sh "old=ab/old row32=ab/new32 old2=ab/old" --world-size 3 6 --head-dim 512 --heads-per-rank 16 \
  --op combine --modes graph8 --backends push --iters 100 --batch 64 512 --metadata
