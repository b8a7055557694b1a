#!/usr/bin/env bash
# One call on 2 x H200 for the communication fusions and the clients: each step writes under
# $W and the whole folder is re-packed into $OUT/all.tgz after every step (8 files come back).
# Steps: `bash scripts/final_gpu_run.sh moe-comm moe-comm-tp tp-example` (default: all).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
pack() { tar czf $OUT/all.tgz -C $W . ; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $W/$name.log 2>&1; echo "rc=$?" >> $W/$name.log; grep -v "Warning\|warn(\|enable(name)\|return func" $W/$name.log | tail -30; pack; }
want() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS="$*"
want moe-comm && step moe-comm 140 python -m moefuse bench moe-comm --world-size 2 --save --out $W --tokens 1,8,64,512,2048 --hidden 4096
want moe-comm-tp && step moe-comm-tp 80 python -m moefuse.bench.moe_comm_tp --world-size 2 --quick --out $W
want tp-example && step tp-example 45 torchrun --nproc-per-node 2 examples/tp_moe_layer.py --out $W
want allgather && step allgather 110 python -m moefuse bench allgather --world-size 2 --save --out $W --ops rmsnorm
want hf-moe && step hf-moe 70 python -m moefuse.bench.hf_moe --out $W --tokens 1 16 256 2048 8192 --decode-repeats 1
exit 0
