#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests of every kernel and of the engine, then a decode timing.
# Usage on the device: bash benchmarks/device_check.sh   (writes logs under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu tests/operators -q -rfE -p no:cacheprovider --timeout=240 ${OPS_TESTS:-} 2>&1 \
    | tee "$OUT/ops.log" | tail -40
python3 -m pytest -m gpu tests/engine -q -rfE -s -p no:cacheprovider --timeout=400 ${ENGINE_TESTS:-} 2>&1 \
    | tee "$OUT/engine.log" | tail -40
