"""Where the time of `staged_decode_layer` goes: a DeltaNet layer's decode step as one launch, traced.

A CUDA graph of `--layers` launches back to back (Qwen3.5-0.8B's DeltaNet layer: H 1024, 16 heads of 128,
I 3584, bf16, PDL), each on its own weights and states, as a decode step chains them, replayed: the time per
layer of the two kernels it replaces (gated_delta_rule_decode_projected, then staged_out_projection_mlp) and of
the one launch at each GATE_UP_AFTER choice; then, traced, each program's SM clock at phase 0's points
(staged_decode_layer.PHASE_0_POINTS) and at the tail's (staged_tail_trace.POINTS), from the program's entry:
per point the median over programs and layers and the layers' median of their latest program.

    python3 benchmarks/staged_layer_trace.py [--layers 18] [--out trace.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from staged_tail_trace import summary

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.gated_delta_rule import staged_decode_layer as staged_layer
from qwen_triton.operators.gated_delta_rule.projected_decode import gated_delta_rule_decode_projected
from qwen_triton.operators.linear import staged_out_projection_mlp as staged_tail

PHASE_0 = ["entry", "PDL wait done", "h normed", "in-projection rows arrived", "their sums stored",
           "conv stored", "head barrier passed", "step stored", "grid barrier passed",
           "q | k conv stored, arrived at the head barrier"]
H, HEADS, D, I = 1024, 16, 128, 3584
A = HEADS * D


def random(*shape, scale=0.02, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--out")
    args = parser.parse_args()
    layers = args.layers
    blocks = [dict(input_norm=random(H, scale=0.1), weight=random(4 * A + 2 * HEADS, H), conv=random(3 * A, 4, scale=0.3),
                   conv_state=random(1, 3 * A, 3, scale=1.0), A_log=torch.rand(HEADS, device="cuda") + 0.5,
                   dt_bias=torch.randn(HEADS, device="cuda"), state=random(1, HEADS, D, D, scale=0.1,
                                                                           dtype=torch.float32),
                   head_norm=random(D, scale=0.1) + 1, out=random(H, A), norm=random(H, scale=0.1),
                   gate_up=random(2 * I, H), down=random(H, I))
              for _ in range(layers)]
    descriptors = [staged_layer.weight_descriptors(b["weight"], b["out"], b["gate_up"], b["down"]) for b in blocks]
    tail_descriptors = [staged_tail.weight_descriptors(b["out"], b["gate_up"], b["down"]) for b in blocks]
    hidden = random(1, H, scale=1.0)
    projection = torch.zeros(1, 4 * A + 2 * HEADS, device="cuda", dtype=torch.bfloat16)
    mixed = torch.zeros(1, 3 * A, device="cuda", dtype=torch.bfloat16)
    o = torch.zeros(1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    act = torch.zeros(1, I, device="cuda", dtype=torch.bfloat16)
    counters = staged_layer.new_counters("cuda", HEADS, layers)
    tail_counters = staged_tail.new_counters("cuda", layers)
    grid = staged_layer.plan(H, HEADS, HEADS, D, D, 4, I, torch.cuda.get_device_properties(0).multi_processor_count)["grid"]
    trace = torch.zeros(layers, 2, grid, staged_tail.TRACE_POINTS.value, device="cuda", dtype=torch.int64)

    def launcher(traced=False, two_kernels=False, **options):
        calls = iter(range(10**9))

        def launch():
            i = next(calls) % layers
            b = blocks[i]
            if two_kernels:
                gated_delta_rule_decode_projected(hidden, b["input_norm"], 1e-6, b["weight"], b["conv"],
                                                  b["conv_state"], b["A_log"], b["dt_bias"], b["state"], projection,
                                                  mixed[:, :2 * A], o, pdl=True)
                staged_tail.staged_out_projection_mlp(o.view(1, A), b["out"], hidden, b["norm"], b["gate_up"],
                                                      b["down"], 1e-6, tail_counters[i], act=act, pdl=True,
                                                      head_norm=(projection[:, 3 * A:4 * A], b["head_norm"]),
                                                      descriptors=tail_descriptors[i])
                return
            staged_layer.staged_decode_layer(hidden, b["input_norm"], 1e-6, b["weight"], b["conv"], b["conv_state"],
                                             b["A_log"], b["dt_bias"], b["state"], b["head_norm"], b["out"],
                                             b["norm"], b["gate_up"], b["down"], counters[i], projection, mixed, o,
                                             act, pdl=True, descriptors=descriptors[i],
                                             trace=trace[i] if traced else None, **options)
        return launch

    variants = {"two kernels (projected step, staged tail)": dict(two_kernels=True)}
    variants.update({f"one launch, gate/up copied after {when}": dict(gate_up_after=choice) for choice, when in
                     enumerate(("phase 0's sums", "the head barrier", "the grid barrier", "the program's step"))})
    variants["one launch, gate/up copied after the head barrier, sums' loops rolled"] = dict(gate_up_after=1,
                                                                                           unrolled=False)
    result = dict(layers=layers, grid=grid, times_us={}, traces={})
    for name, options in variants.items():
        launch = launcher(**options)
        launch()
        result["times_us"][name] = time_graph(launch, calls=layers, replays=20) * 1e3
        if name.startswith("one launch"):
            launch = launcher(traced=True, **options)
            launch()
            result["times_us"][name + ", traced"] = time_graph(launch, calls=layers, replays=20) * 1e3
            stamps = trace.cpu().double()
            traced = summary(stamps[:, 0], layers)
            inner = slice(1, layers - 1)
            rows = []
            for point, label in enumerate(PHASE_0):
                since = (stamps[inner, 1, :, point] - stamps[inner, 0, :, 0]) / traced["sm_clock_GHz"] / 1e3
                rows.append(dict(point="phase 0: " + label, median_us=since.median().item(),
                                 latest_us=since.max(dim=1).values.median().item()))
            since = (stamps[inner, 0, :, 15] - stamps[inner, 0, :, 0]) / traced["sm_clock_GHz"] / 1e3
            rows.append(dict(point="phase 2 gate sums done", median_us=since.median().item(),
                             latest_us=since.max(dim=1).values.median().item()))
            traced["trace"] = rows + [dict(row, point="tail: " + row["point"]) for row in traced["trace"]]
            result["traces"][name] = traced
    if counters[:, 3].any() or tail_counters[:, 3].any():
        raise RuntimeError("a grid barrier gave up (the counters' error flag)")
    for name, us in result["times_us"].items():
        print(f"{name}: {us:.2f} us a layer")
    for name, traced in result["traces"].items():
        print(f"\n{name}: SM clock {traced['sm_clock_GHz']:.3f} GHz; period between layers' first entries "
              f"{traced['period_us']:.2f} us; entries spread over {traced['entry_spread_us']:.2f} us; first entry to "
              f"last exit {traced['span_us']:.2f} us")
        for row in traced["trace"]:
            print(f"{row['point']:>42}: median {row['median_us']:6.2f} us, latest {row['latest_us']:6.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)

if __name__ == "__main__":
    main()
