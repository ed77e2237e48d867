#!/usr/bin/env bash
# The twentieth session's last device call: the chunked rule's tests (GPU and device-agnostic) on the shipped
# kernels, the spot where both modified state passes faulted (their tuning at 4096 tokens).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 330 python3 -m pytest -q --tb=short -p no:cacheprovider tests/operators/test_gated_delta_rule.py -k chunked \
    > "$OUT/chunked-tests.log" 2>&1; echo "tests rc $?"; grep -E "^FAILED|passed|failed" "$OUT/chunked-tests.log" | tail -6
