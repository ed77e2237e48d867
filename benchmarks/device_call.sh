#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 6): the six-variant bench at this code, then the chunked rule's
# GPU tests of what changed (call 5's every-config test of the scores faulted: a single config is not pruned, so its
# BLOCK_V 32 ran; BLOCK_V 32 now gone from the output kernel's configs). (Session scaffolding: results go to
# docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BENCH_VARIANTS="transformers,reference,reference+torch.compile,triton,triton+split_k,triton+split_k+cuda_graph" \
    BENCH_TIMEOUT=390 bash benchmarks/final_run.sh
QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout 75 python3 -m pytest -m gpu -x \
    tests/operators/test_gated_delta_rule.py -q --tb=short -p no:cacheprovider \
    -k "scores_in_output or every_config" > "$OUT/chunked.log" 2>&1
grep -E "passed|failed|Error" "$OUT/chunked.log" | tail -5
