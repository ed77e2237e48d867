#!/usr/bin/env bash
# One device call of the twenty-third session (call 5): the final code (c2151d9's kernels): the engine's GPU tests
# and the profile at 4096 tokens. (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
ENGINE_TESTS=tests/engine ENGINE_TIMEOUT=170 PROFILE=4096 PROFILE_TIMEOUT=120 bash benchmarks/final_run.sh
