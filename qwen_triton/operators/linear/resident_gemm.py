"""The resident-weights GEMM: a decode step's projections, out[M, N] = x[M, K] @ W[N, K].T for M of 1 to 128 rows,
each program's weight slice loaded whole before it waits for the kernel that writes x.

A decode step is bound by its weight bytes: the floor of a projection is N*K*2 bytes over the HBM bandwidth, e.g.
the 0.8B's (H100, 3.0 TB/s copy): DeltaNet in-projection 8224 x 1024 5.6 us, gate/up 7168 x 1024 4.9 us, down
1024 x 3584 2.5 us, out-projections 1024 x 2048 1.4 us. The tiled GEMM (gemm.py) runs them 3-8 us past that at 16
rows (docs/decisions.md, D149, D171): its software pipeline issues its first weight tile only after the PDL wait,
so each of a step's ~96 projections pays its memory latency, its ramp and its drain one after the other.

Here a program owns BLOCK_N weight rows over one split of K (at most BLOCK_K columns) and issues the loads of that
whole slice at its entry, before `wait_for_previous_kernel`: no kernel writes the weights, so they stream while the
previous kernel drains (the GEMV's first tile does the same, gemv.py). After the wait it walks x's rows in blocks of
BLOCK_M, each block one tensor-core dot against the slice held in registers: the weights are read once for all
rows, and a row's result is the same dot whichever rows share the call (batch invariance; the split order of K
fixed as below). x comes from L2 once a program and row block (M*K*2 bytes, 32 KB at 16 rows of K = 1024).

Splits of K (SPLIT_K > 1, for the long K of down and the out-projections, where N = 1024 gives few programs): each
split's float32 partial of each row block goes to a workspace and the last of a tile's programs to arrive sums them
in split order (fusion.store_split_output; one counter a row block and column block).

Epilogues as the GEMM's (fusion.py): the folded norm's 1/rms from the rows' sums of squares, SwiGLU of paired
gate/up slices, the residual add writing the next norm's sums of squares (BLOCK_N >= SQUARES_COLUMNS). The
prologues (a norm weight, the attention gate) run as the GEMM's pass first (gemm.apply_prologue).

The launch's tiles depend on K alone (`config_for`), none autotuned: a row bucket never compiles a config another
did not, and a row's reduction is the same in every bucket.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import allow_next_kernel, launch_options, wait_for_previous_kernel
from .gemm import apply_prologue
from .fusion import (SQUARES_COLUMNS, SWIGLU, dot, epilogue_operands, load_row_squares, split_workspace,
                     store_tile)

MAX_ROWS = 128  # the rows a call takes (a decode step's largest bucket)
BLOCK_M = 16  # rows a dot: the tensor cores' smallest tile of rows
K_ALIGN = 16  # a split's columns start at multiples of this (16-byte aligned, vectorised loads)
SLICE_COLUMNS = 1024  # config_for's most columns a split: K past it splits


@triton.jit
def _resident_kernel(
    x_ptr, w_ptr, out_ptr, residual_ptr, partial_ptr, counter_ptr, norm_squares_ptr, squares_ptr,
    M, N, K, K_PER_SPLIT, PARTS,
    stride_xm, stride_wn, stride_om, stride_rm, stride_nm, stride_sm, eps,
    ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FOLDED_NORM: tl.constexpr, WRITE_SQUARES: tl.constexpr,
    BLOCK_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Weight rows pid 0 * BLOCK_N.. over split pid 1 of K, against every row of x."""
    allow_next_kernel(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    offs_k = k_start + tl.arange(0, BLOCK_K)
    k_mask = offs_k < k_end
    # the slice, K-major ([BLOCK_K, BLOCK_N] view of row-major [N, K]), before the wait: no kernel writes it
    w_offsets = offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    w_mask = k_mask[:, None] & n_mask[None, :]
    w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
    if ACTIVATION == SWIGLU:
        w_up = tl.load(w_ptr + N * stride_wn + w_offsets, mask=w_mask, other=0.0)
    else:
        w_up = w
    wait_for_previous_kernel(USE_PDL)
    for m_start in range(0, M, BLOCK_M):
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        if FOLDED_NORM:
            row_squares = load_row_squares(norm_squares_ptr, stride_nm, offs_m, M, PARTS, BLOCK_PARTS)
        else:
            row_squares = None
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = dot(x, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        if ACTIVATION == SWIGLU:
            acc_up = dot(x, w_up, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        else:
            acc_up = acc
        counter = counter_ptr + (m_start // BLOCK_M) * tl.num_programs(0) + pid_n  # the tile's, with SPLIT_K > 1
        store_tile(acc, acc_up, row_squares, K, eps, partial_ptr, counter, pid_k, out_ptr, stride_om, residual_ptr,
                   stride_rm, offs_m, offs_n, M, N, SPLIT_K, ACTIVATION, HAS_RESIDUAL, squares_ptr, stride_sm,
                   FOLDED_NORM, WRITE_SQUARES)


_workspaces: dict[int, dict] = {}  # by SPLIT_K: fusion.split_workspace's caches


def config_for(K: int, pair: bool) -> dict:
    """The launch's BLOCK_N, SPLIT_K and num_warps for a projection of K columns: K in splits of at most
    SLICE_COLUMNS, BLOCK_N = SQUARES_COLUMNS (the output's sums of squares need whole groups), 8 warps for paired
    gate/up slices."""
    return dict(BLOCK_N=SQUARES_COLUMNS, SPLIT_K=triton.cdiv(K, SLICE_COLUMNS), num_warps=8 if pair else 4)


def split_columns(K: int, split_k: int) -> int:
    """The columns of each split of K (a multiple of K_ALIGN; the last split takes what is left)."""
    return triton.cdiv(triton.cdiv(K, split_k), K_ALIGN) * K_ALIGN


def resident_gemm(x, weight, out, *, residual=None, gate=None, norm_weight=None, eps=1e-6, activation=0, pdl=False,
                  norm_squares=None, squares_out=None, config: dict | None = None):
    """Launch the prologue pass (with gate or norm_weight) and the resident-weights GEMM on checked arguments (see
    linear.linear, which checks them; M <= MAX_ROWS). config: BLOCK_N, SPLIT_K, num_warps (default: config_for)."""
    M, K = x.shape
    if M > MAX_ROWS:
        raise ValueError(f"the resident-weights GEMM takes at most {MAX_ROWS} rows, x has {M}")
    if gate is not None or norm_weight is not None:
        x = apply_prologue(x, gate, norm_weight, eps, pdl)
    N = out.shape[1]
    if config is None:
        config = config_for(K, activation == 1)  # 1: SwiGLU
    if squares_out is not None and config["BLOCK_N"] < SQUARES_COLUMNS:
        raise ValueError(f"writing the sums of squares needs BLOCK_N >= {SQUARES_COLUMNS}, not {config['BLOCK_N']}")
    split_k = config["SPLIT_K"]
    columns = split_columns(K, split_k)
    if split_k > 1:
        if columns * (split_k - 1) >= K:
            raise ValueError(f"SPLIT_K={split_k} leaves a split of K={K} empty")
        bucket = triton.next_power_of_2(M)
        partial, counters = split_workspace(_workspaces.setdefault(split_k, {}), x.device, split_k, bucket, N,
                                            triton.cdiv(bucket, BLOCK_M) * triton.cdiv(N, config["BLOCK_N"]))
    else:
        partial, counters = x, x  # never touched
    parts = 1 if norm_squares is None else norm_squares.shape[1]
    grid = (triton.cdiv(N, config["BLOCK_N"]), split_k)
    (residual_operand, squares_in, squares_operand), strides = epilogue_operands(out, residual, norm_squares,
                                                                                  squares_out)
    _resident_kernel[grid](
        x, weight, out, residual_operand, partial, counters, squares_in, squares_operand,
        M, N, K, columns, parts,
        x.stride(0), weight.stride(0), out.stride(0), *strides,
        eps,
        ACTIVATION=activation, HAS_RESIDUAL=residual is not None, FOLDED_NORM=norm_squares is not None,
        WRITE_SQUARES=squares_out is not None, BLOCK_PARTS=triton.next_power_of_2(parts), BLOCK_M=BLOCK_M,
        BLOCK_N=config["BLOCK_N"], BLOCK_K=max(16, triton.next_power_of_2(columns)), SPLIT_K=split_k, USE_PDL=pdl,
        num_warps=config["num_warps"], num_stages=1, **launch_options(pdl),
    )
    return out
