#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=$(cat .gpu/commit)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
timeout 240 python -m moefuse bench fp8-linear --shapes dsv3_o_proj dsv3_mlp_down dsv3_q_b_proj qwen3_q_proj qwen3_o_proj --rows 1 4 16 --prefetch 2048 8192 65536 --out $OUT > $OUT/lin.log 2>&1; echo "lin rc=$?" >> $OUT/lin.log
timeout 150 python -m moefuse bench overhead --ops rmsnorm,fused_add_rmsnorm,per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --world-size 0 --repeats 15 --calls 1000 --out $OUT > $OUT/overhead.log 2>&1; echo "ovh rc=$?" >> $OUT/overhead.log

timeout 100 python .gpu/hostprobe.py > $OUT/hostprobe.log 2>&1; tail -60 $OUT/hostprobe.log
tail -45 $OUT/lin.log; tail -12 $OUT/overhead.log
