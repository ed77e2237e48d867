#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests of the kernels and of the engine (with QWEN_TRITON_AUTOTUNE=first:
# correctness needs no tuning), each file with its own log under $OUT. Select with OPS_TESTS / ENGINE_TESTS.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=$PWD/.triton-cache-first timeout ${OPS_TIMEOUT:-300} \
    python3 -m pytest -m gpu ${OPS_TESTS:-tests/operators} -q --tb=short -p no:cacheprovider 2>&1 \
    | tee "$OUT/ops.log" | grep -E "passed|failed|Error|error|assert" | tail -30
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=$PWD/.triton-cache-first timeout ${ENGINE_TIMEOUT:-300} \
    python3 -m pytest -m gpu ${ENGINE_TESTS:-tests/engine} -q -s --tb=short -p no:cacheprovider 2>&1 \
    | tee "$OUT/engine.log" | grep -E "passed|failed|Error|error|assert|bf16 vs" | tail -30
