#!/bin/bash
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 MOEFUSE_COMMIT=$(cat .gpu/commit)
nvidia-smi --query-gpu=name --format=csv > $OUT/gpu.txt 2>&1
timeout 150 python -m moefuse bench overhead --ops per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --world-size 0 --repeats 15 --calls 1000 --save --tag quant-group --out $OUT > $OUT/overhead.log 2>&1; echo "ovh rc=$?" >> $OUT/overhead.log
timeout 100 python .gpu/hostprobe.py > $OUT/hostprobe.log 2>&1
timeout 320 python -m moefuse bench quant --ops per_token_group_quant_8bit,rmsnorm_group_quant,fused_add_rmsnorm_group_quant --tokens 1,16,128,2048,16384 --save --out $OUT > $OUT/quant.log 2>&1; echo "quant rc=$?" >> $OUT/quant.log
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/hostprobe.json"))
for k, v in d.items(): print(k, v.get("host_us"), v.get("no_launch_us"))
PY
tail -8 $OUT/overhead.log; grep -E "BAR|rc=" $OUT/quant.log | tail -40
