"""Where the time of `staged_out_projection_mlp` goes: each program's clock at its trace points.

A CUDA graph of `--layers` launches back to back on distinct weights (Qwen3.5-0.8B's tail: H 1024, A 2048,
I 3584, bf16, PDL), as a decode step chains layer tails, replayed; each program writes %globaltimer at the
trace points of staged_out_projection_mlp.TRACE_POINTS (SM cycles, converted at the clock measured against
%globaltimer over the launch). For each layer (the first and last left out) and program the times are taken
from the program's entry; the report gives, per point, the median over programs and layers and the layers'
median of their latest program, and from %globaltimer (about 1 us steps) how far apart the programs entered. Also the graph's time per launch with the trace off and on, with and
without the grid barriers (without: wrong results, the design's bound).

    python3 benchmarks/staged_tail_trace.py [--layers 24] [--out trace.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.linear import staged_out_projection_mlp as staged

POINTS = ["entry", "PDL wait done", "phase 1 input stored", "phase 1 weights arrived", "phase 1 stored",
          "barrier 1 passed", "phase 2 input stored", "phase 2 weights arrived", "phase 2 stored",
          "barrier 2 passed", "phase 3 weights arrived", "phase 3 stored", "loader: last copy issued"]


VARIANTS = {  # name: staged_out_projection_mlp's diagnostic options
    "staged (default: down weights requested past barrier 1)": dict(),
    "all weights requested at once": dict(paced=False),
    "16 computing warps": dict(warps=16),
    "without the grid barriers (wrong results)": dict(barriers=False),
    "weights only (no computing)": dict(stream_only=True),
}
TRACED = ["staged (default: down weights requested past barrier 1)", "all weights requested at once"]


def summary(stamps: torch.Tensor, layers: int) -> dict:
    """The trace of one replay ([layers, programs, TRACE_POINTS]) as the module docstring describes."""
    inner = slice(1, layers - 1)  # the first and last layers start and end the graph: left out
    cycles = stamps[inner, :, 11] - stamps[inner, :, 0]
    nanoseconds = stamps[inner, :, 14] - stamps[inner, :, 13]
    ghz = (cycles.sum() / nanoseconds.sum()).item()  # the SM clock, from the two clocks over every program
    rows = []
    for point, name in enumerate(POINTS):
        since_entry = (stamps[inner, :, point] - stamps[inner, :, 0]) / ghz / 1e3  # us from the program's entry
        rows.append(dict(point=name, median_us=since_entry.median().item(),
                         latest_us=since_entry.max(dim=1).values.median().item()))
    entries = stamps[:, :, 13]
    starts = entries.min(dim=1).values
    return dict(trace=rows, sm_clock_GHz=ghz,
                period_us=(starts[2:layers - 1] - starts[1:layers - 2]).median().item() / 1e3,
                entry_spread_us=(entries.max(dim=1).values - starts)[inner].median().item() / 1e3,
                span_us=((stamps[:, :, 14].max(dim=1).values - starts)[inner]).median().item() / 1e3)


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

    def launcher(traced, **options):
        calls = iter(range(10**9))

        def launch():
            i = next(calls) % layers
            b = blocks[i]
            staged.staged_out_projection_mlp(x, b["out"], hidden, b["norm"], b["gate_up"], b["down"], 1e-6,
                                             counters[i], act=act, pdl=True, descriptors=descriptors[i],
                                             trace=trace[i] if traced else None, **options)
        return launch

    result = dict(layers=layers, grid=grid, times_us={}, traces={})
    for name, options in VARIANTS.items():
        launch = launcher(False, **options)
        launch()
        result["times_us"][name] = time_graph(launch, calls=layers, replays=20) * 1e3
    for name in TRACED:
        launch = launcher(True, **VARIANTS[name])
        launch()
        result["times_us"][name + ", traced"] = time_graph(launch, calls=layers, replays=20) * 1e3
        result["traces"][name] = summary(trace.cpu().double(), layers)
    if counters[:, 3].any():
        raise RuntimeError("a grid barrier gave up (the counters' error flag)")
    for name, us in result["times_us"].items():
        print(f"{name}: {us:.2f} us a launch")
    for name, traced in result["traces"].items():
        print(f"\n{name}: SM clock {traced['sm_clock_GHz']:.3f} GHz; period between layers' first entries "
              f"{traced['period_us']:.2f} us; entries spread over {traced['entry_spread_us']:.2f} us; first entry to "
              f"last exit {traced['span_us']:.2f} us (%globaltimer, about 1 us steps)")
        print("from each program's own entry (SM clock), median over programs and layers; latest: the layers' "
              "median of their latest program")
        for row in traced["trace"]:
            print(f"{row['point']:>26}: median {row['median_us']:6.2f} us, latest {row['latest_us']:6.2f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
