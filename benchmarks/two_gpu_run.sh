#!/usr/bin/env bash
# final_run.sh's steps on a machine with two GPUs, in parallel: the GPU tests (untuned, then
# $TUNING_TESTS fully tuned) on GPU 0, the profile and $SWEEPS (benchmark scripts, each given
# --out $OUT/<name>.json) on GPU 1. Few files come back from the device: the tests' logs are joined into
# $OUT/tests.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/tests" "$OUT/profile"
started=$(date +%s)
(
    export CUDA_VISIBLE_DEVICES=0
    PROFILE= BENCH_VARIANTS= OUT=$OUT/tests bash benchmarks/final_run.sh
    echo "GPU 0 done after $(( $(date +%s) - started )) s"
) > "$OUT/gpu0.txt" 2>&1 &
(
    export CUDA_VISIBLE_DEVICES=1
    ENGINE_TESTS= OPS_TESTS= TUNING_TESTS= PROFILE=1 BENCH_VARIANTS= CACHE=$PWD/.tc OUT=$OUT/profile bash benchmarks/final_run.sh
    for sweep in ${SWEEPS:-}; do
        name=$(basename "$sweep" .py)
        timeout ${SWEEP_TIMEOUT:-240} python3 "$sweep" --out "$OUT/$name.json" > "$OUT/$name.md" 2>> "$OUT/profile/err.log"
        echo "$name rc $?"
    done
    echo "GPU 1 done after $(( $(date +%s) - started )) s"
) > "$OUT/gpu1.txt" 2>&1 &
wait
cat "$OUT/gpu0.txt" "$OUT/gpu1.txt"
for log in "$OUT"/tests/*.log; do echo "=== $(basename "$log")"; cat "$log"; done > "$OUT/tests.log"
rm -rf "$OUT/tests" "$OUT/gpu0.txt"
mv "$OUT/profile/profile.json" "$OUT/profile/profile.md" "$OUT/profile/err.log" "$OUT/" 2>/dev/null
rm -rf "$OUT/profile"
