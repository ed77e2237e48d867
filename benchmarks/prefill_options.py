"""The engine's prefill under several settings of module constants, in one process: which is faster where it runs.

Each setting (`package.module.NAME=VALUE` items separated by ';', '' for the defaults) is applied while its own
model (0.8B, random weights, bf16) is built and its prefill graphs are captured (eager call, capture, replay, as
`qwen-triton bench` meets them), then the defaults are restored: a constant read when a kernel is launched
(e.g. triton_model.PREFILL_PDL, gemm.PREFETCH_WEIGHTS) is baked into that model's graphs. The settings are then
timed in alternation for `rounds` rounds, so that a drift of the machine falls on all alike:
  bench          reset + prefill (the logits of the last token), as the bench times it (time_calls)
  replay_ahead   the captured graph replayed back to back, the host not waiting: the GPU's time per prefill

    python3 benchmarks/prefill_options.py "" "qwen_triton.engine.triton_model.PREFILL_PDL=False" \
        [--tokens 128,4096] [--steps 30] [--rounds 3] [--out prefill_options.json]

A constant that is a `tl.constexpr` of a kernel cannot differ between settings of one process (the first
compilation serves all): compare those with one run each.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics

import torch

from qwen_triton.benchmark.harness import EngineRunner, time_calls


def parse_setting(text: str) -> list[tuple[object, str, object]]:
    """'a.b.NAME=1;c.d.OTHER=(1, 2)' -> [(module a.b, 'NAME', 1), (module c.d, 'OTHER', (1, 2))]."""
    items = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        target, value = item.split("=", 1)
        module_name, name = target.strip().rsplit(".", 1)
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            raise SystemExit(f"{module_name} has no constant {name}")
        items.append((module, name, ast.literal_eval(value.strip())))
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("settings", nargs="+", help="module.NAME=VALUE items separated by ';' ('' = defaults)")
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    generator = torch.Generator().manual_seed(0)
    prompts = {length: torch.randint(0, 1000, (length,), generator=generator).cuda() for length in lengths}
    runners = {}
    for text in args.settings:
        items = parse_setting(text)
        saved = [(module, name, getattr(module, name)) for module, name, _ in items]
        for module, name, value in items:
            setattr(module, name, value)
        try:
            runner = EngineRunner("triton+split_k+cuda_graph", "0.8b", max(lengths) + 16, "cuda", torch.bfloat16)
            for ids in prompts.values():
                for _ in range(3):  # eager, capture, replay
                    runner.prefill(ids)
            torch.cuda.synchronize()
        finally:
            for module, name, value in saved:
                setattr(module, name, value)
        runners[text] = runner
    times = {(text, length, way): [] for text in runners for length in lengths for way in ("bench", "replay_ahead")}
    for _ in range(args.rounds):
        for length, ids in prompts.items():
            for text, runner in runners.items():
                graph = runner.model._prefill_graphs[(length, 0, False)][0]
                times[(text, length, "bench")].append(
                    time_calls(lambda: runner.prefill(ids), args.steps, 3) * 1e3)
                times[(text, length, "replay_ahead")].append(
                    time_calls(graph.replay, args.steps, 3, back_to_back=True) * 1e3)
    print(f"{torch.cuda.get_device_name()}: prefill, us (median over {args.rounds} rounds of medians of {args.steps})")
    results = []
    for (text, length, way), values in times.items():
        median = statistics.median(values)
        results.append(dict(setting=text, tokens=length, way=way, us=median, rounds=values))
        print(f"  {length:5d} tokens  {way:12s} {median:9.1f}  {text or '(defaults)'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), steps=args.steps, results=results), f, indent=1)


if __name__ == "__main__":
    main()
