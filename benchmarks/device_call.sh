#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 5): the output kernel forming the scores takes BLOCK_V >= 64
# without the norm (call 4's probe: BLOCK_V 32 at 4 warps faulted): the chunked rule's GPU tests (its new every-config
# test of the scores among them) and the engine's. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 260 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -q --tb=short -p no:cacheprovider > "$OUT/chunked.log" 2>&1
grep -E "passed|failed|Error" "$OUT/chunked.log" | tail -5
ENGINE_TESTS=tests/engine/test_triton_engine.py ENGINE_TIMEOUT=200 bash benchmarks/final_run.sh
