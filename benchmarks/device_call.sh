#!/usr/bin/env bash
# One device call of the twenty-second session (call 3): the Gluon state pass with the state in two halves, and the
# chunk size at 2048 and 4096 tokens now that the state pass is faster: prefill_options.py in one process; the
# halves' accuracy (chunk_sweep.py --check-only). (Session scaffolding: results and commands go to
# docs/perf-notes.md.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
M=qwen_triton.operators.gated_delta_rule
timeout 60 python3 benchmarks/chunk_sweep.py --tokens 4096 --check-only --setting "$M.state_pass.STATE_IN_HALVES=True" \
    --out "$OUT/chunk-check-halves.json" 2>&1 | tail -4
timeout 330 python3 benchmarks/prefill_options.py "" "$M.state_pass.STATE_IN_HALVES=True" \
    "$M.chunk.SHORT_CHUNK_TOKENS=4096" "$M.chunk.SHORT_CHUNK_TOKENS=1024" --tokens 2048,4096 --rounds 2 \
    --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
tail -18 "$OUT/prefill-options.log"
