"""`qwen-triton bench --ops`: every operator at the real 0.8B shapes, against the ceilings of the same run.

Each operator package exports `benchmark_cases()`: dicts of name, fn (one call of the kernel on
prebuilt inputs, which it builds and autotunes on its first call), and the bytes and FLOPs of its floor.

Timing: 20 calls back to back in one CUDA graph, replayed 20 times (median per call), so the number is the
GPU's, without the host's launch cost (an operator that cannot be captured is timed call by call with
CUDA events, and marked). The calls reuse their inputs, so an operator whose bytes fit in the 60 MB L2
(the decode GEMVs: 4-21 MB) reads them from the cache after the first call and can exceed the HBM
bandwidth here; the in-model numbers, with every weight read from HBM, are `qwen-triton profile`'s.
"""

from __future__ import annotations

import importlib

from .harness import log, measure_hbm_bandwidth, measure_matmul_rate, time_calls, time_graph

PACKAGES = ("embedding", "linear", "norm", "attention", "conv", "gated_delta_rule", "lm_head", "sampling")


def run_operator_benchmark(steps: int = 100) -> dict:
    hbm = measure_hbm_bandwidth()
    matmul = measure_matmul_rate()
    rows = []
    for package in PACKAGES:
        module = importlib.import_module(f"qwen_triton.operators.{package}")
        for case in module.benchmark_cases():
            case["fn"]()  # build, compile, autotune
            timing = "cuda graph"
            try:
                ms = time_graph(case["fn"])
            except RuntimeError as error:  # not capturable: per call, host launch included
                log(f"{package}/{case['name']}: not capturable ({error}); timed call by call")
                ms, timing = time_calls(case["fn"], steps=steps, warmup=5), "per call"
            seconds = ms * 1e-3
            bandwidth = case["bytes"] / seconds / 1e12 if case.get("bytes") else 0.0
            rate = case["flops"] / seconds / 1e12 if case.get("flops") else 0.0
            rows.append(dict(operator=package, case=case["name"], timing=timing, us=ms * 1e3, bytes=case.get("bytes"),
                             flops=case.get("flops"), TBps=bandwidth, TFLOPs=rate,
                             pct_hbm=100 * bandwidth / hbm, pct_matmul=100 * rate / matmul))
            log(f"{package}/{case['name']}: {ms * 1e3:.1f} us")
    return dict(hbm_copy_TBps=hbm, matmul_TFLOPs=matmul, rows=rows)


def format_operator_table(report: dict) -> str:
    lines = [f"HBM copy {report['hbm_copy_TBps']:.2f} TB/s, bf16 matmul {report['matmul_TFLOPs']:.0f} TFLOP/s", "",
             "| operator | case | time (us) | TB/s | % of HBM | TFLOP/s | % of matmul |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        mark = "" if r.get("timing", "cuda graph") == "cuda graph" else " (per call)"
        lines.append(f"| {r['operator']} | {r['case']}{mark} | {r['us']:.1f} | {r['TBps']:.2f} | {r['pct_hbm']:.0f}% | "
                     f"{r['TFLOPs']:.1f} | {r['pct_matmul']:.0f}% |")
    return "\n".join(lines)
