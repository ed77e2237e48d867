"""The greedy LM head at the real shape: lm_head_argmax against lm_head_argmax_screened, each kernel of the screened
head, and the screen kernel's tiles.

Random bf16 weights [248320, 1024] (scale 0.05), the final norm fused, M rows of x (--rows; 1 by default). Each
head is timed back to back in a CUDA graph (CALLS calls a graph, the median of REPLAYS replays, per call); the
kernels' own durations come from the CUDA profiler over the same calls. Prints and writes JSON:

    python3 benchmarks/screened_lm_head.py [--out screened.json] [--rows 1,4] \
        [--tiles "128,128,4,3 64,256,4,3"]   (SCREEN_ROWS, SCREEN_COLUMNS, SCREEN_WARPS, SCREEN_STAGES)

(The fifteenth session's numbers, docs/perf-notes.md, came from this script at commits 54db482 - 4e6e798, which
captured and replayed the graph itself; since then it calls the harness's `time_graph`, the same method.)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.lm_head import lm_head_argmax
from qwen_triton.operators.lm_head import screened

VOCAB, HIDDEN, CALLS, REPLAYS = 248320, 1024, 10, 20


def graph_time_us(fn) -> float:
    """Median time of one call, CALLS calls back to back in a CUDA graph (harness.time_graph), after a warm-up."""
    fn()
    torch.cuda.synchronize()
    return time_graph(fn, calls=CALLS, replays=REPLAYS) * 1e3


def kernel_us(fn) -> dict:
    """Each kernel's mean duration over CALLS calls (CUDA profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals.setdefault(event.name, []).append(event.device_time)
    return {name: statistics.mean(values) for name, values in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--rows", default="1", help="comma-separated batch sizes M")
    parser.add_argument("--tiles", default="128,128,4,3 64,256,4,3 128,256,4,4 256,256,8,3")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05).to("cuda", torch.bfloat16)
    norm_weight = (torch.randn(HIDDEN, generator=generator) * 0.3).to("cuda", torch.bfloat16)
    screen = screened.build_screen(weight)
    report = dict(device=torch.cuda.get_device_name(), vocab=VOCAB, hidden=HIDDEN,
                  screen_bytes=screened.screened_lm_head_bytes(VOCAB, HIDDEN), full_bytes=weight.numel() * 2,
                  batches=[])
    for M in (int(m) for m in args.rows.split(",")):
        x = torch.randn(M, HIDDEN, generator=generator).to("cuda", torch.bfloat16)
        out = torch.empty(M, dtype=torch.int64, device="cuda")

        def full():
            lm_head_argmax(x, weight, out, norm_weight=norm_weight)

        def screened_head():
            screened.lm_head_argmax_screened(x, weight, screen, out, norm_weight=norm_weight)

        batch = dict(rows=M, full_us=graph_time_us(full), full_kernels_us=kernel_us(full), screened=[])
        full_ids = out.clone()
        for tiles in args.tiles.split():
            block_v, block_k, warps, stages = (int(v) for v in tiles.split(","))
            screened.SCREEN_ROWS, screened.SCREEN_COLUMNS = block_v, block_k
            screened.SCREEN_WARPS, screened.SCREEN_STAGES = warps, stages
            try:
                us = graph_time_us(screened_head)
                kernels = kernel_us(screened_head)
                same = bool(torch.equal(out, full_ids))
                candidates = screened.candidate_counts(x, VOCAB)
            except Exception as error:  # a tile that does not compile or fit: reported, the others still run
                batch["screened"].append(dict(tiles=tiles, error=repr(error)[:300]))
                print(f"M {M}, tiles {tiles}: {error!r}"[:300])
                continue
            batch["screened"].append(dict(tiles=tiles, us=us, kernels_us=kernels, same_ids=same,
                                          candidates=candidates))
            print(f"M {M}, tiles {tiles}: {us:.1f} us a call (full head {batch['full_us']:.1f}), candidates "
                  f"{candidates}, same ids {same}; "
                  + ", ".join(f"{name.split('(')[0][-24:]} {t:.1f}" for name, t in kernels.items()))
        report["batches"].append(batch)
    print(f"floor of the screen {report['screen_bytes'] / 4.2e6:.1f} us, of the full head "
          f"{report['full_bytes'] / 4.2e6:.1f} us at 4.2 TB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
