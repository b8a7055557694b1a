#!/usr/bin/env bash
# A/B timing of two versions of src/ inside ONE device call, alternating.
#
# Why: two H200 machine instances differ by ~0.4 µs per decode call (2026-11-30: the same
# all-reduce read 3.38 µs on one instance and 3.62 on the next), and identical kernels in one run
# spread by 0.2-0.5 µs; most decode changes are smaller than that. Only runs in one call, taken
# in turn, compare two versions.
#
# Locally, before the call (ab/ must be untracked and not ignored, so that it travels):
#     mkdir -p ab/ref && git archive REF src | tar x -C ab/ref
# On the device (the working tree's src/ is "new"):
#     bash scripts/ab_compare.sh ROUNDS NAME CMD [ARGS...]
# runs CMD 2 x ROUNDS times, ref then new, with PYTHONPATH=ab/ref/src or src. $RUN_OUT names a
# fresh folder per run, for CMD's --out. Each run's output goes to NAME-{ref,new}-i.log. The
# last lines of each log are printed. Everything is packed into $OUT/NAME.tgz, because the
# device returns at most 8 files.
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then  # the comment block above
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
set -u
rounds=$1 name=$2
shift 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
work=$(mktemp -d)
for i in $(seq 1 "$rounds"); do
    for side in ref new; do
        src=src
        [ "$side" = ref ] && src=ab/ref/src
        log=$work/$name-$side-$i.log
        export RUN_OUT=$work/$name-$side-$i
        mkdir -p "$RUN_OUT"
        start=$SECONDS
        PYTHONPATH=$src "$@" > "$log" 2>&1
        echo "rc=$? seconds=$((SECONDS - start))" >> "$log"
        echo "== $name $side round $i"
        grep -v "Warning\|warn(\|return func" "$log" | tail -12
    done
done
tar czf "${OUT:-.}/$name.tgz" -C "$work" .
