#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 3): kernel 3 forming the chunks' scores (chunk.SCORES_IN_OUTPUT)
# and kernel 1's parts pinned for long prompts (chunk.LONG_PROMPT_PICKS): every config of the chunked rule at 4096
# tokens, the chunked rule's GPU tests, the prefill under the settings in one process, the profile at 4096 tokens.
# (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TRITON_CACHE_DIR=/tmp/tc-sweep timeout 300 python3 benchmarks/chunk_sweep.py --tokens 4096 \
    --out "$OUT/chunk-sweep.json" > "$OUT/chunk-sweep.log" 2>&1; echo "chunk_sweep rc $?"
tail -16 "$OUT/chunk-sweep.log"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 240 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -q --tb=short -p no:cacheprovider \
    -k "every_config or scores or split or short_prompts or long_memory or chunked" > "$OUT/chunked.log" 2>&1
grep -E "passed|failed|Error" "$OUT/chunked.log" | tail -5
TRITON_CACHE_DIR=$PWD/.tc timeout 200 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.operators.gated_delta_rule.chunk.SCORES_IN_OUTPUT=False" \
    "qwen_triton.operators.gated_delta_rule.chunk.LONG_PROMPT_TOKENS=1000000" --tokens 4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -7 "$OUT/prefill-options.log"
PROFILE=4096 PROFILE_TIMEOUT=90 bash benchmarks/final_run.sh
