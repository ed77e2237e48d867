#!/usr/bin/env bash
# One GPU call: the engine's bench (`qwen-triton bench --variants triton+split_k+cuda_graph`) at an earlier commit
# and at this tree, back to back on the same machine, so that a refactor's cost is measured against the same
# ceilings. Prepare the earlier tree here first (the device's copy has no git history):
#   mkdir -p .session/before && git archive BEFORE | tar -x -C .session/before --exclude=benchmarks/results
# then run with carry [".session"] (and ".whl" where the machine lacks a package):
#   BEFORE=7df2d25 AFTER=$(git rev-parse --short HEAD) bash benchmarks/before_after.sh
# Writes $OUT/before.md, $OUT/after.md and results.tgz (both trees' latest.json). BENCH_TIMEOUT: seconds a bench.
set -uo pipefail
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
bench() {  # name, tree, commit
    (cd "$2" && PYTHONPATH=/tmp/site:$2 QWEN_TRITON_COMMIT=$3 TRITON_CACHE_DIR=/tmp/tc-$1 timeout ${BENCH_TIMEOUT:-220} \
        python3 -m qwen_triton.cli bench --variants triton+split_k+cuda_graph --out "$OUT/$1" > "$OUT/$1.md" 2> "$OUT/$1.err")
    echo "$1 rc $?"; grep -E "^\| triton" "$OUT/$1.md"
}
bench before "$ROOT/.session/before" "${BEFORE:?name the earlier commit}"
bench after "$ROOT" "${AFTER:-after}"
(cd "$OUT" && tar -czf results.tgz before after before.err after.err && rm -rf before after before.err after.err)
