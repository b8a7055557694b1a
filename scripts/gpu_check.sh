#!/usr/bin/env bash
# One device call: every GPU test suite, spread over the GPUs present, logs under ${OUT:-out}.
# Usage (repo root, on an H200 machine): bash scripts/gpu_check.sh [--bench] [TEST_FILE ...]
#   the single-GPU suites (every tests/test_*_gpu.py without the multigpu marker, or only the
#   TEST_FILEs given) run in parallel, one per GPU; then the communication suites for every world
#   size the machine has (one GPU: the loopback suite, two ranks on it; skipped when TEST_FILEs
#   are given); with --bench the benchmarks follow (JSON + PNG under $OUT/results).
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT/results"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
bench=0
if [[ "${1:-}" == "--bench" ]]; then bench=1; shift; fi
if (( $# > 0 )); then
  suites=("$@")
else
  mapfile -t suites < <(grep -L "multigpu" tests/test_*_gpu.py | grep -v "test_comm_loopback_gpu")
fi
pids=()
for i in "${!suites[@]}"; do
  gpu=$((i % gpus))
  name=$(basename "${suites[$i]}" .py)
  CUDA_VISIBLE_DEVICES=$gpu python3 -m pytest -q -p no:cacheprovider "${suites[$i]}" \
    > "$OUT/$name.log" 2>&1 &
  pids+=($!)
  if (( gpus == 1 )); then wait "${pids[-1]}"; fi
done
wait
for s in "${suites[@]}"; do name=$(basename "$s" .py); echo "$name: $(tail -1 "$OUT/$name.log")"; done
if (( $# > 0 )); then
  :  # only the files asked for
elif (( gpus >= 2 )); then
  for s in $(grep -l "multigpu" tests/test_*_gpu.py); do
    name=$(basename "$s" .py)
    python3 -m pytest -q -p no:cacheprovider "$s" > "$OUT/$name.log" 2>&1
    echo "$name: $(tail -1 "$OUT/$name.log")"
  done
else  # one GPU: the communication kernels as two loopback ranks on it
  python3 -m pytest -q -p no:cacheprovider tests/test_comm_loopback_gpu.py \
    > "$OUT/test_comm_loopback_gpu.log" 2>&1
  echo "test_comm_loopback_gpu: $(tail -1 "$OUT/test_comm_loopback_gpu.log")"
fi
if (( bench )); then
  for fam in norm moe quant; do
    python3 -m moefuse bench "$fam" --save --out "$OUT/results" > "$OUT/bench_$fam.log" 2>&1
  done
  for p in 2 4 8; do
    (( gpus >= p )) && python3 -m moefuse bench all-reduce --world-size "$p" --save \
      --out "$OUT/results" > "$OUT/bench_allreduce_p$p.log" 2>&1
  done
  grep -hE "BAR|PASS|FAIL" "$OUT"/bench_*.log | tail -40
fi
