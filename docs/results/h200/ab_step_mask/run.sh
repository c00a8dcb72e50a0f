set -o pipefail
R=$OUT; export OUT=/tmp/abo; mkdir -p $OUT
nvidia-smi -L | tee $OUT/versions.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a $OUT/versions.txt
export CUDA_MPS_PIPE_DIRECTORY="$(mktemp -d)" CUDA_MPS_LOG_DIRECTORY="$(mktemp -d)"
nvidia-cuda-mps-control -d
( time timeout 200 python3 -m pytest -q -x tests/test_gpu_tier.py -k "batch_metadata_gpu and 3" ) > $OUT/gpu_test_meta.log 2>&1; tail -4 $OUT/gpu_test_meta.log
echo quit | nvidia-cuda-mps-control
P="--world-size 3 6 --head-dim 512 --heads-per-rank 16 --query-dim 576 --modes graph8 --backends push --iters 100 --op combine --batch 1 8 64 512"
( time OUT=$OUT/meta bash bench/ab.sh "old=ab/old nostep=ab/nostep step=." $P --metadata ) 2>&1 | tail -3
( time OUT=$OUT/plain bash bench/ab.sh "oldplain=ab/old newplain=." $P --no-metadata ) 2>&1 | tail -3
tar -czf $R/ab.tgz -C /tmp abo
