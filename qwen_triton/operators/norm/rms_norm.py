"""Qwen3.5's zero-centred RMSNorm: out = x / sqrt(mean(x^2) + eps) * (1 + weight), float32 math, x's dtype out.

x [M, N] (rows may be strided), weight [N] -> out [M, N]. One program per row: a row of N = 1024 bf16 is
2 KB, held in registers between the sum of squares and the scaling when N <= BLOCK_N (one read of x),
read twice (from L1/L2) otherwise.

`row_squares` writes only the rows' sums of squares, what a projection with its norm folded into its weights
needs of the rows (linear(norm_squares=...)): at M = 4096, N = 1024 it reads 8.4 MB and writes 16 KB.

Floor (hidden 1024, bf16): bytes 2*M*N*2 + N*2 (x in, out, weight), FLOPs ~ 4*M*N. At M = 1: 4 KB,
launch-bound (~2 us); at M = 4096 prefill tokens: 16.8 MB, 3.5 us at 4.8 TB/s. Inside the model the
pre-projection norms are fused into the projections (linear(norm_weight=...)); this kernel is the final
norm and a stand-alone fallback.

Autotuning: num_warps per (N, dtypes), cached on disk like the projections (see linear/linear.py);
`restore_value` keeps an in-place call (out is x) from normalising x once per benchmark run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_tensor

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_BLOCK_N = 8192


@triton.autotune(configs=autotune_configs([triton.Config({}, num_warps=w) for w in (4, 1, 2, 8)]),
                 key=["N", "BLOCK_N"], restore_value=["out_ptr"], cache_results=True)
@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, N, stride_xm, stride_om, eps,
                     BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    out_row = out_ptr + row * stride_om
    offs = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = offs < N
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + offs, (x * rstd * (1.0 + weight)).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        squares = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            mask = n0 + offs < N
            x = tl.load(x_row + n0 + offs, mask=mask, other=0.0).to(tl.float32)
            squares += x * x
        rstd = tl.math.rsqrt(tl.sum(squares, axis=0) / N + eps)
        for n0 in range(0, N, BLOCK_N):
            mask = n0 + offs < N
            x = tl.load(x_row + n0 + offs, mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(weight_ptr + n0 + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + n0 + offs, (x * rstd * (1.0 + weight)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_squares_kernel(x_ptr, out_ptr, N, PARTS, stride_xm, stride_om, BLOCK_N: tl.constexpr,
                        BLOCK_PARTS: tl.constexpr):
    """out[row, 0] = sum(x[row]^2) in float32, out[row, 1:PARTS] = 0. One program per row."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    squares = tl.zeros([BLOCK_N], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        x = tl.load(x_ptr + row * stride_xm + n0 + offs, mask=n0 + offs < N, other=0.0).to(tl.float32)
        squares += x * x
    parts = tl.arange(0, BLOCK_PARTS)
    total = tl.where(parts == 0, tl.sum(squares, axis=0), 0.0)
    tl.store(out_ptr + row * stride_om + parts, total, mask=parts < PARTS)


def row_squares(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of squares of each row of x [M, N] in float32, as a folded norm reads it (linear's norm_squares):
    out [M, P] float32 (default P = 1) holds each row's sum in its first column and zeros in the others."""
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, N = x.shape
    if out is None:
        out = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    else:
        check_tensor("out", out, shape=(M, None), dtype=(torch.float32,))
        if out.shape[1] == 0:
            raise ValueError("out has no columns: it needs at least one, for the rows' sums")
    check_same_device(x=x, out=out)
    if M == 0:
        return out
    _row_squares_kernel[(M,)](x, out, N, out.shape[1], x.stride(0), out.stride(0),
                              BLOCK_N=min(triton.next_power_of_2(max(N, 1)), MAX_BLOCK_N),
                              BLOCK_PARTS=triton.next_power_of_2(out.shape[1]), num_warps=4)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm of each row of x [M, N] with weight [N]; out [M, N] in x's dtype."""
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, N = x.shape
    check_tensor("weight", weight, shape=(N,), dtype=FLOAT_DTYPES)
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, shape=(M, N), dtype=x.dtype)
    check_same_device(x=x, weight=weight, out=out)
    if M == 0 or N == 0:
        return out
    block_n = min(triton.next_power_of_2(N), MAX_BLOCK_N)
    # out may be x itself (in place): each row is read before it is written, by the same program
    _rms_norm_kernel[(M,)](x, weight, out, N, x.stride(0), out.stride(0), eps, BLOCK_N=block_n, ONE_PASS=N <= block_n)
    return out


def benchmark_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """The final norm of Qwen3.5-0.8B at decode (M = 1) and prefill (M = 4096): callables, bytes, FLOPs."""
    cases = []
    hidden = 1024
    weight = torch.randn(hidden, device=device, dtype=dtype) * 0.1
    for M in (1, 4096):
        x = torch.randn(M, hidden, device=device, dtype=dtype)
        out = torch.empty_like(x)
        cases.append(dict(
            name=f"rms_norm M={M} N={hidden}",
            fn=lambda x=x, out=out: rms_norm(x, weight, 1e-6, out=out),
            bytes=2 * M * hidden * x.element_size() + hidden * weight.element_size(),
            flops=4 * M * hidden,
        ))
    return cases
