"""Where the time between two decode steps goes: the bench's step against bare replays of its CUDA graph.

`qwen-triton bench` times a decode step as `LLM.generate` runs it (engine/decode_pipeline.py: the step's
graph replayed, whose feedback kernel writes the chosen id into pinned host memory, an event recorded, one
step ahead of the host); `qwen-triton profile` times the kernels inside one replay (its span). This script
times, on one model at one context, steps back to back on the GPU (CUDA events between consecutive steps,
the harness's `time_calls(back_to_back=True)`), in three ways:
  pipeline  the bench's step (DecodePipeline.step, the host reading each id one step behind)
  graph     the captured step replayed with feedback and nothing else
  copy      graph, plus a copy of the id to pinned host memory and an event on the GPU's stream, without
            the host reading anything (how the pipeline took the ids before the feedback kernel wrote them)
The difference between graph and the profile's span is the cost of the graph boundary itself; between
copy and graph, a copy on the stream; between pipeline and graph, what the pipeline adds.

    python3 benchmarks/step_gap.py [--context 128] [--steps 200] [--out gap.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from qwen_triton.benchmark.harness import EngineRunner, time_calls
from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.engine.triton_model import DeviceSampling


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    steps, warmup = args.steps, args.warmup
    # three runs of warm-up + steps, each advancing the context by one token a step
    max_length = args.context + 3 * (steps + warmup) + 8
    runner = EngineRunner("triton+split_k+cuda_graph", "0.8b", max_length, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    vocabulary = runner.model.config.vocab_size
    runner.prefill(torch.randint(0, vocabulary, (args.context,), generator=generator).to("cuda"))
    times = {}
    times["pipeline"] = time_calls(runner.decode_step(args.context), steps, warmup, back_to_back=True)

    model = runner.model
    sampling = DeviceSampling.build([SamplingParams()], "cuda")

    def graph():  # continues from the inputs the previous step fed back
        return model.decode_tokens(None, None, sampling, None, feedback=True)

    host = torch.empty(1, dtype=torch.int64, pin_memory=True)
    event = torch.cuda.Event()

    def copy():
        host.copy_(graph(), non_blocking=True)
        event.record()

    times["graph"] = time_calls(graph, steps, warmup, back_to_back=True)
    times["copy"] = time_calls(copy, steps, warmup, back_to_back=True)
    report = dict(gpu=torch.cuda.get_device_name(), context=args.context, steps=steps,
                  us={name: ms * 1e3 for name, ms in times.items()})
    for name, ms in times.items():
        print(f"{name:9s} {ms * 1e3:8.1f} us per step")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
