"""An attention layer's decode in-projection with its q/k norms, rotary and KV-cache write: one kernel.

One sequence (B = 1, the single-stream decode). It computes what this chain computes, with the same roundings:
    qkv = linear(hidden, W, norm_weight=input_norm)          the GEMV (linear/gemv.py), rows gate | q | k | v
    q = qk_norm_rotary(qkv[:, gate columns:], ...)            per-head RMSNorm + RoPE, k and v into the cache
but without the kernel boundary between them, where the norms waited for the whole projection grid to drain
and then ran as a launch of their own (2.5 us a layer in the thirteenth session's profile).

Programs: one per tile of 16 weight rows, the GEMV's in-graph tile for K <= 1024 (gemv.PREFERRED_BY_K), each
summed exactly as that GEMV sums it (`row_rstd`, `accumulate_row`, the same shapes and warps), so every value
of qkv is the GEMV's bit for bit. Each program stores its 16 values into the qkv row; then
  - a tile of q or k: adds 1 to its head's counter (acquire-release); the program that brings the count to the
    head's tile count (the last of the head's tiles to finish, whichever it is) norms and rotates the whole
    head from the qkv row in L2 (qk_norm_rotary's `norm_rotate_row`, bit for bit) into q_out or the key cache,
    then zeroes the counter for the next launch. No program waits for another: nothing can deadlock, whatever
    order the GPU runs the grid in;
  - a tile of v: also stores its 16 values into the value cache;
  - a tile of the gate: nothing more (the out-projection's prologue reads it from qkv).
The counters are shared by every launch on a device: launches must be ordered on one stream.

Floor at the real shapes (K 1024, gate | q | k | v = 2048 + 2048 + 512 + 512 rows, bf16): the 10.5 MB weight;
the row, qkv and the caches' new rows are ~20 KB: ~2.5 us at the 4.2 TB/s the H200 copies at; 10.5 MFLOP.
CUDA-graph capturable: no host reads, every output buffer passed in, the caches written in place, no tuning.
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
    preferred_entry,
    wait_for_previous_kernel,
)
from ..linear.fusion import accumulate_row, load_weight_tile, row_rstd
from ..linear.gemv import PREFERRED_BY_K
from .qk_norm_rotary import ACTIVATION_DTYPES, norm_rotate_row

# The GEMV's in-graph tile for K <= 1024 (16 rows x 256 columns a step) and that config's warps and stages:
# the same shapes and warps give the same sums (as gated_delta_rule/projected_decode.py).
_, ROWS, TILE_K = preferred_entry(PREFERRED_BY_K, 1024, ("SPLIT_K", "BLOCK_N", "BLOCK_K")).values()
WARPS = 4
STAGES = 3


@triton.jit
def _projected_qkv_kernel(
    hidden_ptr, input_norm_ptr, weight_ptr, q_weight_ptr, k_weight_ptr, table_ptr, positions_ptr, slots_ptr,
    key_cache_ptr, value_cache_ptr, qkv_ptr, q_out_ptr, counter_ptr,
    K, eps, stride_wn, stride_table_row, stride_cache_batch, stride_cache_head, stride_cache_position,
    stride_out_head,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GATED: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, TILE_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    GATE_ROWS: tl.constexpr = NUM_HEADS * HEAD_DIM if GATED else 0
    Q_START: tl.constexpr = GATE_ROWS
    K_START: tl.constexpr = Q_START + NUM_HEADS * HEAD_DIM
    V_START: tl.constexpr = K_START + NUM_KV_HEADS * HEAD_DIM
    N: tl.constexpr = V_START + NUM_KV_HEADS * HEAD_DIM
    TILES_PER_HEAD: tl.constexpr = HEAD_DIM // ROWS
    first_row = tl.program_id(0) * ROWS
    rows = first_row + tl.arange(0, ROWS)
    row_mask = rows < N
    w_rows = rows.to(tl.int64) * stride_wn

    # the first weight tile before the wait: no kernel since the last launch without PDL writes the weights
    w, _ = load_weight_tile(weight_ptr, w_rows, 0, row_mask, tl.arange(0, TILE_K), K, False)
    wait_for_previous_kernel(USE_PDL)

    # the GEMV's row: input RMSNorm in the prologue, 16 weight rows against it, rounded as the GEMV stores them
    offs_m = tl.arange(0, 1)
    rstd = row_rstd(hidden_ptr, 0, offs_m, 1, K, eps, 1, TILE_K, "")
    acc, _ = accumulate_row(hidden_ptr, 0, weight_ptr, w_rows, 0, row_mask, hidden_ptr, 0, input_norm_ptr, rstd,
                            offs_m, K, 0, K, w, w, False, False, True, ROWS, TILE_K, "")
    projected = tl.sum(acc, axis=0).to(qkv_ptr.dtype.element_ty)
    tl.store(qkv_ptr + rows, projected, mask=row_mask)
    if first_row >= V_START:  # v: into the value cache too (a tile never spans two heads: ROWS divides D)
        position = tl.load(positions_ptr)
        slot = tl.load(slots_ptr).to(tl.int64)
        kv_head = (first_row - V_START) // HEAD_DIM
        lanes = (first_row - V_START) % HEAD_DIM + tl.arange(0, ROWS)
        cache_row = slot * stride_cache_batch + kv_head * stride_cache_head + position * stride_cache_position
        tl.store(value_cache_ptr + cache_row + lanes, projected)
    elif first_row >= Q_START:
        # q or k: the last of the head's tiles to arrive norms and rotates the head (heads numbered as in
        # qk_norm_rotary: the q heads, then the k heads)
        head = (first_row - Q_START) // HEAD_DIM
        tl.debug_barrier()  # every thread's store precedes the release
        arrived = tl.atomic_add(counter_ptr + head, 1, sem="acq_rel", scope="gpu")
        if arrived == TILES_PER_HEAD - 1:
            # the row's other values from L2 (.cg): other programs of this launch wrote them
            # (the row from its q columns on, as qk_norm_rotary takes it ungated; row 0, as a tensor)
            norm_rotate_row(qkv_ptr + Q_START, q_weight_ptr, k_weight_ptr, table_ptr, positions_ptr, slots_ptr,
                            key_cache_ptr, value_cache_ptr, q_out_ptr, eps, first_row * 0, head, 0, stride_table_row,
                            stride_cache_batch, stride_cache_head, stride_cache_position, 0, stride_out_head,
                            HEAD_DIM, ROTARY_DIM, NUM_HEADS, NUM_KV_HEADS, False, BLOCK_D, ".cg")
            tl.atomic_xchg(counter_ptr + head, 0, sem="relaxed", scope="gpu")


_counters: dict[tuple, torch.Tensor] = {}


def _head_counters(device: torch.device, heads: int) -> torch.Tensor:
    """Zeroed int32 counters, one per q and k head; each launch leaves them zero."""
    key = (device, heads)
    if key not in _counters:
        _counters[key] = torch.zeros(heads, dtype=torch.int32, device=device)
    return _counters[key]


def attention_projected_qkv(
    hidden: torch.Tensor,
    input_norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    qkv: torch.Tensor,
    q_out: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    gated: bool = True,
    pdl: bool = False,
) -> torch.Tensor:
    """One sequence's attention in-projection, q/k norms, RoPE and KV write: q_out [1, Hq, D] (returned).

    hidden [1, K] (the residual stream) and input_norm [K] (the layer's zero-centred RMSNorm weight, eps); weight
    [N, K], the fused gate | q | k | v in-projection (N = (2 if gated else 1) Hq D + 2 Hkv D); q_norm_weight,
    k_norm_weight [D] (their eps is eps too, as in Qwen3.5); cos_sin, positions, slots, key_cache, value_cache
    as qk_norm_rotary takes them (one row). Buffers written: qkv [1, N] (every column; the gate is read from it
    by the out-projection), q_out, and the caches at [slot, :, position]. D must be a multiple of 16 (a tile of
    16 rows never spans two heads). pdl: programmatic dependent launch (Hopper; operators/common.py).
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if head_dim % ROWS:
        raise ValueError(f"head_dim {head_dim} must be a multiple of {ROWS}")
    check_tensor("hidden", hidden, shape=(1, None), dtype=ACTIVATION_DTYPES, contiguous=True)
    K = hidden.shape[1]
    width = (2 if gated else 1) * num_heads * head_dim + 2 * num_kv_heads * head_dim
    check_tensor("input_norm", input_norm, shape=(K,), dtype=hidden.dtype, contiguous=True)
    check_tensor("weight", weight, shape=(width, K), dtype=hidden.dtype)
    for name, tensor in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        check_tensor(name, tensor, shape=(head_dim,), dtype=ACTIVATION_DTYPES, contiguous=True)
    check_tensor("cos_sin", cos_sin, shape=(None, None), dtype=torch.float32)
    rotary_dim = cos_sin.shape[1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin has {rotary_dim} columns: the rotary dim must be even and at most {head_dim}")
    check_tensor("positions", positions, shape=(1,), dtype=torch.int32)
    check_tensor("slots", slots, shape=(1,), dtype=torch.int32)
    check_tensor("key_cache", key_cache, shape=(None, num_kv_heads, None, head_dim), dtype=hidden.dtype)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=hidden.dtype)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache strides {value_cache.stride()} differ from key_cache's {key_cache.stride()}")
    check_tensor("qkv", qkv, shape=(1, width), dtype=hidden.dtype, contiguous=True)
    check_tensor("q_out", q_out, shape=(1, num_heads, head_dim), dtype=hidden.dtype)
    check_same_device(hidden=hidden, input_norm=input_norm, weight=weight, q_norm_weight=q_norm_weight,
                      k_norm_weight=k_norm_weight, cos_sin=cos_sin, positions=positions, slots=slots,
                      key_cache=key_cache, value_cache=value_cache, qkv=qkv, q_out=q_out)
    counters = _head_counters(hidden.device, num_heads + num_kv_heads)
    _projected_qkv_kernel[(triton.cdiv(width, ROWS),)](
        hidden, input_norm, weight, q_norm_weight, k_norm_weight, cos_sin, positions, slots, key_cache, value_cache,
        qkv, q_out, counters,
        K, eps, weight.stride(0), cos_sin.stride(0), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        q_out.stride(1),
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GATED=gated,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), ROWS=ROWS, TILE_K=TILE_K, USE_PDL=pdl,
        num_warps=WARPS, num_stages=STAGES, **launch_options(pdl),
    )
    return q_out


def attention_projected_qkv_cost(hidden_size, num_heads, num_kv_heads, head_dim, gated=True, element_size=2):
    """(bytes, FLOPs) of the floor: the weight, the row in, qkv and q out, the caches' new k and v rows."""
    width = (2 if gated else 1) * num_heads * head_dim + 2 * num_kv_heads * head_dim
    moved = element_size * (width * hidden_size + hidden_size + width + (num_heads + 2 * num_kv_heads) * head_dim)
    return moved, 2 * width * hidden_size + 10 * (num_heads + num_kv_heads) * head_dim
