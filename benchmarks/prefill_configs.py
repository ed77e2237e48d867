"""The engine's prefill with each config of one prefill kernel pinned: which config is fastest where it runs.

A kernel's own sweep (benchmarks/chunk_sweep.py, gemm_sweep.py) times it back to back on copies of its
inputs; in a prefill it runs between other kernels, on inputs they have just written. This script builds the
0.8B model (random weights, bf16), and for each config of the kernel: pins it (the kernel's only config,
its tuning cache cleared), drops the prefill's CUDA graphs, and times the prefill as `qwen-triton bench`
does (`time_calls`: reset + prefill of the same random prompt, each timed by CUDA events, the graph
captured in the warm-up), and the kernel's own duration inside the replayed graph (the median over its
launches of 3 prefills, from the CUDA profiler).

--settings NAME=VALUE ... runs the whole sweep once per setting of a module constant of chunk.py (e.g.
SHORT_PROMPT_TOKENS=0 and =256: the short-prompt pins off and on, SHORT_PROMPT_CHUNKS=0 and =4 before
2026-12-01; at commit 4ca1bd6 it compared the state pass with and without the output), or of another module
named in full
(qwen_triton.operators.linear.gemm.TMA_ROWS=257: the GEMM's TMA loads from 257 rows on; at commits 4109275
and 8e66760 it compared the GEMM's pointer and TMA loads, and a persistent TMA kernel since removed, as
USE_TMA / USE_PERSISTENT); --configs pinned keeps the kernel's own config choice instead of each config in
turn.

    python3 benchmarks/prefill_configs.py [--kernel chunk_prepare|chunk_state|chunk_output|causal_conv1d|gemm]
        [--tokens 128,256] [--steps 30] [--out f.json]
        [--settings SHORT_PROMPT_TOKENS=0 SHORT_PROMPT_TOKENS=256] [--configs all|pinned]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from qwen_triton.benchmark.harness import EngineRunner, set_module_constant, time_calls
from qwen_triton.benchmark.profile import cuda_kernel_events
from qwen_triton.operators.attention.qk_norm_rotary import _qk_norm_rotary_kernel
from qwen_triton.operators.conv.causal_conv1d import _causal_conv1d_kernel
from qwen_triton.operators.gated_delta_rule import chunk
from qwen_triton.operators.linear import gemm

KERNELS = {
    "chunk_prepare": chunk._chunk_prepare_kernel,
    "chunk_state": chunk._chunk_state_kernel,
    "chunk_output": chunk._chunk_output_kernel,
    "causal_conv1d": _causal_conv1d_kernel,
    "qk_norm_rotary": _qk_norm_rotary_kernel,
    "gemm": gemm._gemm_tma_split,  # the prefill's GEMM from 257 tokens on (below that, _gemm_split)
}


def describe(config) -> str:
    settings = " ".join(f"{key}={value}" for key, value in config.kwargs.items())
    return f"{settings} warps={config.num_warps} stages={config.num_stages}".strip()


def kernel_durations_us(run, name: str, repeats: int = 3) -> list[float]:
    """Durations of the kernels named `name` over `repeats` calls of run(), from the CUDA profiler (the
    events `qwen-triton profile` reads)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(repeats):
            run()
        torch.cuda.synchronize()
    return [end - start for _, start, end in cuda_kernel_events(profiler, {name})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="chunk_prepare")
    parser.add_argument("--tokens", default="128,256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--settings", nargs="*", default=[""],
                        help="NAME=VALUE module constants of chunk.py, or package.module.NAME=VALUE")
    parser.add_argument("--configs", choices=["all", "pinned"], default="all")
    parser.add_argument("--out")
    args = parser.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    kernel = KERNELS[args.kernel]
    configs = list(kernel.configs)
    runner = EngineRunner("triton+split_k+cuda_graph", "0.8b", max(lengths) + 8, "cuda", torch.bfloat16)
    model = runner.model
    generator = torch.Generator().manual_seed(0)
    rows = []
    for setting in args.settings:
        if setting:
            # NAME=VALUE: a constant of chunk.py; package.module.NAME=VALUE: of that module
            set_module_constant(setting, None if "." in setting.split("=", 1)[0] else chunk)
        for length in lengths:
            token_ids = torch.randint(0, model.config.vocab_size, (length,), generator=generator).to("cuda")
            for config in configs if args.configs == "all" else [None]:
                kernel.configs, kernel.cache = configs if config is None else [config], {}
                model._prefill_graphs.clear()
                model._prefill_seen.clear()
                ms = time_calls(lambda: runner.prefill(token_ids), steps=args.steps, warmup=3)
                durations = kernel_durations_us(lambda: runner.prefill(token_ids), f"_{args.kernel}_kernel")
                label = "pinned" if config is None else describe(config)
                rows.append(dict(tokens=length, setting=setting, config=label, prefill_ms=ms, launches=len(durations),
                                 kernel_us=statistics.median(durations) if durations else None))
                print(f"T={length} {setting} {label}: prefill {ms:.3f} ms, kernel {rows[-1]['kernel_us'] or 0:.1f} us "
                      f"(median of {len(durations)})", flush=True)
    kernel.configs, kernel.cache = configs, {}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), kernel=args.kernel, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
