#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 2): register-capped configs (maxnreg) for the chunked rule's
# inverse and products kernels: every config of the chunked rule timed at 4096 tokens (chunk_sweep.py) and the
# every-config GPU test. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
TRITON_CACHE_DIR=/tmp/tc-sweep timeout 360 python3 benchmarks/chunk_sweep.py --tokens 4096 \
    --out "$OUT/chunk-sweep.json" > "$OUT/chunk-sweep.log" 2>&1; echo "chunk_sweep rc $?"
tail -40 "$OUT/chunk-sweep.log"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 200 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -q --tb=short -p no:cacheprovider -k "every_config" \
    > "$OUT/chunked.log" 2>&1
grep -E "passed|failed|Error" "$OUT/chunked.log" | tail -5
