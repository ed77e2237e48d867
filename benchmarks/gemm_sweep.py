"""Every config of the prefill GEMM, timed as a prefill runs them, next to cuBLAS and a bare tiled matmul.

For each projection of Qwen3.5-0.8B at M tokens: a CUDA graph of `copies` launches on as many distinct
weights (more bytes than the 60 MB L2 at small M, so weights come from HBM as in the model), replayed;
the time per launch of
- `cublas`: torch.matmul(x, W.T) alone (no norm, gate, activation or residual: a lower bound the fusions
  must approach);
- `tuned`: the GEMM launcher (`gemm.gemm`) as `linear()` calls it, with the autotuner's pick;
- every config of the GEMM's search space (pruned as the autotuner prunes it);
- `bare`: a tiled matmul with no fusions, no split and no masks on K (Triton's tutorial form) at each
  config's tiles: what the fused kernel's structure costs;
- `tma tuned`, `tma config`: the same kernel with its tiles loaded through tensor descriptors (gemm.py's
  TMA path, `gemm(tma=True)`), the autotuner's pick and each of its configs (--loads pointer: skipped).
  (A persistent TMA kernel, which this sweep also timed, is rejected: docs/decisions.md, D56.)
Floors: weight bytes / copy bandwidth and FLOPs / matmul rate, both measured in the same run.

    python3 benchmarks/gemm_sweep.py [--tokens 128,4096] [--loads pointer|both] [--out gemm.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from qwen_triton.benchmark.harness import measure_hbm_bandwidth, measure_matmul_rate, time_graph
from qwen_triton.operators.linear import gemm

from decode_sweep import SHAPES  # every projection of a layer (this script's folder is on sys.path)

L2_BYTES = 60 * 2**20


@triton.jit
def _bare_matmul(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_tile = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K here
        acc = tl.dot(tl.load(x_tile, mask=(offs_m < M)[:, None]), tl.load(w_tile, mask=(offs_n < N)[None, :]), acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def graph_us(launch, count: int) -> float:
    calls = iter(range(10**9))
    return time_graph(lambda: launch(next(calls) % count), calls=count, replays=10) * 1e3


def with_configs(autotuner, configs):
    autotuner.configs = configs
    autotuner.cache = {}


def sweep(M: int, hbm: float, matmul: float, loads: int = 2, rows: list | None = None, save=lambda: None) -> list:
    """Rows of timings at M tokens (appended to rows; save() after each shape): cuBLAS, then for the pointer
    loads (and with loads=2 the TMA loads) the autotuner's pick and each config the prune allows at this M."""
    rows = [] if rows is None else rows
    kernel_configs = {"": list(gemm._gemm_split.configs), "tma ": list(gemm._gemm_tma_split.configs)}
    for name, weight_rows, K, options in SHAPES:
        N = weight_rows // (2 if options.get("activation") else 1)
        weight_bytes = weight_rows * K * 2
        copies = max(2, min(24, -(-2 * L2_BYTES // weight_bytes))) if M <= 256 else 2
        weights = [torch.randn(weight_rows, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        plain = torch.empty(M, weight_rows, device="cuda", dtype=torch.bfloat16)
        norm = torch.randn(K, device="cuda", dtype=torch.bfloat16) * 0.1 if options.get("norm") else None
        gate = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) if options.get("gate") else None
        flops = 2 * M * weight_rows * K
        floor_us = max(weight_bytes / (hbm * 1e12), flops / (matmul * 1e12)) * 1e6

        def record(variant, config, us):
            rows.append(dict(shape=name, M=M, variant=variant, config=config, us=us, floor_us=floor_us,
                             pct_of_floor=100 * floor_us / us))

        result = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        tma_loads = [False]

        def launch(i):  # the GEMM launcher as linear calls it, its loads chosen (gemm(tma=...))
            gemm.gemm(x, weights[i], out if options.get("residual") else result, norm_weight=norm, gate=gate,
                      activation=1 if options.get("activation") else 0,
                      residual=out if options.get("residual") else None, tma=tma_loads[0])

        record("cublas", "", graph_us(lambda i: torch.matmul(x, weights[i].T, out=plain), copies))
        bucket = triton.next_power_of_2(M)
        for prefix, kernel, tma in (("", gemm._gemm_split, False), ("tma ", gemm._gemm_tma_split, True))[:loads]:
            tma_loads[0] = tma
            all_configs = kernel_configs[prefix]
            with_configs(kernel, all_configs)
            launch(0)  # tunes
            record(prefix + "tuned", str(kernel.best_config), graph_us(launch, copies))
            # the prune's rules of size and split (no N, K: the in-graph pins are not applied)
            kept = gemm._prune(all_configs, dict(M_BUCKET=bucket), ACTIVATION=1 if options.get("activation") else 0,
                               SPLIT_ALLOWED=bucket <= gemm.MAX_SPLIT_ROWS)
            for config in kept:
                with_configs(kernel, [config])
                try:
                    launch(0)
                except OutOfResources:  # more shared memory than an SM has (e.g. deep stages of 128-wide K)
                    record(prefix + "config", str(config), float("nan"))
                    continue
                record(prefix + "config", str(config), graph_us(launch, copies))
                meta = config.kwargs
                if tma or meta["SPLIT_K"] != 1 or K % meta["BLOCK_K"]:
                    continue
                def bare(i, meta=meta, config=config):
                    grid = (triton.cdiv(weight_rows, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]))
                    _bare_matmul[grid](x, weights[i], plain, M, weight_rows, K, x.stride(0), K, plain.stride(0),
                                       BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"],
                                       num_warps=config.num_warps, num_stages=config.num_stages)
                record("bare", str(config), graph_us(bare, copies))
            with_configs(kernel, all_configs)
        weights.clear()
        torch.cuda.empty_cache()
        save()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--loads", choices=["pointer", "both"], default="both")
    parser.add_argument("--out")
    args = parser.parse_args()
    hbm = measure_hbm_bandwidth()
    matmul = measure_matmul_rate()
    rows = []

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(hbm_copy_TBps=hbm, matmul_TFLOPs=matmul, rows=rows), f, indent=1)

    for M in (int(m) for m in args.tokens.split(",")):
        sweep(M, hbm, matmul, loads=1 if args.loads == "pointer" else 2, rows=rows, save=save)
    print(f"copy {hbm:.2f} TB/s, matmul {matmul:.0f} TFLOP/s; us per launch, back to back in a CUDA graph")
    for M in dict.fromkeys(r["M"] for r in rows):
        for shape in dict.fromkeys(r["shape"] for r in rows):
            mine = [r for r in rows if r["M"] == M and r["shape"] == shape and r["us"] == r["us"]]
            if not mine:
                continue
            by = {v: sorted((r for r in mine if r["variant"] == v), key=lambda r: r["us"]) for v in
                  ("cublas", "tuned", "config", "bare", "tma tuned", "tma config")}
            line = f"M={M} {shape}: floor {mine[0]['floor_us']:.1f} us; cublas {by['cublas'][0]['us']:.1f}; "
            line += f"tuned {by['tuned'][0]['us']:.1f} ({by['tuned'][0]['config']})"
            if by["config"]:
                line += f"; best config {by['config'][0]['us']:.1f} ({by['config'][0]['config']})"
            if by["bare"]:
                line += f"; best bare {by['bare'][0]['us']:.1f} ({by['bare'][0]['config']})"
            for variant in ("tma tuned", "tma config"):
                if by[variant]:
                    line += f"; {variant} {by[variant][0]['us']:.1f} ({by[variant][0]['config']})"
            print(line)


if __name__ == "__main__":
    main()
