"""The engine's decode step with and without an option, in one process: which way is faster where it runs.

Builds the 0.8B model (or --preset's; random weights, bf16) once per option set, e.g. `out_projection_mlp=False`, and
times decode steps as `qwen-triton bench` does (`time_calls(back_to_back=True)` over the bench's step: the
CUDA graph with feedback, one step ahead of the host) at each context, alternating the option sets for
`rounds` rounds so that a drift of the machine falls on all of them alike; prints each median.

    python3 benchmarks/engine_options.py "out_projection_mlp=True" "out_projection_mlp=False" \
        [--preset 4b] [--contexts 128,32768] [--steps 200] [--rounds 2] [--out options.json]

The options are the plan's (engine/plan.py, Options: e.g. lm_head_pdl=True, screened_lm_head=False).
QWEN_TRITON_TUNING=default runs every set without the H200's pins (tuning/__init__.py). Each set holds its own model:
where two do not fit the GPU beside each other (the 27B's 54 GB of weights each, on an H200), time one set a process.

(A one-launch decode attention, compared so with the three kernels, is rejected: docs/decisions.md, D47.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.harness import EngineRunner, plan_options, time_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("option_sets", nargs="+", help="comma-separated name=value TritonModel options per set")
    parser.add_argument("--preset", default="0.8b", help="the model shape (checkpoint.PRESETS)")
    parser.add_argument("--contexts", default="128,32768")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    max_length = max(contexts) + args.rounds * (args.steps + args.warmup) + 8
    runners = {text: EngineRunner("triton+split_k+cuda_graph", args.preset, max_length, "cuda", torch.bfloat16,
                                  **plan_options(text)) for text in args.option_sets}
    times = {(text, context): [] for text in runners for context in contexts}
    for _ in range(args.rounds):
        for context in contexts:
            for text, runner in runners.items():
                ms = time_calls(runner.decode_step(context), args.steps, args.warmup, back_to_back=True)
                times[text, context].append(ms * 1e3)
    rows = [dict(options=text, context=context, us=statistics.median(values), rounds=values)
            for (text, context), values in times.items()]
    print(f"{torch.cuda.get_device_name()}: decode step, us (median of {args.steps} steps; per round)")
    for row in rows:
        print(f"  {row['options'] or '(defaults)':45s} @{row['context']:6d}: {row['us']:7.1f}  "
              + " ".join(f"{value:.1f}" for value in row["rounds"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), steps=args.steps, rows=rows),
                      f, indent=1)


if __name__ == "__main__":
    main()
