"""Where the time of `staged_out_projection_mlp` goes: each program's clock at its trace points.

A CUDA graph of `--layers` launches back to back on distinct weights (Qwen3.5-0.8B's tail: H 1024, A 2048,
I 3584, bf16, PDL), as a decode step chains layer tails, replayed; each program writes %globaltimer at the
trace points of staged_out_projection_mlp.TRACE_POINTS. For each layer (the first and last left out) the
times are taken from the layer's first program entry; the report gives, per point, the median over layers of
the median and the latest program. Also the graph's time per launch with the trace off and on, with and
without the grid barriers (without: wrong results, the design's bound).

    python3 benchmarks/staged_tail_trace.py [--layers 24] [--out trace.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.linear import staged_out_projection_mlp as staged

POINTS = ["entry", "PDL wait done", "phase 1 input stored", "phase 1 weights arrived", "phase 1 stored",
          "barrier 1 passed", "phase 2 input stored", "phase 2 weights arrived", "phase 2 stored",
          "barrier 2 passed", "phase 3 weights arrived", "phase 3 stored", "loader: last copy issued"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out")
    args = parser.parse_args()
    hidden_size, attended, intermediate = 1024, 2048, 3584
    layers = args.layers
    blocks = [dict(out=torch.randn(hidden_size, attended, device="cuda", dtype=torch.bfloat16) * 0.02,
                   norm=torch.randn(hidden_size, device="cuda", dtype=torch.bfloat16) * 0.1,
                   gate_up=torch.randn(2 * intermediate, hidden_size, device="cuda", dtype=torch.bfloat16) * 0.02,
                   down=torch.randn(hidden_size, intermediate, device="cuda", dtype=torch.bfloat16) * 0.02)
              for _ in range(layers)]
    descriptors = [staged.weight_descriptors(b["out"], b["gate_up"], b["down"]) for b in blocks]
    x = torch.randn(1, attended, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(1, hidden_size, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(1, intermediate, device="cuda", dtype=torch.bfloat16)
    counters = staged.new_counters("cuda", layers)
    grid = staged.plan(hidden_size, attended, intermediate, torch.cuda.get_device_properties(0).multi_processor_count)["grid"]
    trace = torch.zeros(layers, grid, staged.TRACE_POINTS.value, device="cuda", dtype=torch.int64)

    def launcher(traced, barriers):
        calls = iter(range(10**9))

        def launch():
            i = next(calls) % layers
            b = blocks[i]
            staged.staged_out_projection_mlp(x, b["out"], hidden, b["norm"], b["gate_up"], b["down"], 1e-6,
                                             counters[i], act=act, pdl=True, descriptors=descriptors[i],
                                             trace=trace[i] if traced else None, barriers=barriers)
        return launch

    result = dict(layers=layers, grid=grid, times_us={})
    for traced in (False, True):
        for barriers in (True, False):
            launch = launcher(traced, barriers)
            launch()
            us = time_graph(launch, calls=layers, replays=20) * 1e3
            result["times_us"][f"trace {'on' if traced else 'off'}, barriers {'on' if barriers else 'off'}"] = us
            if traced and barriers:
                stamps = trace.cpu().double()
    if counters[:, 3].any():
        raise RuntimeError("a grid barrier gave up (the counters' error flag)")
    starts = stamps[:, :, 0].min(dim=1).values
    rows = []
    for point, name in enumerate(POINTS):
        medians, latest = [], []
        for layer in range(1, layers - 1):
            relative = (stamps[layer, :, point] - starts[layer]) / 1e3
            medians.append(relative.median().item())
            latest.append(relative.max().item())
        rows.append(dict(point=name, median_us=statistics.median(medians), latest_us=statistics.median(latest)))
    periods = [(starts[layer + 1] - starts[layer]).item() / 1e3 for layer in range(1, layers - 1)]
    result["trace"] = rows
    result["period_us"] = statistics.median(periods)
    result["entry_spread_us"] = statistics.median(
        (stamps[layer, :, 0].max() - stamps[layer, :, 0].min()).item() / 1e3 for layer in range(1, layers - 1))
    for name, us in result["times_us"].items():
        print(f"{name}: {us:.2f} us a launch")
    print(f"period between layers' first entries {result['period_us']:.2f} us; entries spread over "
          f"{result['entry_spread_us']:.2f} us")
    for row in rows:
        print(f"{row['point']:>26}: median program {row['median_us']:6.2f} us, latest {row['latest_us']:6.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
