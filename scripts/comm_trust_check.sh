#!/usr/bin/env bash
# The communication trust checks on ONE GPU, in one go, logs under ${OUT:-out}:
#   1. the first-call stress: per family 200 rounds of fresh workspace, first call, fault check,
#      bitwise check, close (two loopback ranks; moefuse.tools.loopback_gpu_check --stress);
#   2. host µs per eager call of every public op, the communication ops on loopback ranks
#      (python -m moefuse bench overhead --save: JSON + PNG under $OUT/results);
#   3. tests/test_comm_loopback_gpu.py run again and again, each in a fresh pytest process,
#      until RUNS runs (default 20) or BUDGET_S seconds (default 300) have gone by.
# Usage (repo root): [RUNS=20] [BUDGET_S=300] [STRESS=200] bash scripts/comm_trust_check.sh
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
RUNS=${RUNS:-20}
BUDGET_S=${BUDGET_S:-300}
STRESS=${STRESS:-200}
mkdir -p "$OUT/results"
python3 -m moefuse.tools.loopback_gpu_check --out "$OUT" --stress "$STRESS" --hidden 4096,7168 \
  --tokens 1,7,64 > "$OUT/stress.log" 2>&1
echo "stress (rc $?):"; grep -E "^STRESS|^summary" "$OUT/stress.log"
python3 -m moefuse bench overhead --save --out "$OUT/results" --calls 300 --repeats 5 \
  > "$OUT/overhead.log" 2>&1
echo "bench overhead (rc $?):"; grep -E "loopback|FAIL" "$OUT/overhead.log" | tail -20
start=$SECONDS
clean=0
for ((i = 1; i <= RUNS; i++)); do
  (( SECONDS - start > BUDGET_S )) && break
  python3 -m pytest -q -p no:cacheprovider tests/test_comm_loopback_gpu.py \
    > "$OUT/loopback_run.log" 2>&1
  rc=$?
  echo "run $i: rc $rc, $(tail -1 "$OUT/loopback_run.log") ($((SECONDS - start)) s)" \
    | tee -a "$OUT/loopback_runs.log"
  if (( rc == 0 )); then clean=$((clean + 1)); else cp "$OUT/loopback_run.log" "$OUT/loopback_fail_$i.log"; fi
done
echo "test_comm_loopback_gpu.py: $clean clean of $((i - 1)) runs"
