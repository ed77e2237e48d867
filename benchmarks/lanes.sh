#!/usr/bin/env bash
# Commands side by side, one per GPU: LANE0, LANE1, ... (bash command lines, usually
# `... bash benchmarks/final_run.sh` with that lane's steps), each run with CUDA_VISIBLE_DEVICES=<n>,
# OUT=$OUT/lane<n> and its own Triton cache (CACHE=/tmp/tc-lane<n>). What the lanes print goes to
# $OUT/summary.txt; everything they write into $OUT/lanes.tgz (few files come back from the device).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
started=$(date +%s)
for n in 0 1 2 3 4 5 6 7; do
    lane=LANE$n
    [ -n "${!lane:-}" ] || continue
    mkdir -p "$OUT/lane$n"
    (
        export CUDA_VISIBLE_DEVICES=$n OUT=$OUT/lane$n CACHE=/tmp/tc-lane$n
        eval "${!lane}"
        echo "lane $n done after $(( $(date +%s) - started )) s"
    ) > "$OUT/lane$n.txt" 2>&1 &
done
wait
for log in "$OUT"/lane*.txt; do echo "=== $(basename "$log" .txt)"; cat "$log"; done > "$OUT/summary.txt"
cat "$OUT/summary.txt"
(cd "$OUT" && tar -czf lanes.tgz lane[0-9]* && rm -rf lane[0-9]*)
