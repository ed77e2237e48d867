#!/usr/bin/env bash
# One device call of the twenty-first session: U in bf16 in the chunked rule's scratch (the one-product state
# step measured slower in call 1, removed): the chunked rule's GPU tests, the accuracy checks, the engine's
# accuracy test. (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_TIMEOUT:-220} python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider \
    tests/operators/test_gated_delta_rule.py -k chunked > "$OUT/chunked-tests.log" 2>&1; tail -3 "$OUT/chunked-tests.log"
timeout ${CHECK_TIMEOUT:-90} python3 benchmarks/chunk_sweep.py --tokens 128,4096 --check-only --out "$OUT/check.json" \
    > "$OUT/check.log" 2>&1; echo "check rc $?"; grep -E "check|T=" "$OUT/check.log" | tail -8
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout ${ENGINE_TIMEOUT:-200} python3 -m pytest -m gpu -q -s \
    --tb=short -p no:cacheprovider tests/engine/test_triton_engine.py -k bf16_logits > "$OUT/engine.log" 2>&1
grep -E "passed|failed|bf16 vs|Error" "$OUT/engine.log" | tail -6
