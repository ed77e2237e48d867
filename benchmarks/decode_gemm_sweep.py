"""The GEMM's configs for a batched decode step's projections, timed as the step launches them.

For each projection of a Qwen3.5-0.8B layer at M rows (a decode step of M sequences): the GEMM launcher
(`gemm.gemm`) with the step's fusions (the folded norm from the rows' sums of squares, SwiGLU, the residual add
writing the next norm's sums of squares, the attention gate's prologue), with programmatic dependent launch, back
to back in a CUDA graph on `copies` distinct weights (more bytes than twice the L2, so weights come from HBM as in
the model): the time per launch of the engine's pick (`engine`) and of each config of DECODE_CANDIDATES with
BLOCK_M the bucket of M (16 to 128 rows; 64 as well at 128). Floors: weight bytes over the copy bandwidth
measured in the same run. A decode step runs each K's projections with one config for every bucket but BLOCK_M
(batch invariance: tuning/h200.py, gemm_decode_by_k), so the summary adds up each (BLOCK_N, BLOCK_K, SPLIT_K,
warps, stages) over the step's projections of each K.

    python3 benchmarks/decode_gemm_sweep.py [--preset 0.8b|4b|9b|27b] [--rows 2,16,64,128] [--out decode-gemm.json]
        [--resident] [--wide]

--resident times the resident-weights GEMM (linear/resident_gemm.py) instead: its default config (`resident`) and
each of RESIDENT_CANDIDATES, against the tiled GEMM's pick (`engine`).

--preset takes the projections of another size of the family (their N, K and count a step, from its config).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
from triton.runtime.errors import OutOfResources

from qwen_triton.benchmark.harness import measure_hbm_bandwidth
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import parse_config
from qwen_triton.operators.linear import gemm
from qwen_triton.operators.linear.fusion import SQUARES_COLUMNS

from gemm_sweep import L2_BYTES, graph_us  # (this script's folder is on sys.path)


def projections(preset: str) -> list[tuple]:
    """A decode step's projections at a size of the family, from its config: (name, weight rows, K, fusions, count a
    step), e.g. at the 0.8B (18 DeltaNet layers, 6 attention layers) the DeltaNet in-projection 8224 x 1024 18 times."""
    c = parse_config(official_config(PRESETS[preset]))
    deltanet, attention = len(c.linear_attention_layers), len(c.full_attention_layers)
    q_dim = c.num_attention_heads * c.head_dim
    return [
        ("deltanet in-projection", c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads,
         c.hidden_size, ("norm",), deltanet),
        ("attention in-projection", 2 * q_dim + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size, ("norm",),
         attention),
        ("mlp gate/up + swiglu", 2 * c.intermediate_size, c.hidden_size, ("norm", "swiglu"), deltanet + attention),
        ("mlp down + residual", c.hidden_size, c.intermediate_size, ("residual",), deltanet + attention),
        ("deltanet out-projection + residual", c.hidden_size, c.linear_value_dim, ("residual",), deltanet),
        ("attention gate + out-projection + residual", c.hidden_size, q_dim, ("gate", "residual"), attention),
    ]


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages): few rows a program, many programs (132 SMs on an H100)
DECODE_CANDIDATES = [
    (64, 64, 1, 4, 4), (64, 128, 1, 4, 4), (32, 128, 1, 4, 4), (32, 64, 1, 4, 4), (16, 128, 1, 4, 4),
    (64, 128, 2, 4, 4), (32, 128, 2, 4, 4), (32, 256, 2, 4, 3), (16, 256, 2, 4, 3),
    (64, 128, 4, 4, 3), (32, 128, 4, 4, 4), (16, 128, 4, 4, 4), (32, 256, 4, 4, 3),
    (32, 128, 8, 4, 4), (16, 128, 8, 4, 4), (64, 64, 8, 4, 4), (32, 64, 8, 4, 4),
    # wider tiles and longer splits, for the larger sizes' K of 2,560-12,288
    (128, 64, 1, 4, 4), (64, 256, 2, 4, 3), (64, 128, 8, 4, 3),
]
# --wide adds these: 8 warps, wider tiles, for steps of 32-128 rows (a program then covers more of the bucket's rows
# and columns, so that x and the weights cross from L2 fewer times)
WIDE_CANDIDATES = [
    (64, 64, 1, 8, 4), (64, 128, 1, 8, 3), (128, 64, 1, 8, 3), (128, 128, 1, 8, 3), (256, 64, 1, 8, 3),
    (64, 128, 2, 8, 3), (128, 64, 2, 8, 3), (128, 128, 2, 8, 3), (64, 128, 4, 8, 3), (128, 64, 4, 8, 3),
    (64, 64, 2, 8, 4), (64, 64, 4, 8, 4), (128, 128, 4, 8, 3),
]


# (BLOCK_N, SPLIT_K, num_warps) of the resident-weights GEMM: a slice of BLOCK_N rows over K / SPLIT_K columns a program
RESIDENT_CANDIDATES = [
    (16, 1, 4), (32, 1, 4), (32, 1, 8), (64, 1, 8), (16, 2, 4), (32, 2, 4), (32, 2, 8), (64, 2, 8),
    (32, 4, 4), (64, 4, 8), (32, 7, 4), (32, 8, 4),
]


def projection_inputs(weight_rows, K, fusions, M, hbm):
    """One projection's launch at M rows as the step runs it: x, `copies` distinct weights (more bytes than twice the
    L2), the output (the residual itself for a residual add), the launch options (the step's fusions, PDL) and the
    floor (the weight bytes over the copy bandwidth), us."""
    torch.manual_seed(0)
    N = weight_rows // (2 if "swiglu" in fusions else 1)
    weight_bytes = weight_rows * K * 2
    copies = max(2, min(24, -(-2 * L2_BYTES // weight_bytes)))
    weights = [torch.randn(weight_rows, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(copies)]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) if "residual" in fusions else None
    out = residual if residual is not None else torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    options = dict(
        gate=torch.randn(M, K, device="cuda", dtype=torch.bfloat16) if "gate" in fusions else None,
        norm_squares=(x.float() ** 2).sum(1, keepdim=True) if "norm" in fusions else None,
        squares_out=torch.empty(M, -(-N // SQUARES_COLUMNS), device="cuda") if residual is not None else None,
        residual=residual, activation=1 if "swiglu" in fusions else 0, pdl=True)
    return x, weights, out, options, weight_bytes / (hbm * 1e12) * 1e6


def sweep_resident(name, weight_rows, K, fusions, M, hbm, record):
    """Time the tiled GEMM's pick and the resident-weights GEMM's default and candidates for one projection."""
    from qwen_triton.operators.linear import resident_gemm

    pair = "swiglu" in fusions
    x, weights, target, options, floor_us = projection_inputs(weight_rows, K, fusions, M, hbm)
    copies = len(weights)

    def tiled(i):
        gemm.gemm(x, weights[i], target, **options)

    tiled(0)
    record(dict(shape=name, M=M, variant="engine", config=str(gemm._gemm_split.best_config),
                us=graph_us(tiled, copies), floor_us=floor_us))
    squares_out = options["squares_out"]
    default = resident_gemm.config_for(K, pair)
    candidates = [("resident", default)] + [
        ("config", dict(BLOCK_N=n, SPLIT_K=s, num_warps=w)) for n, s, w in RESIDENT_CANDIDATES]
    for variant, config in candidates:
        columns = resident_gemm.split_columns(K, config["SPLIT_K"])
        elements = config["BLOCK_N"] * triton.next_power_of_2(columns) * (2 if pair else 1)
        if (columns * (config["SPLIT_K"] - 1) >= K or squares_out is not None and config["BLOCK_N"] < SQUARES_COLUMNS
                or elements > 256 * 32 * config["num_warps"]):  # more than 256 weight elements a thread
            continue

        def resident(i, config=config):
            resident_gemm.resident_gemm(x, weights[i], target, config=config, **options)
        try:
            resident(0)
            us = graph_us(resident, copies)
        except OutOfResources:
            us = float("nan")
        record(dict(shape=name, M=M, variant=variant, block_m=16,
                    config=[config["BLOCK_N"], config["SPLIT_K"], config["num_warps"]], us=us, floor_us=floor_us))
    weights.clear()
    torch.cuda.empty_cache()


def sweep_projection(name, weight_rows, K, fusions, M, hbm, record, part=(0, 1), wide=False):
    """Time the engine's pick and each candidate (with part=(i, n), n > 1: only compile every n-th candidate from
    the i-th, into Triton's cache, for a timing run after)."""
    compile_only = part[1] > 1
    x, weights, target, options, floor_us = projection_inputs(weight_rows, K, fusions, M, hbm)
    copies = len(weights)

    def launch(i):
        gemm.gemm(x, weights[i], target, **options)

    kernel = gemm._gemm_split
    configs = list(kernel.configs)
    launch(0)
    if not compile_only:
        record(dict(shape=name, M=M, variant="engine", config=str(kernel.best_config), us=graph_us(launch, copies),
                    floor_us=floor_us))
    bucket = triton.next_power_of_2(M)
    candidates = [(block_m, *c) for block_m in sorted({max(16, bucket), min(max(16, bucket), 64)})
                  for c in DECODE_CANDIDATES + (WIDE_CANDIDATES if wide else [])]
    for index, (block_m, block_n, block_k, split_k, warps, stages) in enumerate(candidates):
        if (split_k > 1 and K // split_k < block_k or index % part[1] != part[0]
                or "residual" in fusions and block_n < SQUARES_COLUMNS):  # the sums of squares need whole groups
            continue
        config = triton.Config(dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split_k),
                               num_warps=warps, num_stages=stages)
        kernel.configs, kernel.cache = [config], {}
        try:
            launch(0)
            us = float("nan") if compile_only else graph_us(launch, copies)
        except OutOfResources:
            us = float("nan")
        if compile_only:
            continue
        record(dict(shape=name, M=M, variant="config", block_m=block_m,
                    config=[block_n, block_k, split_k, warps, stages], us=us, floor_us=floor_us))
    kernel.configs, kernel.cache = configs, {}
    weights.clear()
    torch.cuda.empty_cache()


def step_totals(rows, counts: dict, by_k: dict, K: int) -> dict:
    """{(BLOCK_M, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)): us} over one row count's timings `rows`: each config's
    time summed over the step's projections of this K (each weighted by its count a step: `counts`, by projection
    name; `by_k`, each projection's K), for the configs timed at every one of them."""
    totals = {}
    for r in rows:
        if r["variant"] == "config" and by_k[r["shape"]] == K and r["us"] == r["us"]:
            totals.setdefault((r["block_m"], tuple(r["config"])), {})[r["shape"]] = r["us"] * counts[r["shape"]]
    shapes = sum(1 for name in counts if by_k[name] == K)
    return {key: sum(v.values()) for key, v in totals.items() if len(v) == shapes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="0.8b", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="2,16,64,128")
    parser.add_argument("--out")
    parser.add_argument("--resident", action="store_true", help="the resident-weights GEMM's configs")
    parser.add_argument("--wide", action="store_true", help="WIDE_CANDIDATES too (8 warps, wider tiles)")
    parser.add_argument("--compile-part", default="0/1", help="i/n: only compile every n-th config from the i-th")
    args = parser.parse_args()
    part = tuple(int(v) for v in args.compile_part.split("/"))
    hbm = measure_hbm_bandwidth() if part[1] == 1 else 1.0
    shapes = projections(args.preset)
    rows = []
    started = time.perf_counter()

    def record(row):
        row["pct_of_floor"] = 100 * row["floor_us"] / row["us"] if row["us"] == row["us"] else 0.0
        rows.append(row)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), preset=args.preset, hbm_copy_TBps=hbm, rows=rows),
                          f, indent=1)

    for M in (int(m) for m in args.rows.split(",")):
        for name, weight_rows, K, fusions, _ in shapes:
            if args.resident:
                sweep_resident(name, weight_rows, K, fusions, M, hbm, record)
            else:
                sweep_projection(name, weight_rows, K, fusions, M, hbm, record, part, args.wide)
        print(f"M={M} swept at {time.perf_counter() - started:.0f} s", flush=True)
    if part[1] > 1:
        return
    print(f"{args.preset} on {torch.cuda.get_device_name()}: copy {hbm:.2f} TB/s; us per launch with PDL, back to back in a CUDA graph")
    counts = {name: count for name, _, _, _, count in shapes}
    by_k = {name: K for name, _, K, _, _ in shapes}
    for M in dict.fromkeys(r["M"] for r in rows):
        mine = [r for r in rows if r["M"] == M]
        for name in counts:
            engine = next(r for r in mine if r["shape"] == name and r["variant"] == "engine")
            best = min((r for r in mine if r["shape"] == name and r["variant"] == "config" and r["us"] == r["us"]),
                       key=lambda r: r["us"])
            print(f"M={M} {name}: floor {engine['floor_us']:.1f}; engine {engine['us']:.1f} "
                  f"({engine['pct_of_floor']:.0f}%); best {best['us']:.1f} ({best['pct_of_floor']:.0f}%) "
                  f"BLOCK_M {best['block_m']} {best['config']}")
            default = next((r for r in mine if r["shape"] == name and r["variant"] == "resident"), None)
            if default is not None:
                print(f"M={M} {name}: resident default {default['us']:.1f} ({default['pct_of_floor']:.0f}%) "
                      f"{default['config']}")
        # one config per K for the step: the sum over that K's projections, weighted by their count in a step
        for K in sorted(set(by_k.values())):
            complete = step_totals(mine, counts, by_k, K)
            shapes = [name for name in counts if by_k[name] == K]
            engine = sum(next(r["us"] for r in mine if r["shape"] == name and r["variant"] == "engine") * counts[name]
                         for name in shapes)
            ranked = sorted(complete.items(), key=lambda item: item[1])[:3]
            resident = sum(next((r["us"] for r in mine if r["shape"] == name and r["variant"] == "resident"), 0.0)
                           * counts[name] for name in shapes)
            print(f"M={M} K={K}: engine {engine:.0f} us a step; resident default {resident:.0f}; best " +
                  "; ".join(f"{us:.0f} (BLOCK_M {key[0]} {list(key[1])})" for key, us in ranked))


if __name__ == "__main__":
    main()
