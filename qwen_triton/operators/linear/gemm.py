"""Tiled GEMM: the projections of a prefill, out[M, N] = x[M, K] @ W[N, K].T for M > 16 tokens.

Each program computes one [BLOCK_M, BLOCK_N] output tile on the tensor cores, walking K in BLOCK_K steps
(software-pipelined over num_stages buffers); programs are ordered in groups of GROUP_M row-blocks so
that concurrently running programs share weight tiles in L2. The prologues (zero-centred RMSNorm of x,
attention output gate) transform each x tile after its load; the epilogues (SwiGLU of paired gate/up
accumulators, residual add) run on the float32 accumulators before the single store (see fusion.py).

Floor for a prefill of M = 4096 tokens of Qwen3.5-0.8B (bf16; H200 ~ 990 TFLOP/s dense bf16, 4.8 TB/s):

    projection                       N x K          FLOPs 2*M*N*K   bytes (W + x + out)   compute floor
    Gated DeltaNet in-proj           10304 x 1024   86.4 G          21.1 + 8.4 + 84.4 MB  87 us
    attention in-proj                 5120 x 1024   42.9 G          10.5 + 8.4 + 41.9 MB  43 us
    MLP gate+up (swiglu, out 3584)    7168 x 1024   60.1 G          14.7 + 8.4 + 29.4 MB  61 us
    MLP down (+residual)              1024 x 3584   30.1 G           7.3 + 29.4 + 16.8 MB 30 us
    out-proj (+residual)              1024 x 2048   17.2 G           4.2 + 16.8 + 16.8 MB 17 us

At M = 4096 these are compute-bound (450-1150 FLOP/byte, above the H200's ~ 206 FLOP/byte ridge); at M of a
few dozen tokens they are bound by the weight bytes, like the GEMV.

Autotuning: BLOCK_M/N/K, GROUP_M, num_warps, num_stages per (bucket of M = next power of two, N, K,
fusions, dtypes), so a prefill of a new length reuses its bucket's choice; `cache_results=True` keeps the
choice in Triton's cache directory across processes (see linear.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import autotune_configs
from .fusion import SWIGLU, accumulate, row_rstd, store_output


def _configs() -> list[triton.Config]:
    configs = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8}, num_warps=4, num_stages=2)]
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the usual Hopper bf16 tiles
    for block_m, block_n, block_k, warps, stages in [
        (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
        (64, 64, 64, 4, 4), (64, 256, 64, 8, 3), (128, 128, 128, 8, 2),
    ]:
        configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
                                     num_warps=warps, num_stages=stages))
    return autotune_configs(configs)


CONFIGS = _configs()


def _prune(configs, named_args, **kwargs):
    """Drop tiles taller than the bucket of M, and accumulators over 128 float32 registers per thread."""
    bucket = named_args["M_BUCKET"]
    accumulators = 2 if kwargs["ACTIVATION"] == 1 else 1
    kept = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= max(bucket, 64)
        and c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * accumulators <= 128 * 32 * c.num_warps
    ]
    return kept or configs[:1]


@triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K", "ACTIVATION", "HAS_RESIDUAL", "HAS_GATE", "HAS_NORM"],
                 prune_configs_by={"early_config_prune": _prune}, restore_value=["out_ptr"], cache_results=True)
@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, residual_ptr, gate_ptr, norm_ptr,
    M, N, K, M_BUCKET,
    stride_xm, stride_wn, stride_om, stride_rm, stride_gm,
    eps,
    ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # M_BUCKET only keys the autotuning (M rounded up to a power of two)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, BLOCK_M, BLOCK_K)
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, acc_up = accumulate(
        x_ptr, stride_xm, w_ptr, stride_wn, N * stride_wn, gate_ptr, stride_gm, norm_ptr, rstd,
        offs_m, offs_n, M, N, K, 0, K,
        ACTIVATION == SWIGLU, HAS_GATE, HAS_NORM, BLOCK_M, BLOCK_N, BLOCK_K,
    )
    store_output(acc, acc_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, N,
                 ACTIVATION, HAS_RESIDUAL)


def gemm(x, weight, out, *, residual=None, gate=None, norm_weight=None, eps=1e-6, activation=0):
    """Launch the GEMM on checked arguments (see linear.linear, which checks them)."""
    M, K = x.shape
    N = out.shape[1]

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _gemm_kernel[grid](
        x, weight, out,
        out if residual is None else residual,
        x if gate is None else gate,
        x if norm_weight is None else norm_weight,
        M, N, K, triton.next_power_of_2(M),
        x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0),
        0 if gate is None else gate.stride(0),
        eps,
        ACTIVATION=activation, HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        HAS_NORM=norm_weight is not None,
    )
    return out
