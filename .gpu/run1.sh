#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=167f99f
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt 2>&1
V="base pf pf2 pf2_fq pf512_2"
( time timeout 240 python scripts/bench_fp8_decode_variants.py warm --jobs 16 --variants $V ) > $OUT/warm.log 2>&1 &
WP=$!
timeout 200 python -m pytest -q -x tests/test_moe_experts_fp8_gpu.py -k "placements or linear" > $OUT/pytest1.log 2>&1
echo "pytest rc=$?" >> $OUT/pytest1.log
wait $WP; echo "warm rc=$?" >> $OUT/warm.log
timeout 200 python scripts/bench_fp8_decode_variants.py time --variants $V --tokens 1 4 16 --out $OUT/variants.jsonl > $OUT/time.log 2>&1
echo "time rc=$?" >> $OUT/time.log
tail -5 $OUT/pytest1.log; tail -3 $OUT/warm.log; tail -40 $OUT/time.log
