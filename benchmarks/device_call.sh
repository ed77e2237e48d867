#!/usr/bin/env bash
# One device call of the twenty-second session (call 5): the final code (the Gluon state pass; kernel 3 after it;
# chunks of 64 from 1025 tokens): the engine's GPU tests, the profile at 4096 tokens, the six-variant bench.
# (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
ENGINE_TESTS="tests/engine" ENGINE_TIMEOUT=170 PROFILE="4096" PROFILE_TIMEOUT=120 BENCH_TIMEOUT=330 \
    BENCH_VARIANTS="transformers,reference,reference+torch.compile,triton,triton+split_k,triton+split_k+cuda_graph" \
    bash benchmarks/final_run.sh
