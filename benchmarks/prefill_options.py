"""The engine's prefill under several sets of plan options, in one process: which is faster where it runs.

Each option set (comma-separated NAME=VALUE of the plan's Options, engine/plan.py; '' for the defaults) builds
its own model (0.8B, random weights, bf16) and captures its prefill graphs (eager call, capture, replay, as
`qwen-triton bench` meets them: with packed_prefill, the default, the packed graphs of the length's bucket;
"packed_prefill=False" the one-sequence graph of the length). The sets are then timed in alternation for `rounds` rounds, so that a drift of
the machine falls on all alike:
  bench          reset + prefill (the logits of the last token), as the bench times it (time_calls)
  replay_ahead   the captured graph replayed back to back, the host not waiting: the GPU's time per prefill

    python3 benchmarks/prefill_options.py "" "prefill_pdl_tokens=0" "fold_norms=False" \
        [--tokens 128,4096] [--steps 30] [--rounds 3] [--out prefill_options.json]

A kernel's tuning (tuning/h200.py) cannot differ between sets of one process: compare the H200's table with
none by two runs, the second with QWEN_TRITON_TUNING=default.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.harness import EngineRunner, plan_options, time_calls


def replay(model, length: int):
    """The captured prefill of `length` tokens in slot 0: the packed graphs of its bucket (layers, then the LM head
    of one sequence) where the model has them, else its one-sequence graph."""
    if model.packed_graphs is not None:
        from qwen_triton.engine.packed import aligned, token_bucket

        body = model.packed_graphs.bodies[token_bucket(aligned(length), model.packed_buckets)]
        head = model.packed_graphs.heads[1][0]
        return lambda: (body.replay(), head.replay())
    return model.prefill_graphs.graphs[(length, 0, False)][0].replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("settings", nargs="+", help="comma-separated NAME=VALUE plan options per set ('' = defaults)")
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
        runner = EngineRunner("triton+split_k+cuda_graph", "0.8b", max(lengths) + 16, "cuda", torch.bfloat16,
                              **plan_options(text))
        for ids in prompts.values():
            for _ in range(3):  # eager, capture, replay
                runner.prefill(ids)
        torch.cuda.synchronize()
        runners[text] = runner
    times = {(text, length, way): [] for text in runners for length in lengths for way in ("bench", "replay_ahead")}
    for _ in range(args.rounds):
        for length, ids in prompts.items():
            for text, runner in runners.items():
                times[(text, length, "bench")].append(
                    time_calls(lambda: runner.prefill(ids), args.steps, 3) * 1e3)
                times[(text, length, "replay_ahead")].append(
                    time_calls(replay(runner.model, length), args.steps, 3, back_to_back=True) * 1e3)
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
