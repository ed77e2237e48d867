#!/usr/bin/env bash
# One device call of the twenty-fourth session (call 4): call 3's chunked GPU tests failed where the output kernel
# forms the scores (a wrong output at 4096 tokens with the first configs, an illegal address in the every-config
# test at chunks of 64): which output configs form them correctly (benchmarks/scores_probe.py).
# (Session scaffolding: results go to docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TRITON_CACHE_DIR=/tmp/tc-probe timeout 400 python3 benchmarks/scores_probe.py --out "$OUT/scores-probe.json" \
    > "$OUT/scores-probe.log" 2>&1; echo "scores_probe rc $?"
cat "$OUT/scores-probe.log" | tail -30
