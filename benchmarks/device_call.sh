#!/usr/bin/env bash
# One device call of the twentieth session: the conv epilogue's GPU tests, the prefill under the new options, the
# U-in-bf16 accuracy check. (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider \
    tests/operators/test_linear.py -k conv > "$OUT/ops.log" 2>&1; tail -3 "$OUT/ops.log"
T=${T:-512,1024,4096}
timeout ${PO_TIMEOUT:-300} python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.CONV_IN_PROJECTION_TOKENS=1000000" \
    "qwen_triton.engine.triton_model.CONV_IN_PROJECTION_TOKENS=257" \
    "qwen_triton.operators.gated_delta_rule.chunk.U_IN_DOT_DTYPE=True" \
    --tokens $T --rounds 3 --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "po rc $?"
cat "$OUT/prefill-options.log" | tail -30
timeout 60 python3 benchmarks/chunk_sweep.py --tokens 4096 --check-only \
    --setting "qwen_triton.operators.gated_delta_rule.chunk.U_IN_DOT_DTYPE=True" --out "$OUT/u-check.json" \
    > "$OUT/u-check.log" 2>&1; tail -4 "$OUT/u-check.log"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout ${ENGINE_TIMEOUT:-120} python3 -m pytest -m gpu -q --tb=short \
    -p no:cacheprovider tests/engine/test_triton_engine.py -k conv_in_the_in_projection > "$OUT/engine.log" 2>&1
tail -3 "$OUT/engine.log"
