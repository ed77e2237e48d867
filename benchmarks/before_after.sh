#!/usr/bin/env bash
# One GPU call: the engine's bench (`qwen-triton bench --variants triton+split_k+cuda_graph`) at an earlier commit
# and at this tree, back to back on the same machine, so that a refactor's cost is measured against the same
# ceilings. Prepare the earlier tree here first (the device's copy has no git history):
#   mkdir -p .session/before && git archive BEFORE | tar -x -C .session/before --exclude=benchmarks/results
# then run with carry [".session"] (and ".whl" where the machine lacks a package):
#   BEFORE=7df2d25 AFTER=$(git rev-parse --short HEAD) bash benchmarks/before_after.sh
# Writes $OUT/before.md, $OUT/after.md and results.tgz (both trees' latest.json). BENCH_TIMEOUT: seconds a bench.
# COMMAND: run this instead of the bench in each tree (its output to $OUT/before.md and after.md), e.g.
#   COMMAND='python3 benchmarks/batched_decode.py "" --batches 1,2,16 --rounds 1'
set -uo pipefail
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
bench() {  # name, tree, commit
    local command="python3 -m qwen_triton.cli bench --variants triton+split_k+cuda_graph --out $OUT/$1"
    (cd "$2" && PYTHONPATH=/tmp/site:$2 QWEN_TRITON_COMMIT=$3 TRITON_CACHE_DIR=/tmp/tc-$1 timeout ${BENCH_TIMEOUT:-220} \
        bash -c "${COMMAND:-$command}" > "$OUT/$1.md" 2> "$OUT/$1.err")
    echo "$1 rc $?"; if [ -n "${COMMAND:-}" ]; then cat "$OUT/$1.md"; else grep -E "^\| triton" "$OUT/$1.md"; fi
}
bench before "$ROOT/.session/before" "${BEFORE:?name the earlier commit}"
bench after "$ROOT" "${AFTER:-after}"
(cd "$OUT" && tar -czf results.tgz $(ls -d before after before.err after.err 2>/dev/null) && rm -rf before after before.err after.err)
