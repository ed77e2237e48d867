#!/usr/bin/env bash
# One device call of the twenty-first session (call 3): the profile at 4096 tokens and the six-variant bench (the
# default set) with U in bf16. (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
PROFILE=4096 BENCH_VARIANTS=transformers,reference,reference+torch.compile,triton,triton+split_k,triton+split_k+cuda_graph \
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-420} bash benchmarks/final_run.sh
