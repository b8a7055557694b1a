#!/usr/bin/env bash
# One call on 2 x H200 for the communication fusions and the clients: each step writes under
# $W and the whole folder is re-packed into $OUT/all.tgz after every step (8 files come back).
# Steps: `bash scripts/final_gpu_run.sh moe-reduction expert-norm tp-example` (default: all); t-* steps
# run GPU test files; two lists can run at once: `(bash $0 t-fastpath &); bash $0 t-moe-reduction`.
# 2-GPU runs that decide the loopback-measured defaults (each < 10 min):
#   bash scripts/final_gpu_run.sh t-allgather tp-quick      (tests of the new paths; tp split fold)
#   bash scripts/final_gpu_run.sh ag-gated t-expert-norm    (gated persistent vs moefuse_chunked)
#   bash scripts/final_gpu_run.sh ag-modes                  (decode / persistent modes per op)
#   bash scripts/final_gpu_run.sh moe-reduction-large t-moe-reduction (moe_allreduce_residual_rmsnorm "auto" = two-shot at
#     2 CTAs per SM for H > 4096, M >= 2048, against fused_oneshot, fused_twoshot_1cta_per_sm and
#     chain (a); moe_finalize_allreduce_residual_rmsnorm fused_twoshot against its one-shot default, predicted ~12 % faster)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
W=/tmp/w; mkdir -p $W
pack() { tar czf $OUT/${PACK:-all}.tgz -C $W . ; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout $limit "$@" > $W/$name.log 2>&1; echo "rc=$?" >> $W/$name.log; grep -v "Warning\|warn(\|enable(name)\|return func" $W/$name.log | tail -30; pack; }
want() { [ -z "$STEPS" ] || [[ " $STEPS " == *" $1 "* ]]; }
STEPS="$*"
T="python -m pytest -q -p no:cacheprovider"
want t-fastpath && step t-fastpath 300 $T tests/test_fastpath_gpu.py
want t-single && step t-single 400 $T tests/test_norm_gpu.py tests/test_moe_gpu.py tests/test_quant_gpu.py
want t-hf && step t-hf 300 $T tests/test_integrations_transformers_gpu.py
want t-moe-reduction && step t-moe-reduction 400 $T tests/test_comm_moe_reduction_gpu.py
want t-expert-norm && step t-expert-norm 300 $T tests/test_comm_expert_norm_gpu.py
want t-allgather && step t-allgather 300 $T tests/test_comm_allgather_gpu.py
want t-comm && step t-comm 300 $T tests/test_comm_gpu.py tests/test_comm_faults_gpu.py
want t-loopback && step t-loopback 200 $T tests/test_comm_loopback_gpu.py
want overhead && step overhead 200 python -m moefuse bench overhead --world-size 2 --save --out $W
want pdl-moe && step pdl-moe 150 python -m moefuse bench moe --quick --no-compile --no-layer --save --out $W/pdl
want pdl-norm && step pdl-norm 200 python -m moefuse bench norm --quick --save --out $W/pdl
want env && step env 60 python -m moefuse env
want demo && step demo 120 python -m moefuse demo
want ag-large && step ag-large 240 python scripts/bench_allgather_large.py --out $W
want moe-variants && step moe-variants 210 python scripts/bench_moe_reduction_variants.py --out $W
want tp-quick && step tp-quick 170 python -m moefuse bench expert-norm --world-size 2 --quick --save --out $W
want t-moe-variants && step t-moe-variants 400 $T tests/test_comm_moe_reduction_gpu.py -k variants
want allgather-all && step allgather-all 560 python -m moefuse bench all-gather --world-size 2 --save --out $W
want moe-reduction-wide && step moe-reduction-wide 300 python -m moefuse bench moe-reduction --world-size 2 --save --out $W --tokens 1,8,64,512,2048,16384 --hidden 4096,7168
want moe-reduction-large && step moe-reduction-large 300 python -m moefuse bench moe-reduction --world-size 2 --out $W/large --tokens 2048,16384 --hidden 7168,4096
want moe-reduction && step moe-reduction 185 python -m moefuse bench moe-reduction --world-size 2 --save --out $W --tokens 1,8,64,512,2048 --hidden 4096
want expert-norm && step expert-norm 80 python -m moefuse bench expert-norm --world-size 2 --quick --save --out $W
want tp-example && step tp-example 45 torchrun --nproc-per-node 2 examples/tp_moe_layer.py --out $W
want ag-modes && step ag-modes 300 python -m moefuse bench all-gather --world-size 2 --out $W/modes --ops fp8,gated,rmsnorm,fp4 --tokens 1,8,4096 --hidden 4096,8192
want ag-gated && step ag-gated 300 python -m moefuse bench all-gather --world-size 2 --out $W/gated --ops gated --tokens 512,4096,16384 --hidden 4096,8192
want allgather && step allgather 110 python -m moefuse bench all-gather --world-size 2 --save --out $W --ops rmsnorm
want diag-decode && step diag-decode 150 python scripts/diag_decode.py --out $W
want hf-moe && step hf-moe 70 python -m moefuse.bench.hf_moe --out $W --tokens 1 16 256 2048 8192 --decode-repeats 1
exit 0
