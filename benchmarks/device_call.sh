#!/usr/bin/env bash
# One device call of the twenty-third session (call 1): the six-variant bench at 79b89ae (the code the
# twenty-second session ended with), alone, with the time its torch.compile warm-up needs.
# (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
BENCH_TIMEOUT=575 \
    BENCH_VARIANTS="transformers,reference,reference+torch.compile,triton,triton+split_k,triton+split_k+cuda_graph" \
    bash benchmarks/final_run.sh
