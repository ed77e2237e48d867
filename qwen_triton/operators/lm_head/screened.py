"""Greedy LM head through an int8 screen: the exact argmax of x @ W^T, reading W's int8 copy and a few rows of W.

The greedy LM head reads all of W (248320 x 1024 bf16, 508.6 MB: a third of a decode step's bytes) to find one
row. Most rows are far from the maximum, and a cheap approximation with a guaranteed error bound can rule
them out. So a copy of W rounded to int8 with one scale a row (254.3 MB, made at load by `build_screen`) is read
instead, and only the rows the bound cannot rule out are read from W and computed exactly.

For the row x_n (x after the final RMSNorm, rounded to x's dtype as the projections' prologue rounds it):
    x_n = s_x q_x + r_x         q_x = round(x_n / s_x) in [-127, 127], s_x = max|x_n| / 127
    W_i = s_i q_i + d_i         q_i = round(W_i / s_i), s_i = max|W_i| / 127 (build_screen)
    c_i = s_i s_x (q_i . q_x)   the screen's logit: an exact integer dot product (|q_i . q_x| < 2^24, so exact
                                in int32 and in float32), then two float32 multiplications
and the exact logit the check computes, E_i = fl(W_i . x_n) in float32, obeys
    |E_i - c_i| <= B_i = (||d_i|| + h_i) ||x_n|| + s_i ||q_i|| ||r_x||  (x 1.001, + 1e-6 |c_i|: the float32
                                roundings of c_i and of the norms), h_i = 1.2e-4 ||W_i|| bounding the float32
                                summation of E_i over 1024 terms (K u / (1 - K u) = 6.1e-5 for any order;
                                in proportion to K beyond: `summation_bound`)
(Cauchy-Schwarz on W_i . x_n - s_i s_x q_i . q_x = d_i . x_n + s_i q_i . r_x.) With tau = max_i (c_i - B_i)
<= max_i E_i, the row r of the greatest E (lowest index on ties) has c_r + B_r >= E_r >= tau: every row whose
upper bound c_i + B_i reaches tau is a candidate, r among them, and the argmax of E over the candidates, ties to
the lowest index, is r. The result is the exact greedy choice, not an approximation; only the number of
candidates depends on the data (at the 0.8B shape with random weights 1 to 410 of 248,320 in the measurements of
docs/decisions.md, D39; all rows in the worst case, equal rows say, which is then slow, never wrong).

Four kernels (a row's result does not depend on its batch: its integers, bounds and checks are its own):
0. `_quantize_kernel`, grid (M,): x_n, s_x, q_x and the norms of x_n and r_x of a row, into a workspace.
1. `_screen_kernel`, grid (V / BLOCK_V, M / 16): BLOCK_V rows of q against the q_x of 16 rows of x as one
   tensor-core product (int8, int32 accumulation; the rows of x are B's 16 columns, N = 16 being the product's
   least), pipelined as a GEMM: the int8 head is read once for up to 16 rows. It stores each row's upper bounds
   c_i + B_i and folds their greatest lower bound into the row's tau (a float atomic max).
2. `_check_kernel`, grid (V / BLOCK_R, M), BLOCK_R = 128 x M up to 2,048 (`check_rows`: about as many programs for
   M rows as for one): the rows of its BLOCK_R whose upper bound reaches tau are read whole from W, one after the
   other, and their logits computed against x_n in float32 (a row's logit does not depend on which other rows are
   candidates); it stores its (max, lowest index of the max).
3. argmax.py's `_argmax_reduce_kernel` folds those in a fixed order, keeps tau for `candidate_counts` and resets
   it to -inf for the next call.

Floor at M = 1 (Qwen3.5-0.8B): 254.3 MB of int8 weights + 3 MB of scales and bounds + 1 MB of upper bounds
written and read + the candidates' rows (2 KB each): ~62 us at the H200's 4.2 TB/s, against the bf16 head's 120.
Measured on the H200 (random weights, commit 1b1f8e1; docs/decisions.md, D39): 72.4 us a call against
124.8 for lm_head_argmax, the screen kernel 61.7 us (4.12 TB/s), 130 candidates; in the engine's decode step
559.3 against 624.9 us at context 128 (D39). For 4 rows (commit 0b19ff3; D37): 85.8 us
against 465.9 for lm_head_argmax, which reads the bf16 head once a row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import (allow_next_kernel, check_same_device, check_tensor, interpreting, launch_options,
                      wait_for_previous_kernel)
from .argmax import FLOAT_DTYPES, INT32_MAX, _argmax_reduce_kernel, reduce_block

# the kernels' tiles
SCREEN_ROWS = 128  # BLOCK_V of kernel 1: q rows a program
SCREEN_COLUMNS = 128  # BLOCK_K of kernel 1: the columns of a q tile
SCREEN_WARPS = 4
SCREEN_STAGES = 3
CHECK_ROWS = 128  # BLOCK_R of kernel 2 for one row of x (check_rows; docs/decisions.md, D170)
CHECK_ROWS_MOST = 2048  # ... and its largest, for 16 rows or more
QUANTIZED_MAX = 127.0
SUMMATION_BOUND = 1.2e-4  # h_i / ||W_i||: twice K u / (1 - K u) for K = 1024 columns, u = 2^-24 (summation_bound)
MAX_COLUMNS = 8192  # K of kernel 0's one-pass row statistics (a [BLOCK_X] vector of the row; the 27B's 5,120)
# The interpreter pays per program and per operation, each over a whole tile: a head of more than
# INTERPRETER_WIDE_V rows gets INTERPRETER_ROWS rows a program there in kernels 1 and 2, and kernel 1 no
# wider a K step than the head (the tests' small heads keep the tiles above)
INTERPRETER_WIDE_V = 4096
INTERPRETER_ROWS = 8192


def row_warps(block_x: int) -> int:
    """The warps of kernels 0 and 2, which hold a whole row of x ([BLOCK_X] float32): 4, and 8 past 4,096 columns
    (the same registers a thread)."""
    return 4 if block_x <= 4096 else 8


def check_rows(M: int) -> int:
    """BLOCK_R of kernel 2 for M rows of x: CHECK_ROWS a row, at most CHECK_ROWS_MOST, so that M rows launch about as
    many programs as one (V / CHECK_ROWS, 1,940 at the real vocabulary; 128 rows a program at 16 rows launched
    31,040, 36.8 us of the 0.8B's 16-row step on the H100)."""
    return min(CHECK_ROWS * triton.next_power_of_2(M), CHECK_ROWS_MOST)


def _tiles(V: int, K: int, M: int = 1) -> tuple[int, int, int]:
    """(BLOCK_V and BLOCK_K of kernel 1, BLOCK_R of kernel 2) for a head of V rows of K columns and M rows of x
    (screened_top_k.py's check keeps CHECK_ROWS at every M: its rows hold 10-20 times greedy's candidates, each
    read one after the other by its program)."""
    if interpreting() and V > INTERPRETER_WIDE_V:
        return INTERPRETER_ROWS, min(SCREEN_COLUMNS, max(16, triton.next_power_of_2(K))), INTERPRETER_ROWS
    return SCREEN_ROWS, SCREEN_COLUMNS, check_rows(M)


class LmHeadScreen(NamedTuple):
    """W's int8 copy for `lm_head_argmax_screened`: q [V, K] int8, and per row (float32 [V]) the scale s_i, the
    bound ||d_i|| + h_i on the rounding's and the check's error, and s_i ||q_i||."""

    quantized: torch.Tensor
    scales: torch.Tensor
    residual_bounds: torch.Tensor
    quantized_norms: torch.Tensor


def summation_bound(columns: int) -> float:
    """h_i / ||W_i|| for rows of `columns` entries: SUMMATION_BOUND up to 1024 columns, beyond in proportion to K
    (K u / (1 - K u) grows as K while K u << 1: at 4096 columns 4.8e-4, twice 2.44e-4)."""
    return SUMMATION_BOUND * max(1.0, columns / 1024)


def build_screen(weight: torch.Tensor, rows_per_piece: int = 16384) -> LmHeadScreen:
    """The screen of weight [V, K] (bf16, fp16 or fp32), on its device, a piece of rows at a time (float64 norms,
    rounded up to float32)."""
    check_tensor("weight", weight, shape=(None, None), dtype=FLOAT_DTYPES, contiguous=True)
    rows, columns = weight.shape
    if columns > MAX_COLUMNS:
        raise ValueError(f"weight has {columns} columns, at most {MAX_COLUMNS} supported")
    quantized = torch.empty(rows, columns, dtype=torch.int8, device=weight.device)
    scales, residual_bounds, quantized_norms = (torch.empty(rows, dtype=torch.float32, device=weight.device)
                                                for _ in range(3))
    for start in range(0, rows, rows_per_piece):
        piece = weight[start:start + rows_per_piece].double()
        largest = piece.abs().amax(dim=1)
        # the scale rounded to the float32 the kernels multiply by, so q and the bounds are about that scale
        scale = torch.where(largest > 0, largest / QUANTIZED_MAX, torch.ones_like(largest)).float().double()
        q = torch.round(piece / scale[:, None]).clamp(-QUANTIZED_MAX, QUANTIZED_MAX)
        residual = (piece - scale[:, None] * q).norm(dim=1) + summation_bound(columns) * piece.norm(dim=1)
        quantized[start:start + rows_per_piece] = q.to(torch.int8)
        scales[start:start + rows_per_piece] = scale.float()
        residual_bounds[start:start + rows_per_piece] = _rounded_up(residual)
        quantized_norms[start:start + rows_per_piece] = _rounded_up(scale * q.norm(dim=1))
    return LmHeadScreen(quantized, scales, residual_bounds, quantized_norms)


def screened_lm_head_bytes(vocabulary: int, hidden: int) -> int:
    """The bytes a call at M = 1 must move besides the candidates' rows: the int8 copy, three floats a row read,
    the upper bounds written and read back (M rows up to 16: the same but M upper bounds a row)."""
    return vocabulary * hidden + 3 * 4 * vocabulary + 2 * 4 * vocabulary


def _rounded_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> float32, never below the float64 value."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.full_like(rounded, float("inf"))),
                       rounded)


@triton.jit
def _quantize_kernel(
    x_ptr, norm_ptr, normed_ptr, quantized_x_ptr, statistics_ptr, K, stride_xm, eps,
    HAS_NORM: tl.constexpr, BLOCK_X: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per row of x: x_n (the final norm, rounded to x's dtype as the projections' prologue rounds it,
    linear/fusion.py) into normed [M, K] float32; q_x into row m of quantized_x [16 G, K] int8 (G = cdiv(M, 16);
    the rows past M stay zero); s_x, ||x_n||, ||r_x|| into statistics [M, 3]."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    columns = tl.arange(0, BLOCK_X)
    mask = columns < K
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + columns, mask=mask, other=0.0)
    if HAS_NORM:
        wide = x.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(wide * wide, axis=0) / K + eps)
        weight = tl.load(norm_ptr + columns, mask=mask, other=0.0).to(tl.float32)
        x = (wide * rstd * (1.0 + weight)).to(x.dtype)
    normed = x.to(tl.float32)
    largest = tl.max(tl.abs(normed), axis=0)
    scale_x = tl.where(largest > 0.0, largest / 127.0, 1.0)
    q_x = tl.minimum(tl.maximum(tl.floor(normed / scale_x + 0.5), -127.0), 127.0)
    residual = normed - scale_x * q_x
    tl.store(normed_ptr + row * K + columns, normed, mask=mask)
    tl.store(quantized_x_ptr + row * K + columns, q_x.to(tl.int8), mask=mask)
    tl.store(statistics_ptr + row * 3, scale_x)
    tl.store(statistics_ptr + row * 3 + 1, tl.sqrt(tl.sum(normed * normed, axis=0)))
    tl.store(statistics_ptr + row * 3 + 2, tl.sqrt(tl.sum(residual * residual, axis=0)))


@triton.jit
def _quantized_products(quantized_ptr, quantized_x_ptr, offs_v, v_mask, group, K, stride_qv,
                        BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_V, 16] int32: the rows offs_v of q against the q_x of the 16 rows of x of `group` (one tensor-core int8
    product, int32 accumulation; the rows of x are B's 16 columns, zero past M), pipelined over K as a GEMM."""
    q_rows = offs_v.to(tl.int64) * stride_qv
    x_rows = quantized_x_ptr + (group * 16 + tl.arange(0, 16)) * K
    dot = tl.zeros([BLOCK_V, 16], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        q = tl.load(quantized_ptr + q_rows[:, None] + offs_k[None, :], mask=v_mask[:, None] & k_mask[None, :],
                    other=0)
        x = tl.load(x_rows[:, None] + offs_k[None, :], mask=k_mask[None, :], other=0)  # [16, BLOCK_K]
        dot = tl.dot(q, tl.trans(x), acc=dot, out_dtype=tl.int32)
    return dot


@triton.jit
def _screen_bounds(dot, offs_v, v_mask, rows, row_mask, scale_ptr, residual_bound_ptr, quantized_norm_ptr,
                   statistics_ptr, SINGLE: tl.constexpr):
    """(c_i, B_i) of the tile's rows against each row of x: [BLOCK_V] vectors of row 0 alone for SINGLE (its column
    of dot; measured faster than the [BLOCK_V, 16] epilogue), else [BLOCK_V, 16]."""
    scale_v = tl.load(scale_ptr + offs_v, mask=v_mask, other=0.0)
    residual_bound = tl.load(residual_bound_ptr + offs_v, mask=v_mask, other=0.0)
    quantized_norm = tl.load(quantized_norm_ptr + offs_v, mask=v_mask, other=0.0)
    if SINGLE:
        scale_x = tl.load(statistics_ptr)
        x_norm = tl.load(statistics_ptr + 1)
        r_norm = tl.load(statistics_ptr + 2)
        approximate = tl.sum(tl.where(rows[None, :] == 0, dot, 0), axis=1).to(tl.float32) * scale_x * scale_v
        bound = (residual_bound * x_norm + quantized_norm * r_norm) * 1.001 + tl.abs(approximate) * 1e-6
    else:
        scale_x = tl.load(statistics_ptr + rows * 3, mask=row_mask, other=1.0)
        x_norm = tl.load(statistics_ptr + rows * 3 + 1, mask=row_mask, other=0.0)
        r_norm = tl.load(statistics_ptr + rows * 3 + 2, mask=row_mask, other=0.0)
        approximate = dot.to(tl.float32) * scale_x[None, :] * scale_v[:, None]
        bound = (residual_bound[:, None] * x_norm[None, :] + quantized_norm[:, None] * r_norm[None, :]) * 1.001 \
            + tl.abs(approximate) * 1e-6
    return approximate, bound


@triton.jit
def _screen_kernel(
    quantized_ptr, scale_ptr, residual_bound_ptr, quantized_norm_ptr, quantized_x_ptr, statistics_ptr,
    upper_ptr, threshold_ptr,
    M, V, K, stride_qv,
    SINGLE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """BLOCK_V rows of q against the q_x of 16 rows of x (one tensor-core int8 product, int32 accumulation: the
    16 rows of a group are B's 16 columns, zero past M): for each row of x the rows' upper bounds c_i + B_i
    stored, their greatest lower bound c_i - B_i folded into its tau. A column's integers do not depend on the
    other columns, nor the row's check: a row's id does not depend on its batch (its bounds can differ in the last
    bit between the one-row epilogue, SINGLE, and the batch's, where the compiler contracts differently; the
    check's exact logits, which decide, cannot)."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    group = tl.program_id(1)
    offs_v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    rows = group * 16 + tl.arange(0, 16)
    row_mask = rows < M
    dot = _quantized_products(quantized_ptr, quantized_x_ptr, offs_v, v_mask, group, K, stride_qv, BLOCK_V, BLOCK_K)
    approximate, bound = _screen_bounds(dot, offs_v, v_mask, rows, row_mask, scale_ptr, residual_bound_ptr,
                                        quantized_norm_ptr, statistics_ptr, SINGLE)
    if SINGLE:
        tl.store(upper_ptr + offs_v, approximate + bound, mask=v_mask)
        lower = tl.max(tl.where(v_mask, approximate - bound, float("-inf")), axis=0)
        tl.atomic_max(threshold_ptr, lower, sem="relaxed")
    else:
        tl.store(upper_ptr + rows.to(tl.int64)[None, :] * V + offs_v[:, None], approximate + bound,
                 mask=v_mask[:, None] & row_mask[None, :])
        lower = tl.max(tl.where(v_mask[:, None], approximate - bound, float("-inf")), axis=0)
        tl.atomic_max(threshold_ptr + rows, lower, mask=row_mask, sem="relaxed")


@triton.jit
def _exact_logit(w_ptr, index, stride_wv, normed, columns, K):
    """E_i, the logit the bounds hold: row `index` of W read whole, against x_n (normed [BLOCK_X] float32, columns
    its offsets), summed in float32."""
    w = tl.load(w_ptr + index.to(tl.int64) * stride_wv + columns, mask=columns < K, other=0.0)
    return tl.sum(w.to(tl.float32) * normed, axis=0)


@triton.jit
def _check_kernel(
    w_ptr, normed_ptr, upper_ptr, threshold_ptr, value_ptr, index_ptr,
    V, K, stride_wv, MAX_TILES,
    BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr, USE_PDL: tl.constexpr,
):
    """BLOCK_R rows' upper bounds against tau; each candidate row, in increasing order, read whole from W and its
    logit formed against x_n (float32); the greatest, lowest index on ties, stored as the program's partial. A
    tile holds one candidate or none in the usual case: a loop over the candidates, not a [BLOCK_R, K] tile whose
    other rows would be masked off (and whose float32 accumulator would spill)."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = tl.arange(0, BLOCK_R)
    offs_v = pid * BLOCK_R + offs
    threshold = tl.load(threshold_ptr + row)
    upper = tl.load(upper_ptr + row.to(tl.int64) * V + offs_v, mask=offs_v < V, other=float("-inf"))
    remaining = (offs_v < V) & (upper >= threshold)
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.full([], INT32_MAX, tl.int32)
    if tl.max(remaining.to(tl.int32), axis=0) > 0:
        columns = tl.arange(0, BLOCK_X)
        normed = tl.load(normed_ptr + row * K + columns, mask=columns < K, other=0.0)
        while tl.max(remaining.to(tl.int32), axis=0) > 0:
            first = tl.argmax(remaining.to(tl.int32), axis=0, tie_break_left=True)  # the lowest candidate left
            logit = _exact_logit(w_ptr, pid * BLOCK_R + first, stride_wv, normed, columns, K)
            better = logit > best  # strictly: an equal logit at a higher index loses
            best = tl.where(better, logit, best)
            best_index = tl.where(better, pid * BLOCK_R + first, best_index)
            remaining = remaining & (offs != first)
    tl.store(value_ptr + row * MAX_TILES + pid, best)
    tl.store(index_ptr + row * MAX_TILES + pid, best_index)


class _Workspace(NamedTuple):
    """A call's buffers, per (device, M, V, K)."""

    normed: torch.Tensor  # x_n [M, K] float32
    quantized_x: torch.Tensor  # q_x [16 cdiv(M, 16), K] int8, zero past M
    statistics: torch.Tensor  # s_x, ||x_n||, ||r_x|| [M, 3]
    upper: torch.Tensor  # the upper bounds [M, V]
    threshold: torch.Tensor  # tau [M]: -inf, and each call leaves it so
    tiles: int  # the check's programs a row
    values: torch.Tensor  # the check's partials [M * tiles]
    indices: torch.Tensor
    tile_count: torch.Tensor  # [1] int32 = tiles, for the reduction (which reads its count from the device)
    kept: torch.Tensor  # the last call's tau [M]


_workspaces: dict[tuple, _Workspace] = {}


def _workspace(device, M: int, V: int, K: int) -> _Workspace:
    key = (device, M, V, K)
    if key not in _workspaces:
        tiles = triton.cdiv(V, _tiles(V, K, M)[2])
        _workspaces[key] = _Workspace(
            normed=torch.empty(M, K, dtype=torch.float32, device=device),
            quantized_x=torch.zeros(triton.cdiv(M, 16) * 16, K, dtype=torch.int8, device=device),
            statistics=torch.empty(M, 3, dtype=torch.float32, device=device),
            upper=torch.empty(M, V, dtype=torch.float32, device=device),
            threshold=torch.full((M,), float("-inf"), dtype=torch.float32, device=device),
            tiles=tiles,
            values=torch.empty(M * tiles, dtype=torch.float32, device=device),
            indices=torch.empty(M * tiles, dtype=torch.int32, device=device),
            tile_count=torch.full((1,), tiles, dtype=torch.int32, device=device),
            kept=torch.full((M,), float("-inf"), dtype=torch.float32, device=device),
        )
    return _workspaces[key]


def lm_head_argmax_screened(
    x: torch.Tensor,
    weight: torch.Tensor,
    screen: LmHeadScreen,
    out: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> torch.Tensor:
    """int64 ids [M]: the argmax over the vocabulary of x [M, H] @ weight[V, H].T, lowest id on ties, as
    lm_head_argmax (greedy), reading screen = build_screen(weight) and only the candidate rows of weight.

    norm_weight [H]: apply the zero-centred RMSNorm to x first (the final norm, fused). Capturable in a CUDA graph
    after a warm-up call at the same shapes. pdl: programmatic dependent launch of the four kernels (Hopper).
    """
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, K = x.shape
    if K > MAX_COLUMNS:
        raise ValueError(f"x has {K} columns, at most {MAX_COLUMNS} supported")
    check_tensor("weight", weight, shape=(None, K), dtype=x.dtype)
    V = weight.shape[0]
    if V == 0 or V >= 2**31:
        raise ValueError(f"weight has {V} rows, expected 1 to 2**31 - 1")
    check_tensor("screen.quantized", screen.quantized, shape=(V, K), dtype=torch.int8)
    for name in ("scales", "residual_bounds", "quantized_norms"):
        check_tensor(f"screen.{name}", getattr(screen, name), shape=(V,), dtype=torch.float32, contiguous=True)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,), dtype=FLOAT_DTYPES)
    if out is None:
        out = torch.empty(M, dtype=torch.int64, device=x.device)
    else:
        check_tensor("out", out, shape=(M,), dtype=torch.int64)
    check_same_device(x=x, weight=weight, quantized=screen.quantized, scales=screen.scales, norm_weight=norm_weight,
                      out=out)
    if M == 0:
        return out
    work = _workspace(x.device, M, V, K)
    block_x = max(16, triton.next_power_of_2(K))
    _quantize_kernel[(M,)](
        x, x if norm_weight is None else norm_weight, work.normed, work.quantized_x, work.statistics, K, x.stride(0),
        eps,
        HAS_NORM=norm_weight is not None, BLOCK_X=block_x, USE_PDL=pdl, num_warps=row_warps(block_x),
        **launch_options(pdl),
    )
    screen_rows, screen_columns, block_r = _tiles(V, K, M)
    _screen_kernel[(triton.cdiv(V, screen_rows), triton.cdiv(M, 16))](
        screen.quantized, screen.scales, screen.residual_bounds, screen.quantized_norms, work.quantized_x,
        work.statistics, work.upper, work.threshold, M, V, K, screen.quantized.stride(0),
        SINGLE=M == 1, BLOCK_V=screen_rows, BLOCK_K=screen_columns, USE_PDL=pdl, num_warps=SCREEN_WARPS,
        num_stages=SCREEN_STAGES, **launch_options(pdl),
    )
    _check_kernel[(work.tiles, M)](
        weight, work.normed, work.upper, work.threshold, work.values, work.indices, V, K, weight.stride(0), work.tiles,
        BLOCK_R=block_r, BLOCK_X=block_x, USE_PDL=pdl, num_warps=row_warps(block_x),
        **launch_options(pdl),
    )
    _argmax_reduce_kernel[(M,)](work.values, work.indices, work.tile_count, out, work.tiles, work.threshold,
                                work.kept, BLOCK_T=reduce_block(work.tiles), RESET=True, USE_PDL=pdl, num_warps=8,
                                **launch_options(pdl))
    return out


def candidate_counts(x: torch.Tensor, vocabulary: int) -> list[int]:
    """The candidate rows of each row of x in the last call at x's shape (the rows kernel 2 read from weight): a
    diagnostic for tests and benchmarks, from the call's workspace (its upper bounds and tau)."""
    M, K = x.shape
    key = (x.device, M, vocabulary, K)
    if key not in _workspaces:
        raise ValueError(f"no call at M = {M}, V = {vocabulary}, K = {K} on {x.device} yet")
    work = _workspaces[key]
    return (work.upper >= work.kept[:, None]).sum(dim=1).tolist()


__all__ = ["LmHeadScreen", "build_screen", "candidate_counts", "lm_head_argmax_screened", "screened_lm_head_bytes"]
