#!/usr/bin/env bash
# One device call of the twenty-third session (call 6): the squares epilogue as one [BLOCK_M, BLOCK_N / 32] store
# (benchmarks/gemm_epilogue_sass.py: 36 shared-memory stores instead of 198 in the 128 x 256 tile, fewer spills):
# the folded norm's GPU tests, the prefill with and without the folding in one process, the profile at 4096 tokens.
# (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 60 python3 -m pytest -m gpu \
    tests/operators/test_linear.py -q --tb=short -p no:cacheprovider -k "folded or squares" > "$OUT/linear.log" 2>&1
grep -E "passed|failed|Error" "$OUT/linear.log" | tail -5
TRITON_CACHE_DIR=$PWD/.tc timeout 100 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.FOLD_NORMS=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -9 "$OUT/prefill-options.log"
PROFILE=4096 PROFILE_TIMEOUT=80 bash benchmarks/final_run.sh
