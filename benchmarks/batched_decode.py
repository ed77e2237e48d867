"""The batched decode step with and without plan options, at several batch sizes, in one process.

Builds the 0.8B model (random weights, bf16, no warm-up) once per option set, e.g. `batch_invariant=True`, and
times greedy decode steps of B rows as `LLM.generate` runs them (engine/decode_pipeline.py: the CUDA graph with
feedback, one step ahead of the host; `time_calls(back_to_back=True)`), every row at context `--context`, for
each B of `--batches`, alternating the option sets for `--rounds` rounds; prints each median with its floor
(floor.decode_bytes of B rows over the copy bandwidth measured in the same run).

    python3 benchmarks/batched_decode.py "" "batch_invariant=True" [--batches 2,16,64,128] [--context 128] \
        [--steps 100] [--rounds 2] [--temperature T] [--out batched.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.floor import decode_bytes
from qwen_triton.benchmark.harness import measure_hbm_bandwidth, plan_options, time_calls
from qwen_triton.benchmark.models import random_llm
from qwen_triton.engine.decode_pipeline import DecodePipeline
from qwen_triton.engine.device_sampling import DeviceSampling
from qwen_triton.engine.sampling import SamplingParams


def step_function(model, batch: int, context: int, temperature: float = 0.0):
    """One step of `batch` rows (slots 0..batch-1) a call, each row's context growing from `context`: greedy, or
    temperature-only sampling (seeded per row) at `temperature` > 0."""
    params = SamplingParams(temperature=temperature, seed=0) if temperature > 0 else SamplingParams()
    pipeline = DecodePipeline(model, DeviceSampling.build([params] * batch, model.device))
    state = dict(ids=[1] * batch, position=context, steps=0)

    def step():
        state["ids"] = pipeline.step(state["ids"], [state["position"]] * batch, [state["steps"]] * batch,
                                     [True] * batch)
        state["position"] += 1
        state["steps"] += 1
    return step


def bucket_picks_from_sweep(path: str) -> dict:
    """{bucket of rows: ((K, (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)), ...)}: per bucket and K
    the config of the least time summed over that K's projections of a step (decode_gemm_sweep.step_totals)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from decode_gemm_sweep import projections, step_totals

    with open(path) as f:
        sweep = json.load(f)
    shapes = projections(sweep.get("preset", "0.8b"))
    counts = {name: count for name, _, _, _, count in shapes}
    by_k = {name: K for name, _, K, _, _ in shapes}
    picks = {}
    for M in sorted({row["M"] for row in sweep["rows"]}):
        rows = [row for row in sweep["rows"] if row["M"] == M]
        entries = []
        for K in sorted(set(by_k.values())):
            totals = step_totals(rows, counts, by_k, K)
            if totals:
                block_m, config = min(totals, key=totals.get)
                entries.append((K, (block_m, *config)))
        picks[1 << (M - 1).bit_length()] = tuple(entries)
    return picks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("option_sets", nargs="+", help="comma-separated name=value plan options per set")
    parser.add_argument("--batches", default="2,16,64,128")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: temperature-only sampling, not greedy")
    parser.add_argument("--bucket-picks", help="a decode_gemm_sweep.py JSON: each bucket's fastest config per K "
                        "becomes its own pick (gemm.PREFERRED_DECODE_BY_ROWS) for this run")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.bucket_picks:
        from qwen_triton.operators.linear import gemm
        gemm.PREFERRED_DECODE_BY_ROWS.update(bucket_picks_from_sweep(args.bucket_picks))
        print(f"bucket picks: {gemm.PREFERRED_DECODE_BY_ROWS}")
    batches = [int(b) for b in args.batches.split(",")]
    hbm = measure_hbm_bandwidth()
    max_length = args.context + args.rounds * (args.steps + args.warmup + 1) + 8
    llms = {text: random_llm("0.8b", max_length=max_length, max_batch=max(batches), warm_up=False,
                             **plan_options(text)) for text in args.option_sets}
    times = {(text, batch): [] for text in llms for batch in batches}
    for _ in range(args.rounds):
        for batch in batches:
            for text, llm in llms.items():
                llm.model.reset()
                step = step_function(llm.model, batch, args.context, args.temperature)
                times[text, batch].append(time_calls(step, args.steps, args.warmup, back_to_back=True) * 1e3)
    config = next(iter(llms.values())).config
    rows = []
    for (text, batch), values in times.items():
        floor_us = decode_bytes(config, args.context + args.steps // 2, batch).total / (hbm * 1e12) * 1e6
        us = statistics.median(values)
        rows.append(dict(options=text, batch=batch, context=args.context, temperature=args.temperature, us=us, rounds=values, floor_us=floor_us,
                         pct_of_floor=100 * floor_us / us))
    print(f"{torch.cuda.get_device_name()}: copy {hbm:.2f} TB/s; {'greedy' if args.temperature <= 0 else f'temperature {args.temperature}'} decode step of B "
          f"rows at context {args.context}, us (median of {args.steps} steps; per round), % of floor")
    for row in rows:
        print(f"B={row['batch']:4d} {row['options'] or '(defaults)':40s} {row['us']:9.1f} "
              f"({', '.join(f'{v:.1f}' for v in row['rounds'])})  {row['pct_of_floor']:.1f}% of {row['floor_us']:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), hbm_copy_TBps=hbm, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
