#!/usr/bin/env bash
# One device call of the twenty-first session: the state pass's one-product step and U in bf16 (now the
# defaults): the prefill against the two-product step, the chunked rule's GPU tests, the accuracy checks.
# (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
C=qwen_triton.operators.gated_delta_rule.chunk
timeout ${PO_TIMEOUT:-230} python3 benchmarks/prefill_options.py "" "$C.STATE_STEP_ONE_PRODUCT=False" \
    --tokens ${T:-128,4096} --rounds ${ROUNDS:-3} --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
echo "po rc $?"; grep -E "tokens|replay|bench" "$OUT/prefill-options.log" | tail -12
timeout ${CHECK_TIMEOUT:-80} python3 benchmarks/chunk_sweep.py --tokens 128,4096 --check-only --out "$OUT/check.json" \
    > "$OUT/check.log" 2>&1; echo "check rc $?"; grep -E "check|T=" "$OUT/check.log" | tail -8
timeout ${TEST_TIMEOUT:-200} python3 -m pytest -m gpu -q --tb=short -p no:cacheprovider \
    tests/operators/test_gated_delta_rule.py -k chunked > "$OUT/chunked-tests.log" 2>&1; tail -3 "$OUT/chunked-tests.log"
