#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=$(cat .gpu/commit)
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
timeout 150 python -m moefuse bench fp8-linear --shapes dsv3_o_proj dsv3_mlp_down qwen3_q_proj qwen3_o_proj dsv3_q_b_proj --rows 2048 8192 --replays 10 --tiles tma128x128x8x4 tma128x128x8x3 tma64x128x4x4 --out $OUT > $OUT/lin.log 2>&1; echo "lin rc=$?" >> $OUT/lin.log
timeout 100 python -m pytest -q -x tests/test_moe_experts_fp8_gpu.py -k "test_fp8_linear" > $OUT/pytest.log 2>&1; echo "pytest rc=$?" >> $OUT/pytest.log
grep -E "tma|moefuse |bf16_mm|scaled|rc=|Error|error" $OUT/lin.log | cut -c1-120 | tail -60; tail -4 $OUT/pytest.log
