#!/usr/bin/env bash
# One device call of the twenty-third session (call 2): the norms folded into the projections' weights (the
# prefill's GEMMs scale their rows by 1/rms from the sums of squares the residual adds leave): the linear and
# norm operators' GPU tests, the chunked rule's Gluon state pass and chunked tests (the two review commits of
# the twenty-second session, 707a8f0 and 79b89ae, not yet run on the GPU), the engine's GPU tests, then the
# prefill with and without the folding in one process. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 150 python3 -m pytest -m gpu \
    tests/operators/test_linear.py tests/operators/test_norm.py -q --tb=short -p no:cacheprovider \
    -k "folded or squares or prefill_projections or inplace or rms_norm" > "$OUT/linear.log" 2>&1
grep -E "passed|failed|Error" "$OUT/linear.log" | tail -5
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 110 python3 -m pytest -m gpu \
    tests/operators/test_gated_delta_rule.py -q --tb=short -p no:cacheprovider \
    -k "gluon or long_memory or (gpu_chunked and not every_config)" > "$OUT/chunked.log" 2>&1
grep -E "passed|failed|Error" "$OUT/chunked.log" | tail -5
ENGINE_TESTS=tests/engine ENGINE_TIMEOUT=160 bash benchmarks/final_run.sh
TRITON_CACHE_DIR=$PWD/.tc timeout 150 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.FOLD_NORMS=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -12 "$OUT/prefill-options.log"
