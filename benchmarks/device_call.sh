#!/usr/bin/env bash
# One device call of the twenty-second session (calls 1-2): the chunked rule's state pass in Gluon (state_pass.py):
# its GPU tests and the chunked rule's, the prefill against the Triton state pass in one process, the accuracy
# check at 128 and 4096 tokens, the profile at 4096. (Session scaffolding: results and commands go to
# docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 240 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -k "chunked or state_pass" -q --tb=short -p no:cacheprovider \
    > "$OUT/gpu-tests.log" 2>&1
grep -E "passed|failed|Error|assert" "$OUT/gpu-tests.log" | tail -12
timeout 200 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.operators.gated_delta_rule.chunk.STATE_PASS_IN_GLUON=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
tail -12 "$OUT/prefill-options.log"
timeout 90 python3 benchmarks/chunk_sweep.py --tokens 128,4096 --check-only --out "$OUT/chunk-check.json" 2>&1 | tail -6
PROFILE="4096" PROFILE_TIMEOUT=150 bash benchmarks/final_run.sh
