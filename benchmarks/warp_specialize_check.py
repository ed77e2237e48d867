"""Whether Triton's warp specialisation reaches Hopper: a TMA matmul compiled for sm_90 on the CPU, its K loop
as `tl.range(..., warp_specialize=False)` and `=True`, and the two PTX texts compared.

No GPU: Triton compiles for an sm_90 target with its bundled ptxas. Prints, for each setting, the PTX's length
and whether it holds the register reallocation (`setmaxnreg`) that producer/consumer warp groups use; equal
texts mean the option changed nothing for this target.

    TRITON_INTERPRET=0 python3 benchmarks/warp_specialize_check.py
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource


@triton.jit
def _matmul(x_desc, w_desc, out_ptr, K, stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        acc = tl.dot(x_desc.load([pid_m * BLOCK_M, k0]), w_desc.load([pid_n * BLOCK_N, k0]).T, acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(tl.bfloat16))


def ptx(warp_specialize: bool) -> str:
    signature = {"x_desc": "tensordesc<bf16[128, 64]>", "w_desc": "tensordesc<bf16[128, 64]>", "out_ptr": "*bf16",
                 "K": "i32", "stride_om": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                 "BLOCK_K": "constexpr", "WARP_SPECIALIZE": "constexpr"}
    constexprs = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "WARP_SPECIALIZE": warp_specialize}
    attrs = {(2,): [["tt.divisibility", 16]], (4,): [["tt.divisibility", 16]]}
    compiled = triton.compile(ASTSource(fn=_matmul, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3))
    return compiled.asm["ptx"]


def main() -> None:
    texts = {setting: ptx(setting) for setting in (False, True)}
    for setting, text in texts.items():
        print(f"warp_specialize={setting}: PTX {len(text)} characters, setmaxnreg {'setmaxnreg' in text}")
    print("identical PTX" if texts[False] == texts[True] else "the PTX differs")


if __name__ == "__main__":
    main()
