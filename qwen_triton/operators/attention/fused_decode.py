"""A decode step's whole attention in one launch: q/k norm + rotary, the KV-cache write, split-KV attention
and the merge of the splits.

The separate kernels (qk_norm_rotary.py, then decode.py's split and merge kernels) are three launches per
attention layer with little work each: at batch 1 and short contexts each is a few microseconds of ramp-up
and drain. Here, from the input projection's row [q (Hq D) | k (Hkv D) | v (Hkv D)] of each sequence (the
output gate, if any, sliced off before: the o_proj prologue reads it), grid (S, Hkv, B) as decode.py's split
kernel, program (s, g, b):
  1. norms and rotates the q of the G = Hq / Hkv query heads of KV head g (in registers, rounded to the
     activation dtype as the separate kernel stores it);
  2. if split s holds the new token's position p = positions[b] (the sequence's last key), norms and rotates
     k, writes k and v into the cache at [b, g, p] and waits for its block (a barrier) before reading them
     back: no other split reads position p;
  3. runs the split's online softmax over keys [s L, (s + 1) L) of the L_b = p + 1 keys (decode.py's split
     length L) and stores its partial max, sum and accumulator;
  4. counts its arrival on an int32 counter per (b, g); the last of the active splits to arrive folds the
     partials of the G heads in split order (the same sum whichever arrives last), writes out [b, G heads]
     and resets the counter, so a CUDA graph replays the launch.
Equal to qk_norm_rotary followed by attention_decode up to the order of the merge's sums (float32).

Floor: decode.py's (K and V of L_b keys read once, q and out) plus the projection's row read and one key and
value written: at L = 128, Hkv 2, D 256, bf16, ~0.27 MB, far below a microsecond; the kernel is latency
(one launch instead of three). The last split's merge reads the partials, S_active G (D + 2) 4 bytes: 8 KiB
at L = 128 (2 splits of 64 keys), 512 KiB per KV head at L = 32768 (128 splits), from L2 by one program.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import (
    allow_next_kernel,
    autotune_configs,
    check_same_device,
    check_tensor,
    launch_options,
    wait_for_previous_kernel,
)
from .decode import ACTIVATION_DTYPES, DEFAULT_SPLIT_ALIGN, LOG2_E, decode_splits
from .prefill import online_softmax_step
from .qk_norm_rotary import norm_rotate_rows


def _configs():
    # decode.py's split-kernel tiles
    return autotune_configs([
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
    ])


@triton.jit
def _merge_splits(partial_acc, partial_max, partial_sum, out, stats, partials, head, head_valid, lanes, in_head,
                  active, stride_partial_split, stride_out_head, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """out[head] = sum_s exp2(m_s - M) a_s / sum_s exp2(m_s - M) l_s over the `active` splits, in split order
    (.cg loads: the other programs' partials from L2, never a stale L1 line)."""
    overall_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(0, active):
        overall_max = tl.maximum(overall_max, tl.load(partial_max + stats + s, mask=head_valid, other=0.0,
                                                      cache_modifier=".cg"))
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    for s in range(0, active):
        weight = tl.exp2(tl.load(partial_max + stats + s, mask=head_valid, other=0.0, cache_modifier=".cg")
                         - overall_max)
        total += weight * tl.load(partial_sum + stats + s, mask=head_valid, other=0.0, cache_modifier=".cg")
        tile = tl.load(partial_acc + partials + s * stride_partial_split, mask=head_valid[:, None] & in_head[None, :],
                       other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * tile
    total = tl.where(total > 0.0, total, 1.0)
    result = acc / total[:, None]
    tl.store(out + head[:, None] * stride_out_head + lanes[None, :], result.to(out.dtype.element_ty),
             mask=head_valid[:, None] & in_head[None, :])


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "num_splits", "split_align"], cache_results=True)
@triton.jit
def _fused_decode_kernel(
    qkv, q_weight, k_weight, table, positions, key, value,
    partial_acc, partial_max, partial_sum, counters, out,
    num_splits, split_align, scale_log2, eps,
    stride_qkv_row, stride_table_row,
    stride_cache_batch, stride_cache_head, stride_cache_position,
    stride_partial_batch, stride_partial_head, stride_partial_split,
    stride_stat_batch, stride_stat_head,
    stride_out_batch, stride_out_head,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    position = tl.load(positions + batch)
    length = position + 1
    split_length = tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), split_align), 1) * split_align
    begin = split * split_length
    if begin < length:  # splits past the sequence's end do nothing (and do not count)
        end = tl.minimum(begin + split_length, length)
        row = qkv + batch.to(tl.int64) * stride_qkv_row
        table_row = table + position.to(tl.int64) * stride_table_row
        group_rows = tl.arange(0, BLOCK_H)
        head = kv_head * GROUP + group_rows
        head_valid = group_rows < GROUP
        lanes = tl.arange(0, BLOCK_D)
        in_head = lanes < HEAD_DIM
        q_tile = norm_rotate_rows(row + head * HEAD_DIM, head_valid, q_weight, table_row, eps,
                                  HEAD_DIM, ROTARY_DIM, BLOCK_D).to(qkv.dtype.element_ty)
        key_base = key + batch.to(tl.int64) * stride_cache_batch + kv_head.to(tl.int64) * stride_cache_head
        value_base = value + batch.to(tl.int64) * stride_cache_batch + kv_head.to(tl.int64) * stride_cache_head
        if position < begin + split_length:  # this split holds the new key: write it, then read it back
            one = tl.arange(0, 1)
            new_key = norm_rotate_rows(row + NUM_HEADS * HEAD_DIM + kv_head * HEAD_DIM + one, one == 0, k_weight,
                                       table_row, eps, HEAD_DIM, ROTARY_DIM, BLOCK_D)
            new_value = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + lanes[None, :],
                                mask=in_head[None, :], other=0.0)
            at = position.to(tl.int64) * stride_cache_position + lanes[None, :]
            tl.store(key_base + at, new_key.to(key.dtype.element_ty), mask=in_head[None, :])
            tl.store(value_base + at, new_value.to(value.dtype.element_ty), mask=in_head[None, :])
            tl.debug_barrier()  # every thread's stores before any thread's loads of the tile that holds them

        keys_in_tile = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for tile_start in range(begin, end, BLOCK_N):
            n = tile_start + keys_in_tile
            valid = n < end
            loaded = valid[:, None] & in_head[None, :]
            k = tl.load(key_base + n[:, None] * stride_cache_position + lanes[None, :], mask=loaded, other=0.0)
            v = tl.load(value_base + n[:, None] * stride_cache_position + lanes[None, :], mask=loaded, other=0.0)
            m_i, l_i, acc = online_softmax_step(q_tile, k, v, m_i, l_i, acc, scale_log2, valid[None, :],
                                                MASKED=True, IEEE=IEEE)

        stats = batch.to(tl.int64) * stride_stat_batch + head * stride_stat_head
        tl.store(partial_max + stats + split, m_i, mask=head_valid)
        tl.store(partial_sum + stats + split, l_i, mask=head_valid)
        partials = batch.to(tl.int64) * stride_partial_batch + head[:, None] * stride_partial_head + lanes[None, :]
        tl.store(partial_acc + partials + split * stride_partial_split, acc, mask=head_valid[:, None] & in_head[None, :])
        # every thread's partial stores precede the release of the arrival count
        tl.debug_barrier()
        counter = counters + batch * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        active = tl.cdiv(length, split_length)
        if arrived == active - 1:
            _merge_splits(partial_acc, partial_max, partial_sum, out + batch.to(tl.int64) * stride_out_batch, stats,
                          partials, head, head_valid, lanes, in_head, active, stride_partial_split, stride_out_head,
                          BLOCK_H, BLOCK_D)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


_WORKSPACES: dict = {}


def _workspace(device, batch: int, num_heads: int, num_kv_heads: int, num_splits: int, head_dim: int):
    """Partials [B, Hq, S, D], maxima and sums [B, Hq, S] (float32) and the zeroed arrival counters [B, Hkv],
    allocated once per shape (calls on one stream may share them, calls on concurrent streams must not)."""
    key = (device, batch, num_heads, num_kv_heads, num_splits, head_dim)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(batch, num_heads, num_splits, head_dim, device=device, dtype=torch.float32),
            torch.empty(batch, num_heads, num_splits, device=device, dtype=torch.float32),
            torch.empty(batch, num_heads, num_splits, device=device, dtype=torch.float32),
            torch.zeros(batch, num_kv_heads, device=device, dtype=torch.int32),
        )
    return _WORKSPACES[key]


def attention_decode_fused(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    max_length: int | None = None,
    num_splits: int | None = None,
    split_align: int = DEFAULT_SPLIT_ALIGN,
    pdl: bool = False,
) -> torch.Tensor:
    """One decode token of each of slots 0..B-1: qk_norm_rotary (ungated layout) then attention_decode.

    qkv [B, (Hq + 2 Hkv) D] (rows may be strided, unit last stride): q, k, v of each slot's new token;
    positions int32 [B] on the device: the token's position p (it attends to keys 0..p, its own included, and
    its k and v are written at p); key_cache, value_cache [max_batch, Hkv, max_length, D] in qkv's dtype, slot
    b at index b; cos_sin float32 [max_length, R] (`rotary_table`). Positions must lie below the cache's and
    the table's length (not checked: device data). max_length, num_splits, split_align: as attention_decode.
    Returns out [B, Hq, D] in qkv's dtype. Capturable in a CUDA graph after a warm-up call at the same shapes.
    """
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    check_tensor("key_cache", key_cache, shape=(None, num_kv_heads, None, None), dtype=ACTIVATION_DTYPES)
    max_batch, _, cache_length, head_dim = key_cache.shape
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=key_cache.dtype)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache strides {value_cache.stride()} differ from key_cache's {key_cache.stride()}")
    check_tensor("qkv", qkv, shape=(None, (num_heads + 2 * num_kv_heads) * head_dim), dtype=key_cache.dtype)
    batch = qkv.shape[0]
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv must have a unit last stride, got strides {qkv.stride()}")
    if batch > max_batch:
        raise ValueError(f"qkv has {batch} rows, more than key_cache's {max_batch} slots")
    check_tensor("q_norm_weight", q_norm_weight, shape=(head_dim,), dtype=ACTIVATION_DTYPES)
    check_tensor("k_norm_weight", k_norm_weight, shape=(head_dim,), dtype=ACTIVATION_DTYPES)
    check_tensor("cos_sin", cos_sin, shape=(None, None), dtype=torch.float32)
    rotary_dim = cos_sin.shape[1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin has {rotary_dim} columns: the rotary dim must be even and at most {head_dim}")
    check_tensor("positions", positions, shape=(batch,), dtype=torch.int32, contiguous=True)
    max_length = cache_length if max_length is None else max_length
    if not 0 < max_length <= cache_length:
        raise ValueError(f"max_length {max_length} must be in 1..{cache_length} (key_cache's length)")
    if split_align <= 0:
        raise ValueError(f"split_align must be positive, got {split_align}")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    check_tensor("out", out, shape=(batch, num_heads, head_dim), dtype=qkv.dtype)
    check_same_device(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos_sin=cos_sin,
                      positions=positions, key_cache=key_cache, value_cache=value_cache, out=out)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_splits(batch, num_kv_heads, max_length, qkv.device, split_align)
    if num_splits <= 0:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    group = num_heads // num_kv_heads
    partial_acc, partial_max, partial_sum, counters = _workspace(qkv.device, batch, num_heads, num_kv_heads,
                                                                 num_splits, head_dim)
    _fused_decode_kernel[(num_splits, num_kv_heads, batch)](
        qkv, q_norm_weight, k_norm_weight, cos_sin, positions, key_cache, value_cache,
        partial_acc, partial_max, partial_sum, counters, out,
        num_splits, split_align, LOG2_E / math.sqrt(head_dim), eps,
        qkv.stride(0), cos_sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        partial_acc.stride(0), partial_acc.stride(1), partial_acc.stride(2),
        partial_max.stride(0), partial_max.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=qkv.dtype == torch.float32, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


__all__ = ["attention_decode_fused"]
