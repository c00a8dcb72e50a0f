set -o pipefail
R=$OUT; export OUT=/tmp/abo; mkdir -p $OUT
nvidia-smi -L | tee $OUT/versions.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/versions.txt
P="--world-size 3 6 --head-dim 512 --heads-per-rank 16 --query-dim 576 --modes graph8 --backends push --iters 100 --op combine"
( time bash bench/ab.sh "old=ab/old new=." $P --batch 0 1 8 64 512 --metadata ) 2>&1 | tail -4
( time OUT=$OUT/plain bash bench/ab.sh "old=ab/old new=." $P --batch 8 64 512 --no-metadata ) 2>&1 | tail -4
( time OUT=$OUT/repeat bash bench/ab.sh "new2=. old2=ab/old" $P --batch 8 64 512 --metadata ) 2>&1 | tail -4
tar -czf $R/ab.tgz -C /tmp abo
