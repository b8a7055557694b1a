#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=$(cat .gpu/commit)
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
timeout 90 python -m moefuse bench overhead --ops per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --world-size 0 --repeats 15 --calls 1000 --save --tag quant-group --out $OUT > $OUT/overhead.log 2>&1; echo "ovh rc=$?" >> $OUT/overhead.log
timeout 150 python .gpu/tma_probe.py > $OUT/tma.log 2>&1; echo "rc=$?" >> $OUT/tma.log
tail -5 $OUT/overhead.log; cut -c1-250 $OUT/tma.log
