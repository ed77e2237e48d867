#!/usr/bin/env bash
# One device call of the twentieth session: U in bf16 (chunk.U_IN_DOT_DTYPE, now the default): the chunked rule's
# GPU and device-agnostic tests, the prefill against U in float32, the accuracy check. (Session scaffolding.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout ${PO_TIMEOUT:-240} python3 benchmarks/prefill_options.py "" \
    "qwen_triton.operators.gated_delta_rule.chunk.U_IN_DOT_DTYPE=False" \
    --tokens ${T:-1024,4096} --rounds ${ROUNDS:-5} --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
echo "po rc $?"; grep tokens "$OUT/prefill-options.log"
timeout 90 python3 benchmarks/chunk_sweep.py --tokens 128,4096 --check-only --out "$OUT/u-check.json" \
    > "$OUT/u-check.log" 2>&1; grep -E "check|T=" "$OUT/u-check.log"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q --tb=short -p no:cacheprovider tests/operators/test_gated_delta_rule.py \
    -k chunked > "$OUT/chunked-tests.log" 2>&1; tail -3 "$OUT/chunked-tests.log"
