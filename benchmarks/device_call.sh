#!/usr/bin/env bash
# One device call of the twenty-second session (call 4): kernel 3 beside the Gluon state pass (chunk flags, PDL) and
# chunks of 64 from 1025 tokens: the chunked rule's GPU tests; prefill_options.py in one process. (Session
# scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 200 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -k "chunked or state_pass or beside" -q --tb=short -p no:cacheprovider \
    > "$OUT/gpu-tests.log" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/gpu-tests.log" | tail -12
M=qwen_triton.operators.gated_delta_rule.chunk
timeout 290 python3 benchmarks/prefill_options.py "" "$M.OUTPUT_BESIDE_STATE_PASS=False" "$M.SHORT_CHUNK_TOKENS=512" \
    --tokens 128,1024,4096 --rounds 2 --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
tail -20 "$OUT/prefill-options.log"
