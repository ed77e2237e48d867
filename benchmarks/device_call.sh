#!/usr/bin/env bash
# One device call of the twenty-third session (call 3): the norms folded into the projections' weights (the
# prefill's GEMMs scale their rows by 1/rms from the sums of squares the residual adds leave), the squares
# epilogue's constexpr mended (call 2: it did not compile): the linear and norm operators' GPU tests, the engine's
# GPU tests, the profile at 4096 tokens, then the prefill with and without the folding in one process.
# (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 150 python3 -m pytest -m gpu \
    tests/operators/test_linear.py tests/operators/test_norm.py -q --tb=short -p no:cacheprovider \
    -k "folded or squares or prefill_projections or inplace or rms_norm" > "$OUT/linear.log" 2>&1
grep -E "passed|failed|Error" "$OUT/linear.log" | tail -5
ENGINE_TESTS=tests/engine ENGINE_TIMEOUT=160 PROFILE=4096 PROFILE_TIMEOUT=110 bash benchmarks/final_run.sh
TRITON_CACHE_DIR=$PWD/.tc timeout 150 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.FOLD_NORMS=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -12 "$OUT/prefill-options.log"
