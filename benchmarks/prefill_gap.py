"""Where a short prompt's prefill spends the time between its kernels' span and what `qwen-triton bench` reads.

The bench times reset + prefill of 128 tokens through the prefill's CUDA graph, each call between two CUDA
events with the host waiting for the call (time_calls): 1.998 ms in latest.json at 965372a, where the profile's
span of the same graph's kernels is 1,729.6 us. This script times, in one process on the bench's model:
  bench              reset + prefill, as the bench does
  prefill            the prefill alone (no reset)
  replay             the captured graph's replay alone, the host waiting for each
  replay, ahead      replays back to back, the host not waiting (the GPU's time per replay)
  host, replay       the host's time inside graph.replay() (perf_counter, no synchronisation)
  host, reset        the host's time inside reset()

    python3 benchmarks/prefill_gap.py [--tokens 128] [--steps 50] [--out prefill_gap.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qwen_triton.benchmark.harness import EngineRunner, time_calls


def host_us(function, calls: int) -> float:
    """Median host microseconds of one call of function (no synchronisation inside; the GPU is drained after
    each so that queues never fill)."""
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    runner = EngineRunner("triton+split_k+cuda_graph", "0.8b", args.tokens + 16, "cuda", torch.bfloat16)
    model = runner.model
    ids = torch.randint(0, 1000, (args.tokens,), device="cuda")
    for _ in range(3):  # eager, capture, replay
        runner.prefill(ids)
    torch.cuda.synchronize()
    graph = model._prefill_graphs[(args.tokens, 0, False)][0]
    results = dict(
        bench=time_calls(lambda: runner.prefill(ids), args.steps, 3) * 1e3,
        prefill=time_calls(lambda: model.prefill(ids, slot=0, all_logits=False), args.steps, 3) * 1e3,
        replay=time_calls(graph.replay, args.steps, 3) * 1e3,
        replay_ahead=time_calls(graph.replay, args.steps, 3, back_to_back=True) * 1e3,
        host_replay=host_us(graph.replay, args.steps),
        host_reset=host_us(lambda: model.reset(0), args.steps),
        host_prefill=host_us(lambda: model.prefill(ids, slot=0, all_logits=False), args.steps),
    )
    print(f"{torch.cuda.get_device_name()}: prefill of {args.tokens} tokens, us (medians of {args.steps})")
    for name, value in results.items():
        print(f"  {name:14s} {value:9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), tokens=args.tokens, steps=args.steps, us=results), f,
                      indent=1)


if __name__ == "__main__":
    main()
