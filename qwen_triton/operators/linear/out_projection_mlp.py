"""The second half of a decode layer: out-projection + residual, then the MLP, one program per SM per phase.

For the M <= 16 rows of a decode step (h: the residual stream [M, H], x: the attention or delta-rule
output [M, A], gate: the attention output gate [M, A] or none):
    phase 1   h = h + x' @ W_o^T                       x' = x, or (x * sigmoid(gate)) rounded (fusion.prologue)
    phase 2   a = swiglu(rms_norm(h) (1 + w) @ W_gu^T)  the GEMV's norm prologue and swiglu epilogue
    phase 3   h = h + a @ W_d^T
the same operations and roundings as the three `linear` calls they replace (out-projection + residual,
norm + gate/up + swiglu, down + residual).

With head_norm (a Gated DeltaNet layer in the engine's decode step), x is the delta rule's output o and
phase 1 reads x' = gated_rms_norm(o, z) instead (gated_rms_norm.py's roundings): each program norms the
row itself after its PDL wait, a few whole heads a K step (each head's norm is its own), so the decode step
before it needs no last program to norm the heads.

Each phase is a launch of this kernel that splits its output rows evenly over P programs, one per SM
(ceil(N / P) rows each, one [BLOCK_N, BLOCK_K] tile of about 32 KiB per K step, the next tile loaded one
step ahead, the first before the PDL wait; no split of K, so no reduction across programs). On the H200,
back to back in a CUDA graph with PDL, the three launches take 12.3 us per layer against 13.1 us for the
three split-K GEMVs (benchmarks/decode_sweep.py --parts tail; docs/decisions.md, D17), for a 6.2 us floor.
(The three phases in one launch, the programs meeting at grid-wide barriers, are slower, 14.0 us, and failed
the GPU accuracy test: not kept; docs/decisions.md, D13.)
For one sequence on Hopper the engine runs staged_out_projection_mlp.py instead: the three phases in one Gluon
launch whose programs hold all of their weights in shared memory (10.8 us a layer back to back,
docs/decisions.md, D8, D9, against 12.05-12.25 us for these three launches in decode_sweep.py).

Floor at the real shapes (H 1024, A 2048, I 3584, bf16, M = 1): the weights, 4.2 + 14.7 + 7.3 = 26.2 MB
(~6.2 us at the 4.25 TB/s the H200 copies at); activations a few KB; 26 MFLOP.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import (
    allow_next_kernel,
    check_same_device,
    check_tensor,
    launch_options,
    sm_count,
    wait_for_previous_kernel,
)
from ..gated_delta_rule.gated_rms_norm import gated_rms_norm_values
from .fusion import NO_ACTIVATION, SWIGLU, accumulate_row, load_weight_tile, row_rstd, store_output

WARPS = 8
TILE_ELEMENTS = 16384  # weight elements per program and K step (32 KiB of bf16; gate and up: twice that)


@triton.jit
def _program_rows(N, BLOCK_N: tl.constexpr):
    """This program's share of N output rows: (offsets [BLOCK_N], end), ceil(N / programs) rows from
    program * that (offsets past `end` are masked)."""
    share = tl.cdiv(N, tl.num_programs(0))
    start = tl.program_id(0) * share
    return start + tl.arange(0, BLOCK_N), tl.minimum(start + share, N)


@triton.jit
def _first_tile(w_ptr, N, K, PAIR: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first [BLOCK_N, BLOCK_K] weight tile of this program's rows (and with PAIR, of their up rows)."""
    offs_n, end = _program_rows(N, BLOCK_N)
    return load_weight_tile(w_ptr, offs_n.to(tl.int64) * K, N * K, offs_n < end, tl.arange(0, BLOCK_K), K, PAIR)


@triton.jit
def _phase(x_ptr, stride_xm, w_ptr, out_ptr, stride_om, residual_ptr, stride_rm, gate_ptr, stride_gm,
           norm_ptr, eps, M, N, K, w, w_up,
           ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
           HAS_NORM: tl.constexpr, X_CACHE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[:, rows] = prologue(x) @ W[rows]^T with its epilogue, for this program's rows, each of the M
    rows of x in turn (weights re-read from L2 after the first: a row's sums do not depend on M); w, w_up:
    the first tile, loaded by `_first_tile`."""
    offs_n, end = _program_rows(N, BLOCK_N)
    n_mask = offs_n < end
    w_rows = offs_n.to(tl.int64) * K
    for row in range(M):
        offs_m = row + tl.arange(0, 1)
        if row > 0:
            w, w_up = load_weight_tile(w_ptr, w_rows, N * K, n_mask, tl.arange(0, BLOCK_K), K, ACTIVATION == SWIGLU)
        if HAS_NORM:
            rstd = row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, 1, BLOCK_K, X_CACHE)
        else:
            rstd = tl.zeros([1], dtype=tl.float32)
        acc, acc_up = accumulate_row(
            x_ptr, row * stride_xm, w_ptr, w_rows, N * K, n_mask, gate_ptr, stride_gm, norm_ptr, rstd,
            offs_m, K, 0, K, w, w_up, ACTIVATION == SWIGLU, HAS_GATE, HAS_NORM, BLOCK_N, BLOCK_K, X_CACHE,
        )
        # `end` as the row bound: rows past this program's share belong to the next program
        store_output(acc, acc_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, end,
                     ACTIVATION, HAS_RESIDUAL)


@triton.jit
def _head_tile(w_ptr, N, K, first_head, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's weight rows at the columns of heads first_head .. + BLOCK_H as [BLOCK_N, BLOCK_H, BLOCK_D]:
    column (first_head + h) * HEAD_DIM + d at [:, h, d] (zero past the heads and the head's values)."""
    offs_n, end = _program_rows(N, BLOCK_N)
    head = first_head + tl.arange(0, BLOCK_H)
    lane = tl.arange(0, BLOCK_D)
    column = head[:, None] * HEAD_DIM + lane[None, :]
    in_row = (head < HEADS)[:, None] & (lane < HEAD_DIM)[None, :]
    mask = (offs_n < end)[:, None, None] & in_row[None, :, :]
    return tl.load(w_ptr + offs_n.to(tl.int64)[:, None, None] * K + column[None, :, :], mask=mask, other=0.0)


@triton.jit
def _head_normed_row(x_ptr, z_ptr, weight_ptr, eps, first_head, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     ROUND_PRODUCT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Heads first_head .. + BLOCK_H of one row of the Gated DeltaNet output norm (gated_rms_norm.py, the same
    roundings): x and z [HEADS * HEAD_DIM], per head rmsnorm(x) * weight * silu(z), in x's dtype, as
    [BLOCK_H, BLOCK_D] (zero past the heads and the head's values). Each head's norm is its own: a row can be
    normed a few heads at a time."""
    head = first_head + tl.arange(0, BLOCK_H)
    lane = tl.arange(0, BLOCK_D)
    channel = head[:, None] * HEAD_DIM + lane[None, :]
    mask = (head < HEADS)[:, None] & (lane < HEAD_DIM)[None, :]
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + channel, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + lane, mask=lane < HEAD_DIM, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + channel, mask=mask, other=0.0).to(tl.float32)
    return gated_rms_norm_values(x, z, weight, eps, HEAD_DIM, ROUND_PRODUCT, dtype).to(dtype)


@triton.jit
def _head_normed_out_phase(x_ptr, stride_xm, z_ptr, stride_zm, head_norm_ptr, w_ptr, hidden_ptr, stride_hm, eps,
                           M, N, K, w, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Phase 1 with the output norm as its prologue (HEAD_NORM): hidden[:, rows] += norm(x, z) @ W_o[rows]^T,
    BLOCK_H heads of K a step (w: the first step's tile, `_head_tile`; each step loads the next one ahead), each
    of the M rows in turn."""
    offs_n, end = _program_rows(N, BLOCK_N)
    for row in range(M):
        offs_m = row + tl.arange(0, 1)
        if row > 0:
            w = _head_tile(w_ptr, N, K, 0, HEADS, HEAD_DIM, BLOCK_N, BLOCK_H, BLOCK_D)
        wide = tl.zeros([BLOCK_N, BLOCK_H, BLOCK_D], dtype=tl.float32)
        for first_head in range(0, HEADS, BLOCK_H):
            w_next = _head_tile(w_ptr, N, K, first_head + BLOCK_H, HEADS, HEAD_DIM, BLOCK_N, BLOCK_H, BLOCK_D)
            y = _head_normed_row(x_ptr + row * stride_xm, z_ptr + row * stride_zm, head_norm_ptr, eps, first_head,
                                 HEADS, HEAD_DIM, ROUND_PRODUCT, BLOCK_H, BLOCK_D)
            wide += w.to(tl.float32) * y.to(tl.float32)[None, :, :]
            w = w_next
        acc = tl.sum(tl.sum(wide, axis=2), axis=1)[None, :]
        store_output(acc, acc, hidden_ptr, stride_hm, hidden_ptr, stride_hm, offs_m, offs_n, M, end,
                     NO_ACTIVATION, True)


@triton.jit
def _out_projection_mlp_kernel(
    x_ptr, gate_ptr, out_weight_ptr, hidden_ptr, norm_ptr, gate_up_ptr, down_ptr, act_ptr, z_ptr, head_norm_ptr,
    M, eps, stride_xm, stride_gm, stride_hm, stride_am, stride_zm,
    HIDDEN: tl.constexpr, ATTENDED: tl.constexpr, INTERMEDIATE: tl.constexpr, HAS_GATE: tl.constexpr,
    PHASE: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N_OUT: tl.constexpr, BLOCK_K_OUT: tl.constexpr, BLOCK_N_UP: tl.constexpr, BLOCK_K_UP: tl.constexpr,
    BLOCK_N_DOWN: tl.constexpr, BLOCK_K_DOWN: tl.constexpr,
    HEAD_NORM: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # phase PHASE of the docstring; its first weight tile before the PDL wait. Phases 2 and 3 read rows the
    # launch before wrote from L2 (".cg"), as the GEMV chain does after its wait
    if PHASE == 1 and HEAD_NORM:
        w = _head_tile(out_weight_ptr, HIDDEN, ATTENDED, 0, HEADS, HEAD_DIM, BLOCK_N_OUT, BLOCK_H, BLOCK_D)
        w_up = w
    elif PHASE == 1:
        w, w_up = _first_tile(out_weight_ptr, HIDDEN, ATTENDED, False, BLOCK_N_OUT, BLOCK_K_OUT)
    elif PHASE == 2:
        w, w_up = _first_tile(gate_up_ptr, INTERMEDIATE, HIDDEN, True, BLOCK_N_UP, BLOCK_K_UP)
    else:
        w, w_up = _first_tile(down_ptr, HIDDEN, INTERMEDIATE, False, BLOCK_N_DOWN, BLOCK_K_DOWN)
    wait_for_previous_kernel(USE_PDL)
    allow_next_kernel(USE_PDL)
    if PHASE == 1 and HEAD_NORM:
        _head_normed_out_phase(x_ptr, stride_xm, z_ptr, stride_zm, head_norm_ptr, out_weight_ptr, hidden_ptr,
                               stride_hm, eps, M, HIDDEN, ATTENDED, w, HEADS, HEAD_DIM, ROUND_PRODUCT,
                               BLOCK_N_OUT, BLOCK_H, BLOCK_D)
    elif PHASE == 1:
        _phase(x_ptr, stride_xm, out_weight_ptr, hidden_ptr, stride_hm, hidden_ptr, stride_hm, gate_ptr, stride_gm,
               norm_ptr, eps, M, HIDDEN, ATTENDED, w, w_up, NO_ACTIVATION, True, HAS_GATE, False, "",
               BLOCK_N_OUT, BLOCK_K_OUT)
    elif PHASE == 2:
        _phase(hidden_ptr, stride_hm, gate_up_ptr, act_ptr, stride_am, act_ptr, stride_am, gate_ptr, stride_gm,
               norm_ptr, eps, M, INTERMEDIATE, HIDDEN, w, w_up, SWIGLU, False, False, True, ".cg",
               BLOCK_N_UP, BLOCK_K_UP)
    else:
        _phase(act_ptr, stride_am, down_ptr, hidden_ptr, stride_hm, hidden_ptr, stride_hm, gate_ptr, stride_gm,
               norm_ptr, eps, M, HIDDEN, INTERMEDIATE, w, w_up, NO_ACTIVATION, True, False, False, ".cg",
               BLOCK_N_DOWN, BLOCK_K_DOWN)


def _tile(N: int, K: int, programs: int, pair: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a phase: BLOCK_N covers a program's ceil(N / P) rows; BLOCK_K makes the tile
    about TILE_ELEMENTS weights (both halves of a pair), at least 32 and at most K's power of two."""
    block_n = triton.next_power_of_2(triton.cdiv(N, programs))
    block_k = TILE_ELEMENTS // (block_n * (2 if pair else 1))
    return block_n, max(32, min(triton.next_power_of_2(K), triton.next_power_of_2(block_k)))


def _head_step(block_n: int, heads: int, head_dim: int) -> int:
    """BLOCK_H of the head-normed out-projection: the heads a step takes, a power of two whose tile of BLOCK_N
    rows is at most about TILE_ELEMENTS weights (at least one head; all of them at the 0.8B's shape)."""
    step = max(1, TILE_ELEMENTS // (block_n * triton.next_power_of_2(head_dim)))
    return min(triton.next_power_of_2(heads), 1 << (step.bit_length() - 1))


def out_projection_mlp(
    x: torch.Tensor,
    out_weight: torch.Tensor,
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
    gate: torch.Tensor | None = None,
    act: torch.Tensor | None = None,
    pdl: bool = False,
    programs: int | None = None,
    head_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """hidden += out-projection of x (gated by sigmoid(gate) if given), then hidden += MLP(hidden); in place.

    x [M, A] (unit last stride); out_weight [H, A]; hidden [M, H] (the residual stream, updated in place);
    norm_weight [H] (the MLP's zero-centred RMSNorm: x (1 + w)); gate_up_weight [2I, H] (gate rows, then
    up rows); down_weight [H, I]; gate [M, A] or None; act [M, I]: the swiglu activations' buffer
    (allocated when None). Returns hidden. programs: the grid of each phase (default: one per SM). pdl:
    programmatic dependent launch (Hopper; operators/common.py).
    head_norm: (z [M, A], weight [D]): x is a Gated DeltaNet's delta-rule output o [M, A] of A / D heads
    of D values, and the out-projection reads gated_rms_norm(o, z, weight, eps) instead (gated_rms_norm.py,
    the same roundings), formed by each program for the whole row; not with gate.
    """
    check_tensor("x", x, shape=(None, None), dtype=(torch.bfloat16, torch.float16, torch.float32))
    rows, attended = x.shape
    check_tensor("out_weight", out_weight, shape=(None, attended), dtype=x.dtype, contiguous=True)
    size = out_weight.shape[0]
    check_tensor("hidden", hidden, shape=(rows, size), dtype=x.dtype)
    check_tensor("norm_weight", norm_weight, shape=(size,), dtype=x.dtype, contiguous=True)
    check_tensor("gate_up_weight", gate_up_weight, shape=(None, size), dtype=x.dtype, contiguous=True)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight has {gate_up_weight.shape[0]} rows, not gate and up rows of one width")
    intermediate = gate_up_weight.shape[0] // 2
    check_tensor("down_weight", down_weight, shape=(size, intermediate), dtype=x.dtype, contiguous=True)
    if gate is not None:
        check_tensor("gate", gate, shape=(rows, attended), dtype=x.dtype)
    if act is None:
        act = torch.empty(rows, intermediate, device=x.device, dtype=x.dtype)
    check_tensor("act", act, shape=(rows, intermediate), dtype=x.dtype)
    for name, tensor in (("x", x), ("hidden", hidden), ("act", act)) + ((("gate", gate),) if gate is not None else ()):
        if tensor.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along its last dimension, "
                             f"got strides {tuple(tensor.stride())}")
    check_same_device(x=x, out_weight=out_weight, hidden=hidden, norm_weight=norm_weight,
                      gate_up_weight=gate_up_weight, down_weight=down_weight, act=act,
                      **({"gate": gate} if gate is not None else {}))
    z, head_norm_weight, heads, head_dim = x, norm_weight, 1, 1  # stand-ins, unused without head_norm
    if head_norm is not None:
        if gate is not None:
            raise ValueError("head_norm and gate exclude each other: the gate belongs to attention layers")
        z, head_norm_weight = head_norm
        check_tensor("head_norm weight", head_norm_weight, shape=(None,), dtype=x.dtype, contiguous=True)
        head_dim = head_norm_weight.shape[0]
        if head_dim == 0 or attended % head_dim:
            raise ValueError(f"head_norm weight has {head_dim} values: expected a divisor of x's {attended} columns")
        check_tensor("head_norm z", z, shape=(rows, attended), dtype=x.dtype)
        check_same_device(x=x, z=z, head_norm_weight=head_norm_weight)
        heads = attended // head_dim
    if rows == 0:
        return hidden
    programs = sm_count(x.device) if programs is None else programs
    if programs < 1:
        raise ValueError(f"programs must be at least 1, got {programs}")
    block_n_out, block_k_out = _tile(size, attended, programs, pair=False)
    block_n_up, block_k_up = _tile(intermediate, size, programs, pair=True)
    block_n_down, block_k_down = _tile(size, intermediate, programs, pair=False)
    for phase in (1, 2, 3):
        _out_projection_mlp_kernel[(programs,)](
            x, x if gate is None else gate, out_weight, hidden, norm_weight, gate_up_weight, down_weight, act,
            z, head_norm_weight,
            rows, eps, x.stride(0), 0 if gate is None else gate.stride(0), hidden.stride(0), act.stride(0),
            z.stride(0),
            HIDDEN=size, ATTENDED=attended, INTERMEDIATE=intermediate, HAS_GATE=gate is not None,
            PHASE=phase, USE_PDL=pdl,
            BLOCK_N_OUT=block_n_out, BLOCK_K_OUT=block_k_out, BLOCK_N_UP=block_n_up, BLOCK_K_UP=block_k_up,
            BLOCK_N_DOWN=block_n_down, BLOCK_K_DOWN=block_k_down,
            HEAD_NORM=head_norm is not None, HEADS=heads, HEAD_DIM=head_dim,
            ROUND_PRODUCT=x.dtype != torch.float32,
            BLOCK_H=_head_step(block_n_out, heads, head_dim), BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=WARPS, num_stages=1, **launch_options(pdl),
        )
    return hidden


def out_projection_mlp_cost(rows, size, attended, intermediate, gate=False, element_size=2):
    """(bytes, FLOPs) of the floor: the three weights once; x (and gate), hidden in and out, the
    activations written and read."""
    weights = size * attended + 3 * size * intermediate
    activations = rows * (attended * (2 if gate else 1) + 2 * size + 2 * intermediate)
    return element_size * (weights + activations), 2 * rows * weights
