set -o pipefail
nvidia-smi -L | tee $OUT/versions.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/versions.txt
P="--world-size 3 6 --head-dim 512 --heads-per-rank 16 --query-dim 576 --modes graph8 --backends push --iters 100 --batch 0 1 8 64 512"
T="old=ab/old hoist=ab/hoist fence=ab/fence"
time bash bench/ab.sh "$T" $P --op combine gather --metadata
mkdir -p $OUT/plain
time OUT=$OUT/plain bash bench/ab.sh "old=ab/old hoist=ab/hoist" ${P% --batch*} --batch 8 64 512 --op combine --no-metadata
