"""Which kernel of a short prefill faults: each case in its own process, with CUDA_LAUNCH_BLOCKING=1 (the
error is raised at the launch that faults) and QWEN_TRITON_AUTOTUNE=first (the GPU tests' configs).

Cases: the engine (random weights, Qwen3.5-0.8B shape) scoring 12 tokens with prefills of 3, 8 and 12 (the
engine GPU tests' short prefills), and gated_delta_rule_chunked alone at the real shape at T = 1 and 2, of
this checkout and, with --baseline FILE, of another chunk.py (a copy of the file: the device has no git).
For a fault it prints the last three frames of this package on the way to the launch.

This located the fault of 2026-11-30 (commit e80ad2e) in `_chunk_state_kernel` (see chunk.py, kernel 2).

--float32-configs: instead, gated_delta_rule_chunked at the real shape at T = 4096 with dot_precision="tf32"
(float32 operands), one kernel of the chunked rule at one of its configs (each config but the first of kernel
1's two parts, the state pass and the output kernel, in turn), the other kernels at their first: which config
faults (the tuning of these kernels at this length faulted, 2026-12-01).

    python3 benchmarks/fault_probe.py [--baseline path/to/chunk.py]
    python3 benchmarks/fault_probe.py --float32-configs
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENGINE = r'''
import os, sys, traceback, torch
from qwen_triton.benchmark.models import random_llm
ids = torch.randint(0, 248_000, (12,), generator=torch.Generator().manual_seed(1)).tolist()
try:
    llm = random_llm("0.8b", backend="triton", dtype=torch.bfloat16, max_length=512, cuda_graph=False)
    llm.score(ids, prefill=int(sys.argv[1]))
    torch.cuda.synchronize()
    print("ok")
except Exception as error:
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "qwen_triton" in f.filename]
    print("fault at", [(os.path.basename(f.filename), f.lineno, f.line) for f in frames[-3:]], type(error).__name__)
'''

CHUNK = r'''
import sys, torch
sys.path.insert(0, "benchmarks")
from tests.operators import test_gated_delta_rule as helpers
length, source = int(sys.argv[1]), sys.argv[2]
if source == "checkout":
    from qwen_triton.operators.gated_delta_rule import chunk
else:
    from chunk_sweep import load_baseline
    chunk = load_baseline(source)
inputs = helpers.make_inputs(length, 16, 16, 128, 128, torch.bfloat16, "cuda", seed=1)
chunk.gated_delta_rule_chunked(*helpers.kernel_arguments(inputs), torch.zeros(16, 128, 128, device="cuda"))
torch.cuda.synchronize()
print("ok")
'''

FLOAT32_CONFIG = r'''
import sys, torch
from tests.operators import test_gated_delta_rule as helpers
from qwen_triton.operators.gated_delta_rule import chunk
name, index = sys.argv[1], int(sys.argv[2])
for other in ("inverse", "products", "state", "output"):
    kernel = getattr(chunk, f"_chunk_{other}_kernel")
    kernel.configs = [kernel.configs[index if other == name else 0]]
inputs = helpers.make_inputs(4096, 16, 16, 128, 128, torch.bfloat16, "cuda", seed=20)
state = torch.zeros(16, 128, 128, device="cuda")
chunk.gated_delta_rule_chunked(*helpers.kernel_arguments(inputs), state, dot_precision="tf32")
torch.cuda.synchronize()
print("ok", name, getattr(chunk, f"_chunk_{name}_kernel").configs[0])
'''


def float32_cases() -> list:
    from qwen_triton.operators.gated_delta_rule import chunk

    return [(f"tf32, T = 4096, {name} config {index}", FLOAT32_CONFIG, [name, str(index)])
            for name in ("inverse", "products", "state", "output")
            for index in range(1, len(getattr(chunk, f"_chunk_{name}_kernel").configs))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", help="a copy of another chunk.py to run the chunk cases of too")
    parser.add_argument("--float32-configs", action="store_true", help="the float32-operand configs at T = 4096")
    args = parser.parse_args()
    env = dict(os.environ, QWEN_TRITON_AUTOTUNE="first", CUDA_LAUNCH_BLOCKING="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    if args.float32_configs:
        cases = float32_cases()
        env.pop("QWEN_TRITON_AUTOTUNE")  # every config in the lists, each case pins its own
    else:
        cases = [(f"engine, prefill {n} of 12 tokens", ENGINE, [str(n)]) for n in (3, 8, 12)]
        for source in ["checkout"] + ([args.baseline] if args.baseline else []):
            cases += [(f"chunked ({source}), T = {n}", CHUNK, [str(n), source]) for n in (1, 2)]
    for name, script, arguments in cases:
        result = subprocess.run([sys.executable, "-c", script, *arguments], capture_output=True, text=True,
                                timeout=300, env=env, cwd=ROOT)
        last = (result.stdout.strip().splitlines() or [""])[-1]
        error = (result.stderr.strip().splitlines() or [""])[-1] if result.returncode else ""
        print(f"{name}: exit {result.returncode}: {last} {error}".rstrip(), flush=True)


if __name__ == "__main__":
    main()
