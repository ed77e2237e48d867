#!/usr/bin/env bash
# One device call of the twenty-first session (call 4): the engine's GPU tests with U in bf16 in the chunked rule's
# scratch. (Session scaffolding: results and commands go to docs/perf-notes.md.)
set -uo pipefail
ENGINE_TESTS="tests/engine" ENGINE_TIMEOUT=${ENGINE_TIMEOUT:-420} bash benchmarks/final_run.sh
