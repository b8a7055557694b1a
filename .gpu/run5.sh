#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=$(cat .gpu/commit)
S=$(date +%s)
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
timeout 100 python -m moefuse bench overhead --ops per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --world-size 0 --repeats 15 --calls 1000 --save --tag quant-group --out $OUT > $OUT/overhead.log 2>&1; echo "ovh rc=$?" >> $OUT/overhead.log
timeout 50 python .gpu/hostprobe.py > $OUT/hostprobe.log 2>&1
timeout 200 python .gpu/tma_probe.py > $OUT/tma.log 2>&1; echo "rc=$?" >> $OUT/tma.log
L=$(( 420 - ($(date +%s) - S) ))
timeout $L python -m moefuse bench quant --ops per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --tokens 1,16,128,2048,16384 --save --out $OUT > $OUT/quant.log 2>&1; echo "quant rc=$? limit $L" >> $OUT/quant.log
tail -5 $OUT/overhead.log; cut -c1-250 $OUT/tma.log; grep -E "BAR|rc=" $OUT/quant.log | tail -30
