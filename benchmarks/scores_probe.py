"""Which configs of the chunked rule's output kernel form the chunks' scores correctly on the GPU (SCORES_IN_OUTPUT).

For each output config (pinned) in a process of its own (an illegal address ends that process, not the probe), at 200
and 4096 tokens (kernel 1 split, chunks of 64), without and with the output norm: the output with kernel 3 forming the
scores against the output with kernel 3 reading the products kernel's, the same config; one line of JSON each (the
Frobenius and max differences relative to the latter), or the process's last error line.

    python3 benchmarks/scores_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASE = r"""
import json, sys, torch
sys.path.insert(0, {root!r})
from qwen_triton.operators.gated_delta_rule import chunk
from tests.operators.test_gated_delta_rule import make_inputs, kernel_arguments, random_state
chunk.SPLIT_PREPARE_TOKENS = 199
config = chunk.OUTPUT_CONFIGS[{index}]
kernel = chunk._chunk_output_kernel
weight = torch.linspace(0.5, 1.5, 128, device="cuda", dtype=torch.bfloat16)
for length in (200, 4096):
    inputs = make_inputs(length, 16, 16, 128, 128, torch.bfloat16, "cuda", seed=7)
    initial = random_state((16, 128, 128), "cuda") * 0.2
    for norm in (False, True):
        outs = {{}}
        for here in (False, True):
            chunk.SCORES_IN_OUTPUT = here
            kernel.configs, kernel.cache = [config], {{}}
            out = chunk.gated_delta_rule_chunked(*kernel_arguments(inputs), initial.clone(), chunk_size=64,
                                                 output_norm=(inputs["z"], weight, 1e-6) if norm else None)
            torch.cuda.synchronize()
            outs[here] = out.float()
        difference = outs[True] - outs[False]
        print(json.dumps(dict(length=length, norm=norm, frobenius=float(difference.norm() / outs[False].norm()),
                              max=float(difference.abs().max() / outs[False].abs().max()))), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    from qwen_triton.operators.gated_delta_rule import chunk
    rows = []
    environment = dict(os.environ, QWEN_TRITON_AUTOTUNE="first")  # the other kernels untuned: their first configs
    for index, config in enumerate(chunk.OUTPUT_CONFIGS):
        name = f"BLOCK_V={config.kwargs['BLOCK_V']} warps={config.num_warps}"
        run = subprocess.run([sys.executable, "-c", CASE.format(root=root, index=index)], capture_output=True,
                             text=True, timeout=300, env=environment)
        for line in run.stdout.strip().splitlines():
            rows.append(dict(config=name, **json.loads(line)))
            print(json.dumps(rows[-1]), flush=True)
        if run.returncode != 0:
            rows.append(dict(config=name, error=(run.stderr.strip().splitlines() or ["?"])[-1][:300]))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
