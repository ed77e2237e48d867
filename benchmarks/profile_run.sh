#!/usr/bin/env bash
# One call on the GPU machine for the optimisation loop: PDL correctness (fast, untuned kernels), then the
# per-kernel profile with and without PDL and the decode benchmark of the CUDA-graph engine (tuned kernels;
# the autotune choices are copied to $OUT/tune so a later call can start from them).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tc}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/gpu.txt"
if [ -n "${CHECK_TESTS:-}" ]; then
    QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout ${CHECK_TIMEOUT:-240} python3 -m pytest -m gpu \
        $CHECK_TESTS -q -x --tb=short -p no:cacheprovider > "$OUT/check.log" 2>&1
    tail -3 "$OUT/check.log"
fi
if [ -n "${SWEEP:-}" ]; then
    timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/decode_sweep.py --out "$OUT/sweep.json" > "$OUT/sweep.md" 2> "$OUT/sweep.err"
    echo "sweep rc $?"; cat "$OUT/sweep.md"
fi
timeout ${PROFILE_TIMEOUT:-300} python3 -m qwen_triton.cli profile --out "$OUT/profile-pdl.json" \
    > "$OUT/profile-pdl.md" 2> "$OUT/profile-pdl.err"; echo "profile rc $?"
head -20 "$OUT/profile-pdl.md"
if [ -n "${NO_PDL:-}" ]; then
    timeout 200 python3 -m qwen_triton.cli profile --no-pdl --out "$OUT/profile-no-pdl.json" \
        > "$OUT/profile-no-pdl.md" 2> "$OUT/profile-no-pdl.err"; echo "profile (no PDL) rc $?"
    head -3 "$OUT/profile-no-pdl.md" | tail -1
fi
if [ -n "${BENCH_VARIANTS:-}" ]; then
    timeout ${BENCH_TIMEOUT:-200} python3 -m qwen_triton.cli bench --variants "$BENCH_VARIANTS" --out "$OUT/bench" \
        ${BENCH_ARGS:-} > "$OUT/bench.md" 2> "$OUT/bench.err"; echo "bench rc $?"
    head -8 "$OUT/bench.md"
fi
if [ -n "${OPS_BENCH:-}" ]; then
    timeout ${OPS_BENCH_TIMEOUT:-200} python3 -m qwen_triton.cli bench --ops --out "$OUT/ops" > "$OUT/ops-bench.md" \
        2> "$OUT/ops-bench.err"; echo "ops bench rc $?"
fi
# the autotuner's choices, one file (the device returns a limited number of files)
(cd "$TRITON_CACHE_DIR" 2>/dev/null && find . -name "*.autotune.json" | tar -czf "$OUT/tune.tgz" -T -)
