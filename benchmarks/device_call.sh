#!/usr/bin/env bash
# One device call of the twentieth session: why the output kernel beside the state pass gained nothing: the prefill
# at 4096 tokens with it, with its kernels one after the other (no PDL), without it; the profile with it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
C=qwen_triton.operators.gated_delta_rule.chunk
timeout 200 python3 benchmarks/prefill_options.py "" "$C.OVERLAP_PDL=False" "$C.OVERLAP_OUTPUT_TOKENS=1000000" \
    --tokens 4096 --rounds 3 --out "$OUT/prefill-options.json" > "$OUT/prefill-options.log" 2>&1
echo "po rc $?"; grep tokens "$OUT/prefill-options.log"
timeout 150 python3 -m qwen_triton.cli profile --prefill 4096 --context 4096 --out "$OUT/profile-4096.json" \
    > "$OUT/profile-4096.md" 2>> "$OUT/err.log"; echo "profile rc $?"; grep -E "^prefill of" "$OUT/profile-4096.md"
grep -E "chunk_|gated delta" "$OUT/profile-4096.md" | head -12
