#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 1): the folded norm's sums of squares loaded before the GEMM's
# main loop and reduced after it; the attention output gate in the flash attention's epilogue (GATE_IN_ATTENTION).
# The changed operators' GPU tests, the engine's, the prefill with and without the gate in the attention in one
# process, the profile at 4096 tokens. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 120 python3 -m pytest -m gpu \
    tests/operators/test_linear.py tests/operators/test_attention.py -q --tb=short -p no:cacheprovider \
    -k "folded or squares or prefill" > "$OUT/ops.log" 2>&1
grep -E "passed|failed|Error" "$OUT/ops.log" | tail -5
TRITON_CACHE_DIR=$PWD/.tc timeout 120 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.GATE_IN_ATTENTION=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -9 "$OUT/prefill-options.log"
PROFILE=4096 PROFILE_TIMEOUT=90 ENGINE_TESTS=tests/engine/test_triton_engine.py ENGINE_TIMEOUT=240 \
    bash benchmarks/final_run.sh
