#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 400 python .gpu/tma_probe.py > $OUT/tma.log 2>&1; echo "rc=$?" >> $OUT/tma.log
cat $OUT/tma.log | cut -c1-260
