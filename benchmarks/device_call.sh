#!/usr/bin/env bash
# One device call of the twentieth session: the output kernel beside the state pass, counts in distinct slots a
# step late: the prefill at 4096 tokens with it and without, the chunked rule's GPU tests, the profile.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=qwen_triton.operators.gated_delta_rule.chunk
timeout 160 python3 benchmarks/prefill_options.py "" "$C.OVERLAP_OUTPUT_TOKENS=1000000" \
    --tokens 4096 --rounds 4 --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
echo "po rc $?"; grep tokens "$OUT/prefill-options.log"
F=tests/operators/test_gated_delta_rule.py
timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider $F::test_gpu_chunked \
    $F::test_gpu_chunked_output_beside_the_state_pass $F::test_chunked_output_beside_the_state_pass_changes_no_bit \
    > "$OUT/chunked-tests.log" 2>&1; echo "tests rc $?"
grep -E "^FAILED|passed|failed" "$OUT/chunked-tests.log" | tail -6
timeout 120 python3 -m qwen_triton.cli profile --prefill 4096 --context 4096 --out "$OUT/profile-4096.json" \
    > "$OUT/profile-4096.md" 2>> "$OUT/err.log"; echo "profile rc $?"; grep -E "^prefill of" "$OUT/profile-4096.md"
