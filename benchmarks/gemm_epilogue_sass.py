"""The GEMM's sm_90 code with and without the folded norm's epilogues, compiled on the CPU (no GPU needed).

For the tiles a prefill of 4096 tokens runs (TMA loads, 8 warps, 3 stages): the DeltaNet in-projection (128 x 128,
with and without the folded norm's 1/rms), gate/up (the same), down (128 x 256, residual, with and without the
sums of squares); and a short prompt's down, split in four over pointer loads (64 x 64, 4 warps), with the sums.
Prints one line of JSON: registers, stack (spills), shared memory, and the counts of shared-memory stores (STS),
loads (LDS), barriers (BAR.SYNC) and tensor-core products (wgmma) in the code. The CPU test
`tests/operators/test_linear.py::test_gemm_folded_norm_epilogues_compile_for_hopper` runs it.

    TRITON_INTERPRET=0 python3 benchmarks/gemm_epilogue_sass.py
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from qwen_triton.operators.linear import gemm

VARIANTS = (  # name, ACTIVATION, HAS_RESIDUAL, FOLDED_NORM, WRITE_SQUARES, BLOCK_M, BLOCK_N, SPLIT_K, TMA, warps
    ("in-projection", 0, False, False, False, 128, 128, 1, True, 8),
    ("in-projection folded", 0, False, True, False, 128, 128, 1, True, 8),
    ("gate/up", 1, False, False, False, 128, 128, 1, True, 8),
    ("gate/up folded", 1, False, True, False, 128, 128, 1, True, 8),
    ("down", 0, True, False, False, 128, 256, 1, True, 8),
    ("down squares", 0, True, False, True, 128, 256, 1, True, 8),
    ("down squares split", 0, True, False, True, 64, 64, 4, False, 4),
)


def compile_variant(activation, residual, folded, squares, block_m, block_n, split_k, tma, warps):
    """The GEMM kernel compiled for sm_90 with these constants: (compiled kernel, its cubin's path)."""
    kernel = gemm._gemm_kernel
    x = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    signature = {arg: "*bf16" for arg in ("x_ptr", "w_ptr", "out_ptr", "residual_ptr")}
    if tma:
        signature["x_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_m, 64]))
        signature["w_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_n, 64]))
    signature.update(partial_ptr="*fp32", counter_ptr="*i32", norm_squares_ptr="*fp32", squares_ptr="*fp32",
                     eps="fp32")
    for arg in ("M", "N", "K", "M_BUCKET", "PARTS", "stride_xm", "stride_wn", "stride_om", "stride_rm",
                "stride_nm", "stride_sm"):
        signature[arg] = "i32"
    constants = dict(ACTIVATION=activation, HAS_RESIDUAL=residual, SPLIT_ALLOWED=split_k > 1, FOLDED_NORM=folded,
                     WRITE_SQUARES=squares, BLOCK_PARTS=32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                     GROUP_M=8, SPLIT_K=split_k, TMA=tma, USE_PDL=False)
    for arg in kernel.arg_names:
        signature.setdefault(arg, "constexpr")
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    with open(path, "wb") as file:
        file.write(compiled.asm["cubin"])
    return compiled, path


def main() -> None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    results = {}
    for name, *constants in VARIANTS:
        compiled, path = compile_variant(*constants)
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        results[name] = dict(registers=int(usage.split("REG:")[1].split()[0]),
                             stack=int(usage.split("STACK:")[1].split()[0]), shared=compiled.metadata.shared,
                             shared_stores=sass.count(" STS"), shared_loads=sass.count(" LDS"),
                             barriers=sass.count("BAR.SYNC"), products=compiled.asm["ptx"].count("wgmma.mma_async"))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
