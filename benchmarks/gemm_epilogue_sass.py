"""The GEMM's sm_90 code with and without the folded norm's epilogues, compiled on the CPU (no GPU needed).

For the tiles a prefill of 4096 tokens runs (TMA loads, 8 warps, 3 stages): the DeltaNet in-projection (128 x 128,
with and without the folded norm's 1/rms), gate/up (the same), down (128 x 256, residual, with and without the
sums of squares). Prints JSON: registers, stack (spills), shared memory, and the counts of shared-memory stores
(STS), loads (LDS) and barriers (BAR.SYNC) in the SASS.

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

VARIANTS = (  # name, ACTIVATION, HAS_RESIDUAL, FOLDED_NORM, WRITE_SQUARES, BLOCK_N
    ("in-projection", 0, False, False, False, 128), ("in-projection folded", 0, False, True, False, 128),
    ("gate/up", 1, False, False, False, 128), ("gate/up folded", 1, False, True, False, 128),
    ("down", 0, True, False, False, 256), ("down squares", 0, True, False, True, 256),
)


def main() -> None:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    kernel = gemm._gemm_kernel
    x = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    results = {}
    for name, activation, residual, folded, squares, block_n in VARIANTS:
        signature = {arg: "*bf16" for arg in ("out_ptr", "residual_ptr")}
        signature["x_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [128, 64]))
        signature["w_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_n, 64]))
        signature.update(partial_ptr="*fp32", counter_ptr="*i32", norm_squares_ptr="*fp32", squares_ptr="*fp32",
                         eps="fp32")
        for arg in ("M", "N", "K", "M_BUCKET", "PARTS", "stride_xm", "stride_wn", "stride_om", "stride_rm",
                    "stride_nm", "stride_sm"):
            signature[arg] = "i32"
        constants = dict(ACTIVATION=activation, HAS_RESIDUAL=residual, SPLIT_ALLOWED=False, FOLDED_NORM=folded,
                         WRITE_SQUARES=squares, BLOCK_PARTS=32, BLOCK_M=128, BLOCK_N=block_n, BLOCK_K=64,
                         GROUP_M=8, SPLIT_K=1, TMA=True, USE_PDL=False)
        for arg in kernel.arg_names:
            signature.setdefault(arg, "constexpr")
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
        path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
        with open(path, "wb") as file:
            file.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        results[name] = dict(registers=int(usage.split("REG:")[1].split()[0]),
                             stack=int(usage.split("STACK:")[1].split()[0]), shared=compiled.metadata.shared,
                             shared_stores=sass.count(" STS"), shared_loads=sass.count(" LDS"),
                             barriers=sass.count("BAR.SYNC"))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
