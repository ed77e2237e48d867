#!/usr/bin/env bash
# One device call of the twentieth session: the output kernel beside the state pass: the chunked rule's GPU and
# device-agnostic tests, then the prefill with it and without. (Session scaffolding.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q --tb=short -p no:cacheprovider tests/operators/test_gated_delta_rule.py \
    -k "chunked" > "$OUT/chunked-tests.log" 2>&1; echo "tests rc $?"; grep -E "^FAILED|passed|failed" "$OUT/chunked-tests.log" | tail -6
C=qwen_triton.operators.gated_delta_rule.chunk
timeout ${PO_TIMEOUT:-280} python3 benchmarks/prefill_options.py "" "$C.OVERLAP_OUTPUT_TOKENS=1000000" \
    "$C.OUTPUT_PROGRAMS_PER_SM=1" "$C.OVERLAP_OUTPUT_TOKENS=513" \
    --tokens ${T:-1024,4096} --rounds ${ROUNDS:-3} --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
echo "po rc $?"; grep tokens "$OUT/prefill-options.log"; grep -iE "error" "$OUT/prefill-options.log" | head -3
