#!/usr/bin/env bash
# One call on the GPU machine: the engine's and the changed operators' GPU tests (untuned kernels: correctness
# needs no tuning), the profile, fully tuned tests (TUNING_CACHE=$PWD/.tc shares the profile's tunings), then
# `qwen-triton bench` over $BENCH_VARIANTS (BENCH_ARGS: e.g. --workloads decode,sampling); GEMM_SWEEP: the GEMM's
# configs at those row counts; DECODE_GEMM_SWEEP: the decode GEMM's (decode_gemm_sweep.py). Few files under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD
OUT=${OUT:-/tmp/out}
CACHE=${CACHE:-$PWD/.tc}  # the Triton cache (compiled kernels, autotuning) of the bench, profile and tuned tests
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
if [ -n "${ENGINE_TESTS:-}" ]; then
    QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout ${ENGINE_TIMEOUT:-300} python3 -m pytest -m gpu \
        $ENGINE_TESTS -q -s --tb=short -p no:cacheprovider > "$OUT/engine.log" 2>&1
    grep -E "passed|failed|bf16 vs|Error" "$OUT/engine.log" | tail -8
fi
if [ -n "${OPS_TESTS:-}" ]; then
    QWEN_TRITON_AUTOTUNE=first TRITON_CACHE_DIR=/tmp/tc-first timeout ${OPS_TIMEOUT:-200} python3 -m pytest -m gpu \
        $OPS_TESTS -q --tb=short -p no:cacheprovider > "$OUT/ops.log" 2>&1
    grep -E "passed|failed|Error" "$OUT/ops.log" | tail -5
fi
# PROFILE: "1" profiles a decode step at context 128 and a 128-token prefill (profile.json, .md); a length N
# profiles each at that context and prefill length (profile-N.json, .md); rN a decode step of N rows (profile-rN);
# pN the packed prefill of N prompts of 128 tokens (profile-pN); sN a decode step of N rows sampling with Qwen's
# settings (temperature 0.7, top-p 0.8, top-k 20), qN the same with presence penalty 1.5. PROFILE_PRESET: the
# model shape (default 0.8b; another's files are named profile-PRESET*)
if [ -n "${PROFILE:-}" ]; then  # tuned kernels (their picks at the report's end; tuning times in err.log)
    preset=${PROFILE_PRESET:-0.8b}
    for n in $PROFILE; do
        case $n in
            1) args=""; name=profile ;;
            r*) args="--rows ${n#r}"; name=profile-$n ;;
            p*) args="--prompts ${n#p}"; name=profile-$n ;;
            s*) args="--rows ${n#s} --temperature 0.7 --top-p 0.8 --top-k 20"; name=profile-$n ;;
            q*) args="--rows ${n#q} --temperature 0.7 --top-p 0.8 --top-k 20 --presence-penalty 1.5"; name=profile-$n ;;
            *) args="--prefill $n --context $n"; name=profile-$n ;;
        esac
        [ "$preset" = 0.8b ] || name=${name/profile/profile-$preset}
        TRITON_PRINT_AUTOTUNING=1 TRITON_CACHE_DIR=$CACHE timeout ${PROFILE_TIMEOUT:-200} python3 -m qwen_triton.cli \
            profile --preset $preset $args --out "$OUT/$name.json" > "$OUT/$name.md" 2>> "$OUT/err.log"; echo "$name rc $?"
        grep -E "^(decode step|prefill of)" "$OUT/$name.md"
    done
fi
if [ -n "${TUNING_TESTS:-}" ]; then  # full autotuning, every config's choice printed
    QWEN_TRITON_AUTOTUNE= TRITON_PRINT_AUTOTUNING=1 TRITON_CACHE_DIR=${TUNING_CACHE:-/tmp/tc-tuning} timeout ${TUNING_TIMEOUT:-300} \
        python3 -m pytest -m gpu $TUNING_TESTS -q -s --tb=short -p no:cacheprovider > "$OUT/tuning.log" 2>&1
    grep -E "passed|failed|Error" "$OUT/tuning.log" | tail -5
fi
if [ -n "${GEMM_SWEEP:-}" ]; then  # every GEMM config at these row counts (e.g. the decode buckets), pointer loads
    TRITON_CACHE_DIR=$CACHE timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/gemm_sweep.py --tokens "$GEMM_SWEEP" \
        --loads pointer --out "$OUT/gemm-sweep.json" > "$OUT/gemm-sweep.md" 2>> "$OUT/err.log"; echo "sweep rc $?"
    cat "$OUT/gemm-sweep.md"
fi
if [ -n "${DECODE_GEMM_SWEEP:-}" ]; then  # the decode GEMM's configs (h200.py's decode picks): "ROWS" at the 0.8B or
    for sweep in $DECODE_GEMM_SWEEP; do  # "PRESET:ROWS" each, e.g. "16,64,128 4b:1,16": decode-gemm[-PRESET].json/.md
        case $sweep in *:*) preset=${sweep%%:*}; rows=${sweep#*:}; name=decode-gemm-$preset ;;
                       *) preset=0.8b; rows=$sweep; name=decode-gemm ;; esac
        for i in 0 1 2 3 4 5 6 7; do  # compile a share each, in parallel, into the cache the timing run reads
            TRITON_CACHE_DIR=$CACHE timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/decode_gemm_sweep.py \
                --preset $preset --rows "$rows" --compile-part $i/8 > /dev/null 2>> "$OUT/err.log" &
        done
        wait
        TRITON_CACHE_DIR=$CACHE timeout ${SWEEP_TIMEOUT:-240} python3 benchmarks/decode_gemm_sweep.py --preset $preset \
            --rows "$rows" --out "$OUT/$name.json" > "$OUT/$name.md" 2>> "$OUT/err.log"; echo "decode sweep $preset rc $?"
        grep -E "K=" "$OUT/$name.md"
    done
fi
if [ -n "${BENCH_VARIANTS:-}" ]; then
    TRITON_CACHE_DIR=$CACHE timeout ${BENCH_TIMEOUT:-300} python3 -m qwen_triton.cli bench --variants "$BENCH_VARIANTS" \
        --out "$OUT/bench" ${BENCH_ARGS:-} > "$OUT/bench.md" 2>> "$OUT/err.log"; echo "bench rc $?"
    cat "$OUT/bench.md"; tail -3 "$OUT/err.log"
    tar -czf "$OUT/bench.tgz" -C "$OUT" bench && rm -rf "$OUT/bench"
fi
if [ -n "${FAMILY:-}" ]; then  # the family sizes (e.g. "4b 9b 27b"): decode @128 and a 4096-token prefill, 20 steps
    for preset in $FAMILY; do  # (BENCHMARKS.md's family table): family-P.json; FAMILY_PROFILE: each size's step profiled
        TRITON_CACHE_DIR=$CACHE timeout ${FAMILY_TIMEOUT:-170} python3 -m qwen_triton.cli bench --preset $preset \
            --variants triton+split_k+cuda_graph --prefill 4096 --contexts 128 --quick --out "/tmp/family-$preset" \
            > "$OUT/family-$preset.md" 2>> "$OUT/err.log"; echo "family $preset rc $?"
        grep -E "^\| triton" "$OUT/family-$preset.md"; cp "/tmp/family-$preset/latest.json" "$OUT/family-$preset.json"
        if [ -n "${FAMILY_PROFILE:-}" ]; then
            TRITON_CACHE_DIR=$CACHE timeout ${PROFILE_TIMEOUT:-200} python3 -m qwen_triton.cli profile --preset $preset \
                --prefill 16 --out "$OUT/profile-$preset.json" > "$OUT/profile-$preset.md" 2>> "$OUT/err.log"
            echo "profile $preset rc $?"; grep -E "^decode step" "$OUT/profile-$preset.md"
        fi
    done
fi
if [ -n "${TUNED_TESTS:-}" ]; then  # the kernels with the configs the bench tuned (its cache)
    TRITON_CACHE_DIR=$CACHE timeout ${TUNED_TIMEOUT:-150} python3 -m pytest -m gpu $TUNED_TESTS -q -s --tb=short \
        -p no:cacheprovider > "$OUT/tuned.log" 2>&1
    grep -E "passed|failed|bf16 vs|Error" "$OUT/tuned.log" | tail -5
fi
if [ -n "${OPS_BENCH:-}" ]; then
    TRITON_CACHE_DIR=$CACHE timeout ${OPS_BENCH_TIMEOUT:-120} python3 -m qwen_triton.cli bench --ops --out "$OUT" \
        > "$OUT/ops-bench.md" 2>> "$OUT/err.log"; echo "ops bench rc $?"
fi
if [ -n "${PROBE:-}" ]; then  # a lone request's first token through the server, stage by stage (PROBE: lengths)
    TRITON_CACHE_DIR=$CACHE timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/first_token_probe.py --engine process \
        --lengths "$PROBE" --requests 12 > "$OUT/probe.md" 2>> "$OUT/err.log"; echo "probe rc $?"
    cat "$OUT/probe.md"
fi
