#!/usr/bin/env bash
# The twentieth session's last device call: the chunked rule's GPU tests with float32 operands untuned (the fix of
# the fault in their tuning at 4096 tokens), then which config faults (benchmarks/fault_probe.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/operators/test_gated_delta_rule.py \
    -k chunked > "$OUT/chunked-gpu-tests.log" 2>&1; echo "tests rc $?"
grep -E "^FAILED|passed|failed" "$OUT/chunked-gpu-tests.log" | tail -6
timeout 110 python3 benchmarks/fault_probe.py --float32-configs > "$OUT/fault-probe.log" 2>&1; echo "probe rc $?"
cat "$OUT/fault-probe.log"
