"""The GEMM's sm_90 code with and without the folded norm's epilogues, compiled on the CPU (no GPU needed).

For the tiles a prefill of 4096 tokens runs (TMA loads, 8 warps, 3 stages): the DeltaNet in-projection (128 x 128,
with and without the folded norm's 1/rms), gate/up (the same), down (128 x 256, residual, with and without the
sums of squares); and a short prompt's down, split in four over pointer loads (64 x 64, 4 warps), with the sums.
Prints one line of JSON per variant's `sass_counts.compile_counts` (registers, stack, shared memory, shared-memory
stores and loads, barriers, tensor-core instructions). The CPU test
`tests/operators/test_linear.py::test_gemm_folded_norm_epilogues_compile_for_hopper` runs it. With --sequence NAME,
that variant's PTX operations in order instead (`sass_counts.operation_sequence`: where the folded norm's loads of
the sums sit against the main loop's label and branch).

    TRITON_INTERPRET=0 python3 benchmarks/gemm_epilogue_sass.py [--sequence "in-projection folded"]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from qwen_triton.operators.linear import gemm
from sass_counts import compile_counts

VARIANTS = (  # name, ACTIVATION, HAS_RESIDUAL, FOLDED_NORM, WRITE_SQUARES, BLOCK_M, BLOCK_N, SPLIT_K, TMA, warps
    ("in-projection", 0, False, False, False, 128, 128, 1, True, 8),
    ("in-projection folded", 0, False, True, False, 128, 128, 1, True, 8),
    ("gate/up", 1, False, False, False, 128, 128, 1, True, 8),
    ("gate/up folded", 1, False, True, False, 128, 128, 1, True, 8),
    ("down", 0, True, False, False, 128, 256, 1, True, 8),
    ("down squares", 0, True, False, True, 128, 256, 1, True, 8),
    ("down squares split", 0, True, False, True, 64, 64, 4, False, 4),
)
FLOAT32_POINTERS = ("partial_ptr", "norm_squares_ptr", "squares_ptr")
INTEGERS = ("M", "N", "K", "M_BUCKET", "PARTS")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequence", metavar="NAME", choices=[variant[0] for variant in VARIANTS],
                        help="print this variant's PTX operation sequence instead of the counts")
    args = parser.parse_args()
    x = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    results = {}
    for name, activation, residual, folded, squares, block_m, block_n, split_k, tma, warps in VARIANTS:
        if args.sequence and name != args.sequence:
            continue
        types = dict({pointer: "*fp32" for pointer in FLOAT32_POINTERS}, counter_ptr="*i32",
                     **{integer: "i32" for integer in INTEGERS})
        if tma:
            types["x_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_m, 64]))
            types["w_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_n, 64]))
        constants = dict(ACTIVATION=activation, HAS_RESIDUAL=residual, SPLIT_ALLOWED=split_k > 1, FOLDED_NORM=folded,
                         WRITE_SQUARES=squares, BLOCK_PARTS=32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                         GROUP_M=8, SPLIT_K=split_k, TMA=tma, USE_PDL=False)
        counts = compile_counts(gemm._gemm_kernel, constants, warps, 3, sequence=bool(args.sequence), types=types)
        if args.sequence:
            print(counts["sequence"])
            return
        results[name] = {key: counts[key] for key in ("registers", "stack_bytes", "shared_bytes", "shared_stores",
                                                      "shared_loads", "barriers", "tensor_core")}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
