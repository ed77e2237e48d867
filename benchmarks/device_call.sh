#!/usr/bin/env bash
# One device call of the twenty-third session (call 4): the folded norm's epilogues made cheaper (call 3's profile:
# the GEMMs slower with them): the rows' 1/rms loaded before the main loop, the sums of squares stored as [BLOCK_M]
# vectors. The linear and norm operators' GPU tests, the prefill with and without the folding in one process, then
# the six-variant bench. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 100 python3 -m pytest -m gpu \
    tests/operators/test_linear.py tests/operators/test_norm.py -q --tb=short -p no:cacheprovider \
    -k "folded or squares or prefill_projections or inplace or rms_norm" > "$OUT/linear.log" 2>&1
grep -E "passed|failed|Error" "$OUT/linear.log" | tail -5
TRITON_CACHE_DIR=$PWD/.tc timeout 130 python3 benchmarks/prefill_options.py "" \
    "qwen_triton.engine.triton_model.FOLD_NORMS=False" --tokens 128,4096 --rounds 3 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1; echo "prefill_options rc $?"
tail -9 "$OUT/prefill-options.log"
BENCH_TIMEOUT=400 \
    BENCH_VARIANTS="transformers,reference,reference+torch.compile,triton,triton+split_k,triton+split_k+cuda_graph" \
    bash benchmarks/final_run.sh
