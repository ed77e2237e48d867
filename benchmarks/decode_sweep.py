"""Every config of the decode GEMV and of the fused DeltaNet step, timed as the engine runs them; and a layer's
out-projection + MLP by out_projection_mlp against the three GEMVs (--parts tail); the decode attention's configs
and split counts at contexts 4096 and 32768 (--parts attention).

The autotuner times one launch at a time after flushing L2; a decode step runs them back to back inside
a CUDA graph with programmatic dependent launch. Here each config runs as a graph of `layers` launches
on as many distinct weights (or states): more bytes than the 60 MB L2, so each launch reads from HBM as
in the model, and each launch overlaps its neighbours as in the model. Prints, per shape, every config's
time per launch and its share of the copy bandwidth, and the autotuner's own pick.

    python3 benchmarks/decode_sweep.py [--parts gemv,step,tail,attention] [--pdl on|off|both] [--out sweep.json]
        [--step-rows 1,16,128] [--step-configs tuned|wider]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from qwen_triton.benchmark.harness import measure_hbm_bandwidth, time_graph
from qwen_triton.operators.gated_delta_rule import fused_decode
from qwen_triton.operators.gated_delta_rule.fused_decode import gated_delta_rule_decode_fused
from qwen_triton.operators.linear import gemv
from qwen_triton.operators.linear.linear import linear
from qwen_triton.operators.linear.out_projection_mlp import out_projection_mlp
from qwen_triton.operators.linear import staged_out_projection_mlp as staged

SHAPES = [  # name, weight rows, K, options (gemm_sweep.py uses them too)
    ("deltanet in-projection", 8224, 1024, dict(norm=True)),
    ("attention in-projection", 5120, 1024, dict(norm=True)),
    ("mlp gate/up + swiglu", 7168, 1024, dict(norm=True, activation="swiglu")),
    ("mlp down + residual", 1024, 3584, dict(residual=True)),
    ("out-projection + residual", 1024, 2048, dict(residual=True)),
    ("attention gate + out-projection", 1024, 2048, dict(residual=True, gate=True)),
]


def graph_time_us(launch, count: int, replays: int = 20) -> float:
    """Median time per launch of a CUDA graph of `count` calls of launch(i), i = 0..count-1."""
    calls = iter(range(10**9))
    return time_graph(lambda: launch(next(calls) % count), calls=count, replays=replays) * 1e3


def with_configs(autotuner, configs):
    autotuner.configs = configs
    autotuner.cache = {}


def sweep_gemv(layers: int, hbm: float, pdl: bool) -> list[dict]:
    rows = []
    all_configs = list(gemv._gemv_split.configs)
    for name, weight_rows, K, options in SHAPES:
        N = weight_rows // (2 if options.get("activation") else 1)
        weights = [torch.randn(weight_rows, K, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        out = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
        norm = torch.randn(K, device="cuda", dtype=torch.bfloat16) * 0.1 if options.get("norm") else None
        gate = torch.randn(1, K, device="cuda", dtype=torch.bfloat16) if options.get("gate") else None
        moved = weight_rows * K * 2

        def launch(i):
            linear(x, weights[i], norm_weight=norm, gate=gate, activation=options.get("activation"),
                   residual=out if options.get("residual") else None, out=out if options.get("residual") else None,
                   pdl=pdl)

        with_configs(gemv._gemv_split, all_configs)
        launch(0)  # the autotuner's pick
        pick = gemv._gemv_split.best_config
        for config in all_configs:
            if config.kwargs["SPLIT_K"] > 1 and K // config.kwargs["SPLIT_K"] < config.kwargs["BLOCK_K"]:
                continue
            with_configs(gemv._gemv_split, [config])
            us = graph_time_us(launch, layers)
            rows.append(dict(shape=name, config=str(config), us=us, pct_hbm=100 * moved / (us * 1e-6) / (hbm * 1e12),
                             autotuner_pick=str(config) == str(pick), pdl=pdl))
        with_configs(gemv._gemv_split, all_configs)
    return rows


# configs of the fused step beyond its autotuner's space, timed with --step-configs wider (larger value blocks: at
# every batch the autotuner picked its largest, BLOCK_V 32 with 4 warps, on the H100; tuning/picks)
WIDER_STEP_CONFIGS = [
    triton.Config({"BLOCK_V": 32}, num_warps=8), triton.Config({"BLOCK_V": 64}, num_warps=4),
    triton.Config({"BLOCK_V": 64}, num_warps=8), triton.Config({"BLOCK_V": 128}, num_warps=8),
]


def sweep_delta_step(layers: int, hbm: float, pdl: bool, batch: int = 1, wider: bool = False) -> list[dict]:
    heads, dim, channels, width = 16, 128, 6144, 4
    states = [torch.randn(batch, heads, dim, dim, device="cuda") * 0.1 for _ in range(layers)]
    conv_states = [torch.randn(batch, channels, width - 1, device="cuda", dtype=torch.bfloat16)
                   for _ in range(layers)]
    projection = torch.randn(batch, channels + heads * dim + 2 * heads, device="cuda", dtype=torch.bfloat16)
    x, z = projection[:, :channels], projection[:, channels:channels + heads * dim]
    b, a = projection[:, channels + heads * dim:channels + heads * dim + heads], projection[:, -heads:]
    conv_weight = torch.randn(channels, width, device="cuda", dtype=torch.bfloat16)
    a_log = torch.randn(heads, device="cuda")
    dt_bias = torch.randn(heads, device="cuda")
    norm = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(batch, heads * dim, device="cuda", dtype=torch.bfloat16)
    delta_out = torch.empty(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    moved = 2 * heads * dim * dim * 4 * batch

    def launch(i):
        gated_delta_rule_decode_fused(x, z, a, b, conv_weight, conv_states[i], a_log, dt_bias, norm, 1e-6, states[i],
                                      out=out, delta_out=delta_out, pdl=pdl)

    all_configs = list(fused_decode._fused_step_kernel.configs)
    launch(0)
    pick = fused_decode._fused_step_kernel.best_config
    rows = []
    for config in all_configs + (WIDER_STEP_CONFIGS if wider else []):
        with_configs(fused_decode._fused_step_kernel, [config])
        us = graph_time_us(launch, layers)
        rows.append(dict(shape=f"deltanet step (fused kernel), {batch} rows", config=str(config), us=us,
                         pct_hbm=100 * moved / (us * 1e-6) / (hbm * 1e12), autotuner_pick=str(config) == str(pick),
                         pdl=pdl))
    with_configs(fused_decode._fused_step_kernel, all_configs)
    return rows


def sweep_layer_tail(layers: int, hbm: float, pdl: bool) -> list[dict]:
    """A layer's out-projection + residual and MLP: out_projection_mlp (its three phases as three launches),
    staged_out_projection_mlp (one launch, every weight in shared memory) and the three `linear` calls they
    replace, `layers` layers on distinct weights."""
    hidden_size, attended, intermediate = 1024, 2048, 3584
    blocks = [dict(out=torch.randn(hidden_size, attended, device="cuda", dtype=torch.bfloat16) * 0.02,
                   norm=torch.randn(hidden_size, device="cuda", dtype=torch.bfloat16) * 0.1,
                   gate_up=torch.randn(2 * intermediate, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02,
                   down=torch.randn(hidden_size, intermediate, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(layers)]
    x = torch.randn(1, attended, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(1, intermediate, device="cuda", dtype=torch.bfloat16)
    moved = 2 * (hidden_size * attended + 3 * hidden_size * intermediate)

    def per_sm(i):
        b = blocks[i]
        out_projection_mlp(x, b["out"], hidden, b["norm"], b["gate_up"], b["down"], 1e-6, act=act, pdl=pdl)

    counters = staged.new_counters("cuda", layers)
    descriptors = [staged.weight_descriptors(b["out"], b["gate_up"], b["down"]) for b in blocks]

    def one_launch(i):
        b = blocks[i]
        staged.staged_out_projection_mlp(x, b["out"], hidden, b["norm"], b["gate_up"], b["down"], 1e-6, counters[i],
                                         act=act, pdl=pdl, descriptors=descriptors[i])

    def chain(i):
        b = blocks[i]
        linear(x, b["out"], residual=hidden, out=hidden, pdl=pdl)
        linear(hidden, b["gate_up"], norm_weight=b["norm"], activation="swiglu", out=act, pdl=pdl)
        linear(act, b["down"], residual=hidden, out=hidden, pdl=pdl)

    rows = []
    for name, launch in (("out_projection_mlp, 3 launches", per_sm), ("3 linear calls (GEMV)", chain),
                         ("staged_out_projection_mlp, 1 launch", one_launch)):
        launch(0)  # compiles, autotunes
        us = graph_time_us(launch, layers)
        rows.append(dict(shape="layer tail (out-proj + MLP)", config=name, us=us,
                         pct_hbm=100 * moved / (us * 1e-6) / (hbm * 1e12), autotuner_pick=False, pdl=pdl))
    if counters[:, 3].any():
        raise RuntimeError("staged_out_projection_mlp: a grid barrier gave up (counters' error flag set)")
    return rows


def sweep_attention(layers: int, hbm: float, pdl: bool, contexts=(4096, 32768)) -> list[dict]:
    """Decode attention (split-KV + merge) at each context: every split-kernel config at split counts of 1, 2,
    4 and 8 programs per SM, on `layers` distinct KV caches of the engine's shape (8 query heads, 2 KV
    heads of 256, bf16) and the bench's cache length."""
    from qwen_triton.operators.attention import decode as attention

    heads, kv_heads, dim, cache_length = 8, 2, 256, 32980
    caches = [(torch.randn(1, kv_heads, cache_length, dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, kv_heads, cache_length, dim, device="cuda", dtype=torch.bfloat16))
              for _ in range(layers)]
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    default = attention.decode_splits(1, kv_heads, cache_length, "cuda")
    all_configs = list(attention._decode_split_kernel.configs)
    rows = []
    for context in contexts:
        lengths = torch.full((1,), context, device="cuda", dtype=torch.int32)
        moved = 2 * kv_heads * context * dim * 2
        for splits in sorted({default // 2, default, 2 * default, 4 * default}):
            def launch(i, splits=splits):
                attention.attention_decode(q, *caches[i], lengths, out=out, num_splits=splits, pdl=pdl)

            with_configs(attention._decode_split_kernel, all_configs)
            launch(0)
            pick = attention._decode_split_kernel.best_config  # the autotuner's pick
            for config in all_configs:
                with_configs(attention._decode_split_kernel, [config])
                us = graph_time_us(launch, layers)
                rows.append(dict(shape=f"decode attention @{context}, {splits} splits per KV head",
                                 config=str(config), us=us, pct_hbm=100 * moved / (us * 1e-6) / (hbm * 1e12),
                                 autotuner_pick=str(config) == str(pick), pdl=pdl,
                                 engine_default=splits == default))
    with_configs(attention._decode_split_kernel, all_configs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out")
    parser.add_argument("--parts", default="gemv,step,tail", help="gemv, step, tail, attention (comma-separated)")
    parser.add_argument("--pdl", choices=("on", "off", "both"), default="both")
    parser.add_argument("--step-rows", default="1", help="the fused step's batches, e.g. 1,16,128 (--parts step)")
    parser.add_argument("--step-configs", choices=("tuned", "wider"), default="tuned",
                        help="wider: also WIDER_STEP_CONFIGS, beyond the autotuner's space")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"gemv", "step", "tail", "attention"}:
        parser.error(f"--parts: gemv, step, tail and/or attention, got {args.parts!r}")
    hbm = measure_hbm_bandwidth()
    rows = []
    for pdl in {"on": (True,), "off": (False,), "both": (True, False)}[args.pdl]:
        if "gemv" in parts:
            rows += sweep_gemv(args.layers, hbm, pdl)
        if "step" in parts:
            for batch in map(int, args.step_rows.split(",")):
                rows += sweep_delta_step(18, hbm, pdl, batch, args.step_configs == "wider")
        if "tail" in parts:
            rows += sweep_layer_tail(args.layers, hbm, pdl)
        if "attention" in parts:
            rows += sweep_attention(6, hbm, pdl)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(hbm_copy_TBps=hbm, rows=rows), f, indent=2)
    print(f"HBM copy {hbm:.2f} TB/s; time per launch in a graph of back-to-back launches on distinct weights")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for pdl in dict.fromkeys(r["pdl"] for r in rows):
            mine = sorted((r for r in rows if r["shape"] == shape and r["pdl"] == pdl), key=lambda r: r["us"])
            pick = next((r for r in mine if r["autotuner_pick"]), None)
            best = mine[0]
            if shape.startswith("layer tail"):
                print("\n".join(f"{shape}: {r['us']:.2f} us ({r['pct_hbm']:.0f}%) {r['config']}" for r in mine))
                continue
            print(f"{shape} (PDL {'on' if pdl else 'off'}): best {best['us']:.2f} us ({best['pct_hbm']:.0f}%) "
                  f"{best['config']}; autotuner's pick {pick['us'] if pick else float('nan'):.2f} us; "
                  f"worst {mine[-1]['us']:.2f} us")


if __name__ == "__main__":
    main()
