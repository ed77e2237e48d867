"""The Gated DeltaNet output norm: per head, RMSNorm of the delta-rule output gated by silu(z).

For every row m and value head h, with x = x[m, h, :] (Dv values) and zh = z[m, h*Dv:(h+1)*Dv]:
    n = x / sqrt(mean(x^2) + eps)                 float32, rounded to x's dtype
    p = weight * n                                rounded to x's dtype when weight has x's dtype
    y = p * silu(zh)                              float32, rounded once to x's dtype
exactly the roundings of `reference.functional.gated_rms_norm` (plain weight, not 1 + weight).

Shapes: x [M, Hv, Dv] (unit last stride); z [M, Hv * Dv] (a strided row view of the fused projection);
weight [Dv]. Returns y [M, Hv * Dv] in x's dtype, the row layout out_proj reads.

Blocking: a program normalises BLOCK_H heads of one row as a [BLOCK_H, Dv] tile: each head's reduction
stays inside the tile, and a row of the real model (16 heads x 128) is two programs of 8 heads.

Floor at the real shapes (Hv 16, Dv 128, bf16), per row: reads x and z (2 x 4 KiB), writes 4 KiB;
~10 FLOPs per element (~20 kFLOP). Decode (M = 1) is one launch of latency, a 4096-token prefill ~50 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_tensor
from .gating import ACTIVATION_DTYPES


@triton.jit
def gated_rms_norm_values(x, z, weight, eps, HEAD_DIM: tl.constexpr, ROUND_PRODUCT: tl.constexpr, dtype):
    """The norm of a tile of heads in registers: x, z [heads, BLOCK_D] and weight [BLOCK_D] in float32 (zero
    past HEAD_DIM); returns y [heads, BLOCK_D] in float32, to be rounded once to dtype (x's)."""
    normed = x * tl.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]
    normed = normed.to(dtype).to(tl.float32)
    product = weight[None, :] * normed
    if ROUND_PRODUCT:
        product = product.to(dtype).to(tl.float32)
    return product * (z / (1.0 + tl.exp(-z)))


@triton.jit
def gated_rms_norm_heads(x_row, stride_xh, z_row, weight_ptr, out_row, head, eps,
                         HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
                         BLOCK_D: tl.constexpr, X_FROM_L2: tl.constexpr):
    """The norm of the heads `head` of one row: x_row [Hv, Dv] (head stride stride_xh), z_row and out_row
    [Hv * Dv]. X_FROM_L2: read x past the L1 cache (x was written by other programs of this kernel)."""
    lane = tl.arange(0, BLOCK_D)
    mask = (head[:, None] < HEADS) & (lane[None, :] < HEAD_DIM)
    dtype = x_row.dtype.element_ty
    if X_FROM_L2:
        x = tl.load(x_row + head[:, None] * stride_xh + lane[None, :], mask=mask, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(x_row + head[:, None] * stride_xh + lane[None, :], mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(weight_ptr + lane, mask=lane < HEAD_DIM, other=0.0).to(tl.float32)
    channel = head[:, None] * HEAD_DIM + lane[None, :]
    z = tl.load(z_row + channel, mask=mask, other=0.0).to(tl.float32)
    y = gated_rms_norm_values(x, z, weight, eps, HEAD_DIM, ROUND_PRODUCT, dtype)
    tl.store(out_row + channel, y.to(out_row.dtype.element_ty), mask=mask)


def _configs():
    return autotune_configs([
        triton.Config({"BLOCK_H": 4}, num_warps=4),
        triton.Config({"BLOCK_H": 1}, num_warps=1),
        triton.Config({"BLOCK_H": 2}, num_warps=2),
        triton.Config({"BLOCK_H": 8}, num_warps=4),
        triton.Config({"BLOCK_H": 16}, num_warps=8),
    ])


@triton.autotune(configs=_configs(), key=["HEADS", "HEAD_DIM"], cache_results=True)
@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, weight_ptr, out_ptr,
    eps, stride_xm, stride_xh, stride_zm, stride_om,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    gated_rms_norm_heads(x_ptr + row * stride_xm, stride_xh, z_ptr + row * stride_zm, weight_ptr,
                         out_ptr + row * stride_om, head, eps, HEADS, HEAD_DIM, ROUND_PRODUCT, BLOCK_D, False)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """y [M, Hv*Dv] = rmsnorm(x [M, Hv, Dv]) * weight [Dv] * silu(z [M, Hv*Dv]), per head."""
    check_tensor("x", x, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    rows, heads, head_dim = x.shape
    check_tensor("z", z, shape=(rows, heads * head_dim), dtype=ACTIVATION_DTYPES)
    check_tensor("weight", weight, shape=(head_dim,), dtype=ACTIVATION_DTYPES, contiguous=True)
    if out is None:
        out = torch.empty(rows, heads * head_dim, device=x.device, dtype=x.dtype)
    check_tensor("out", out, shape=(rows, heads * head_dim), dtype=x.dtype)
    check_same_device(x=x, z=z, weight=weight, out=out)
    if rows == 0:
        return out
    grid = lambda meta: (rows, triton.cdiv(heads, meta["BLOCK_H"]))  # noqa: E731
    _gated_rms_norm_kernel[grid](
        x, z, weight, out,
        eps, x.stride(0), x.stride(1), z.stride(0), out.stride(0),
        HEADS=heads, HEAD_DIM=head_dim,
        # torch multiplies two tensors of one 16-bit dtype in that dtype; a float32 weight promotes
        ROUND_PRODUCT=weight.dtype == x.dtype and x.dtype != torch.float32,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


def gated_rms_norm_cost(rows, heads, head_dim, element_size=2):
    """(bytes, FLOPs) of the floor: x and z in, y out, the weight once; ~8 FLOPs per element."""
    return element_size * (3 * rows * heads * head_dim + head_dim), 8 * rows * heads * head_dim
