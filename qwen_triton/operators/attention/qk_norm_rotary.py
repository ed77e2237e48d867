"""Per-head RMSNorm and RoPE of q and k, and the KV-cache write, in one kernel.

The fused input projection gives each token a row [q_and_gate | k | v]:
    q_and_gate  Hq * 2D  (gated: per head h, q of h (D values) then its output gate (D values),
                          transformers' q_proj.view(T, Hq, 2D).chunk(2)); Hq * D when not gated
    k           Hkv * D
    v           Hkv * D
For every row m (position p = positions[m], cache slot b = slots[m]) and head:
    x' = x / sqrt(mean(x^2) + eps) * (1 + w)              zero-centred RMSNorm over D, fp32
    y[i] = x'[i] cos(p f_i) - x'[i + R/2] sin(p f_i)      i <  R/2      (rotate-half RoPE on the
    y[i] = x'[i] cos(p f_j) + x'[i - R/2] sin(p f_j)      R/2 <= i < R   first R = rotary_dim dims,
    y[i] = x'[i]                                          i >= R         j = i - R/2, f_j = theta^(-2j/R))
q is normed (q_norm_weight) and rotated and returned [M, Hq, D]; k is normed (k_norm_weight) and rotated
and written to key_cache[b, :, p, :]; v is copied unchanged to value_cache[b, :, p, :]; a row whose slot
is negative (a padding row of a decode bucket) writes no cache. The gate stays in qkv (the o_proj prologue
reads it). All arithmetic is fp32; each result is rounded once to the activation dtype.

The cos/sin table (`rotary_table`) is float32 [max_length, R]: row p holds cos(p f_j) for j < R/2 in its
first half and sin(p f_j) in its second half (the reference's repeated halves are stored once).

Grid: (M / ROWS, Hq + 2 Hkv): a program takes one head of ROWS consecutive rows, a D-vector each, one after
the other (ROWS = 4 from 513 rows, 1 below: the pins above the kernel): the rotate-half partner of a lane is
read again from memory (a cached re-read of the same 2D bytes) rather than shuffled across lanes.

Floor at the real shapes (Hq 8, Hkv 2, D 256, R 64, bf16), per token: reads q, k, v = 12 x 256 x 2 B
= 6 KiB (the gate is skipped) plus 256 B of cos/sin; writes 6 KiB (q out, k and v cache). About 10 FLOPs
per element: ~30 kFLOP per token. Decode (M = 1) is one launch of latency; prefill of 4096 tokens moves
~50 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import active
from ..common import (
    allow_next_kernel,
    autotune_configs,
    check_same_device,
    check_tensor,
    keep_preferred,
    launch_options,
    wait_for_previous_kernel,
)

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def rotary_table(max_length: int, rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """The float32 cos/sin table [max_length, rotary_dim]: cos of the R/2 angles, then their sin.

    Angles p * theta^(-2j/R) are formed in float32 exactly as the reference (`rotary_cos_sin`) forms them.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be positive and even, got {rotary_dim}")
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    inverse_frequencies = 1.0 / (theta**exponents)
    angles = torch.arange(max_length, device=device).float()[:, None] * inverse_frequencies[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).contiguous()


@triton.jit
def _norm_rotate_head(
    source, weight, table_row, eps,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One head: zero-centred RMSNorm over D then rotate-half RoPE of the first ROTARY_DIM lanes (fp32)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    lanes = tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    x = tl.load(source + lanes, mask=in_head, other=0.0).to(tl.float32)
    inverse_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    w = tl.load(weight + lanes, mask=in_head, other=0.0).to(tl.float32)
    normed = x * inverse_rms * (1.0 + w)

    rotated = lanes < ROTARY_DIM
    first_half = lanes < HALF
    partner = tl.where(first_half, lanes + HALF, lanes - HALF)
    x_partner = tl.load(source + partner, mask=rotated, other=0.0).to(tl.float32)
    w_partner = tl.load(weight + partner, mask=rotated, other=0.0).to(tl.float32)
    normed_partner = x_partner * inverse_rms * (1.0 + w_partner)
    frequency = tl.where(first_half, lanes, lanes - HALF)
    cos = tl.load(table_row + frequency, mask=rotated, other=1.0)
    sin = tl.load(table_row + HALF + frequency, mask=rotated, other=0.0)
    return normed * cos + tl.where(first_half, -normed_partner, normed_partner) * sin


@triton.jit
def _norm_rotate_row(
    qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache, q_out, eps, row, head,
    stride_qkv_row, stride_table_row, stride_cache_batch, stride_cache_head, stride_cache_position,
    stride_out_row, stride_out_head,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, GATED: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Head `head` of row `row`: q normed and rotated into q_out, or k normed and rotated into the key cache, or
    v copied into the value cache."""
    position = tl.load(positions + row)
    slot = tl.load(slots + row).to(tl.int64)
    row_start = qkv + row.to(tl.int64) * stride_qkv_row
    table_row = table + position.to(tl.int64) * stride_table_row
    lanes = tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    Q_STRIDE: tl.constexpr = 2 * HEAD_DIM if GATED else HEAD_DIM
    K_START: tl.constexpr = NUM_HEADS * Q_STRIDE
    V_START: tl.constexpr = K_START + NUM_KV_HEADS * HEAD_DIM
    if head < NUM_HEADS:
        y = _norm_rotate_head(row_start + head * Q_STRIDE, q_weight, table_row, eps,
                              HEAD_DIM, ROTARY_DIM, BLOCK_D)
        destination = q_out + row.to(tl.int64) * stride_out_row + head * stride_out_head
        tl.store(destination + lanes, y.to(q_out.dtype.element_ty), mask=in_head)
    else:
        kv_head = (head - NUM_HEADS) % NUM_KV_HEADS
        cache_offset = slot * stride_cache_batch + kv_head * stride_cache_head + position * stride_cache_position
        written = in_head & (slot >= 0)  # a padding row (negative slot) writes no cache
        if head < NUM_HEADS + NUM_KV_HEADS:
            y = _norm_rotate_head(row_start + K_START + kv_head * HEAD_DIM, k_weight, table_row, eps,
                                  HEAD_DIM, ROTARY_DIM, BLOCK_D)
            tl.store(key_cache + cache_offset + lanes, y.to(key_cache.dtype.element_ty), mask=written)
        else:
            v = tl.load(row_start + V_START + kv_head * HEAD_DIM + lanes, mask=in_head, other=0.0)
            tl.store(value_cache + cache_offset + lanes, v.to(value_cache.dtype.element_ty), mask=written)


# ROWS: the rows a program handles, one after the other (one head each; one program per (row, head) made 49,152
# programs of one 512-byte vector at 4096 tokens). Inputs from the row bucket LONG_ROWS_FROM run LONG_ROWS_PICK
# (this GPU's tuning table, tuning/h200.py, with what was measured); others one row per program, the warps tuned
# per row bucket (the decode step's single row is its own bucket).
CONFIGS = [triton.Config({"ROWS": rows}, num_warps=warps) for rows in (1, 4, 16) for warps in (2, 1, 4)]
LONG_ROWS_PICK = active().qk_long_rows_pick
LONG_ROWS_FROM = active().qk_long_rows_from  # the row bucket (the row count rounded up to a power of two, at most 4096)


def _prune(configs, named_args, **kwargs):
    if named_args["row_bucket"] >= LONG_ROWS_FROM:
        return keep_preferred(configs, LONG_ROWS_PICK)
    return [c for c in configs if c.kwargs["ROWS"] == 1] or configs[:1]


@triton.autotune(configs=autotune_configs(CONFIGS), key=["HEAD_DIM", "NUM_HEADS", "NUM_KV_HEADS", "row_bucket"],
                 prune_configs_by={"early_config_prune": _prune}, cache_results=True)
@triton.jit(do_not_specialize=["row_bucket"])  # a tuning key only: no recompilation per bucket
def _qk_norm_rotary_kernel(
    qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache, q_out,
    eps, rows, row_bucket,
    stride_qkv_row, stride_table_row,
    stride_cache_batch, stride_cache_head, stride_cache_position,
    stride_out_row, stride_out_head,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, GATED: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    for step in tl.static_range(ROWS):
        row = tl.program_id(0) * ROWS + step
        if row < rows:
            _norm_rotate_row(qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache, q_out, eps,
                             row, tl.program_id(1), stride_qkv_row, stride_table_row, stride_cache_batch,
                             stride_cache_head, stride_cache_position, stride_out_row, stride_out_head,
                             HEAD_DIM, ROTARY_DIM, NUM_HEADS, NUM_KV_HEADS, GATED, BLOCK_D)


def qk_norm_rotary(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    gated: bool = True,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Norm and rotate q and k of each row, write k and v into the cache; return q [M, Hq, D].

    qkv [M, width] (rows may be strided, unit last stride); cos_sin float32 [max_length, R] from
    `rotary_table`; positions, slots int32 [M] on the device (no host reads: graph capturable);
    key_cache, value_cache [max_batch, Hkv, max_length, D] in qkv's dtype, written at [slot, :, position]
    (not at all for a negative slot: a padding row).
    Positions must lie below both the table's and the cache's max_length (not checked: device data).
    pdl: programmatic dependent launch (Hopper; operators/common.py).
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    check_tensor("qkv", qkv, dtype=ACTIVATION_DTYPES)
    if qkv.dim() != 2:
        raise ValueError(f"qkv has shape {list(qkv.shape)}, expected [rows, width]")
    rows = qkv.shape[0]
    q_width = num_heads * head_dim * (2 if gated else 1)
    width = q_width + 2 * num_kv_heads * head_dim
    check_tensor("qkv", qkv, shape=(rows, width))
    device = qkv.device
    check_tensor("q_norm_weight", q_norm_weight, shape=(head_dim,), dtype=ACTIVATION_DTYPES)
    check_tensor("k_norm_weight", k_norm_weight, shape=(head_dim,), dtype=ACTIVATION_DTYPES)
    check_tensor("cos_sin", cos_sin, shape=(None, None), dtype=torch.float32)
    rotary_dim = cos_sin.shape[1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin has {rotary_dim} columns: the rotary dim must be even and at most {head_dim}")
    check_tensor("positions", positions, shape=(rows,), dtype=torch.int32)
    check_tensor("slots", slots, shape=(rows,), dtype=torch.int32)
    check_tensor("key_cache", key_cache, shape=(None, num_kv_heads, None, head_dim), dtype=qkv.dtype)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=qkv.dtype)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache strides {value_cache.stride()} differ from key_cache's {key_cache.stride()}")
    if out is None:
        out = torch.empty(rows, num_heads, head_dim, device=device, dtype=qkv.dtype)
    check_tensor("out", out, shape=(rows, num_heads, head_dim), dtype=qkv.dtype)
    check_same_device(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos_sin=cos_sin,
                      positions=positions, slots=slots, key_cache=key_cache, value_cache=value_cache, out=out)
    if rows == 0:
        return out
    grid = lambda meta: (triton.cdiv(rows, meta["ROWS"]), num_heads + 2 * num_kv_heads)  # noqa: E731
    _qk_norm_rotary_kernel[grid](
        qkv, q_norm_weight, k_norm_weight, cos_sin, positions, slots, key_cache, value_cache, out,
        eps, rows, min(triton.next_power_of_2(rows), 4096),
        qkv.stride(0), cos_sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        GATED=gated, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def qk_norm_rotary_cost(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, element_bytes: int = 2):
    """(bytes, FLOPs) floor: read q, k, v and write q, k, v once; ~10 FLOPs per normed element."""
    elements = rows * (num_heads + 2 * num_kv_heads) * head_dim
    return 2 * elements * element_bytes, 10 * rows * (num_heads + num_kv_heads) * head_dim


__all__ = ["qk_norm_rotary", "rotary_table", "qk_norm_rotary_cost"]
