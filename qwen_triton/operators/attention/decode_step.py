"""An attention layer's decode step after its input projection, in one launch: the q/k norms and rotary, the KV
write, the split attention and the merge.

The decode step used to run three kernels here: `qk_norm_rotary` (q and k normed and rotated, k and v written
into the cache), then `attention_decode`'s split and merge kernels. Each is a few microseconds of latency with
almost no bytes (at context 128 the cache is 256 KiB), so at short contexts the boundaries are the cost. This
kernel does the same arithmetic in one grid (S, Hkv, B), the split kernel's grid:

1. The program whose split owns the new position p = positions[b] (split p // split_length) norms and rotates
   the new key, writes it and the value into the cache of slot b, and passes a CTA barrier before its own loads
   of the keys: no other program reads position p (it lies in that split's range only).
2. A program with keys (an active split) norms and rotates the GROUP query heads of its KV head from the qkv row
   (`norm_rotate_head`, qk_norm_rotary's function, rounded to the activation dtype as that kernel stores q),
   runs `split_attention` over its keys and stores its partials, as `attention_decode`'s split kernel does.
3. Every program, active or not, then adds one to its (slot, KV head) counter (a CTA barrier first, so every
   thread's partial stores precede the release). The program that arrives last merges the active splits of
   its GROUP heads (`merged_splits`, reading the partials from L2) into out and zeroes the counter for the next
   launch: no kernel waits for another, and a merge begins when the last split of its KV head ends.

So the merge's reads go through one program per KV head (at context 32768 and 132 splits, 4 x 132 x 1 KiB of
partials) where the merge kernel spread them over Hq x D / BLOCK_D programs: the price of the launch saved.
Slot b of the cache is row b of qkv (the engine's decode: slots 0..B-1), and the new key's position is
positions[b] while the keys attended are the first lengths[b] (the engine's positions + 1).

The summation order depends only on lengths[b], the split count and the tile size, as for attention_decode: a
row's result does not depend on the batch it runs in. It is not bit for bit attention_decode's (the merge folds
BLOCK_S splits a tile, and q's norm runs in this kernel's layout), and matches it within rounding (tests).

Floor: as attention_decode's (K and V of lengths[b] keys, 2 Hkv L D 2 bytes) plus qkv's q, k, v read once and the
new key and value written: at Qwen3.5-0.8B's shape and context 128, 256 KiB + 6 KiB; one launch of latency.
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
from .decode import DEFAULT_SPLIT_ALIGN, LOG2_E, _workspace, decode_splits, fold_splits, normalized, split_attention, \
    store_partials
from .qk_norm_rotary import check_norm_rotary_inputs, norm_rotate_head

MERGE_SPLITS = 8  # the splits a merge step folds (BLOCK_S): a [8, 256] float32 tile of partials


def _configs():
    # the split kernel's tiles (decode.py); each program also holds its GROUP query rows and the merge's tile
    return autotune_configs([
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 16}, num_warps=2, num_stages=4),
    ])


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "num_splits", "split_align"], cache_results=True)
@triton.jit
def _decode_step_kernel(
    qkv, q_weight, k_weight, table, positions, lengths, key, value, partial_acc, partial_max, partial_sum,
    arrivals, out,
    num_splits, split_align, scale_log2, eps,
    stride_qkv_row, stride_table_row,
    stride_cache_batch, stride_cache_head, stride_cache_position,
    stride_partial_batch, stride_partial_head, stride_partial_split,
    stride_stat_batch, stride_stat_head,
    stride_out_batch, stride_out_head,
    HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    GATED: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    length = tl.load(lengths + batch)
    position = tl.load(positions + batch)
    split_length = tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), split_align), 1) * split_align
    begin = split * split_length
    end = tl.minimum(begin + split_length, length)  # <= begin for the splits past the length: no keys

    Q_STRIDE: tl.constexpr = 2 * HEAD_DIM if GATED else HEAD_DIM
    K_START: tl.constexpr = NUM_HEADS * Q_STRIDE
    V_START: tl.constexpr = K_START + NUM_KV_HEADS * HEAD_DIM
    row_start = qkv + batch.to(tl.int64) * stride_qkv_row
    table_row = table + position.to(tl.int64) * stride_table_row
    lanes = tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    dtype = key.dtype.element_ty
    cache = batch.to(tl.int64) * stride_cache_batch + kv_head.to(tl.int64) * stride_cache_head

    # 1. the new key and value, by the split that owns their position, before its own loads of the keys
    if tl.minimum(position // split_length, num_splits - 1) == split:
        new = cache + position.to(tl.int64) * stride_cache_position + lanes
        k = norm_rotate_head(row_start + K_START + kv_head * HEAD_DIM, k_weight, table_row, eps,
                             HEAD_DIM, ROTARY_DIM, BLOCK_D)
        tl.store(key + new, k.to(dtype), mask=in_head)
        v = tl.load(row_start + V_START + kv_head * HEAD_DIM + lanes, mask=in_head, other=0.0)
        tl.store(value + new, v.to(dtype), mask=in_head)
        tl.debug_barrier()  # every thread's stores before any thread's loads of the position

    # 2. the split's partials over its keys, q normed and rotated here
    group_rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + group_rows
    head_valid = group_rows < GROUP
    active = begin < length
    if active:
        q_tile = tl.zeros([BLOCK_H, BLOCK_D], dtype)
        for row in tl.static_range(GROUP):
            q = norm_rotate_head(row_start + (kv_head * GROUP + row) * Q_STRIDE, q_weight, table_row, eps,
                                 HEAD_DIM, ROTARY_DIM, BLOCK_D)
            q_tile = tl.where(group_rows[:, None] == row, q.to(dtype)[None, :], q_tile)
        m_i, l_i, acc = split_attention(q_tile, key + cache, value + cache, begin, end, stride_cache_position,
                                        stride_cache_position, lanes, in_head, scale_log2, IEEE, BLOCK_N)
        store_partials(partial_acc, partial_max, partial_sum, m_i, l_i, acc, batch, head, split, active,
                       head_valid, lanes, in_head, stride_partial_batch, stride_partial_head, stride_partial_split,
                       stride_stat_batch, stride_stat_head)

    # 3. the merge, in blocks of BLOCK_S consecutive splits: the last program of a block to arrive folds the block's
    # active splits (into the output if the block holds them all, else into a block partial in its first split's
    # slot); the last block folder to arrive folds the block partials into the output
    tl.debug_barrier()  # every thread's partial stores before the release
    active_splits = tl.cdiv(length, split_length)
    block = split // BLOCK_S
    if block * BLOCK_S < active_splits:  # blocks without an active split take no part
        counters = arrivals + (batch * NUM_KV_HEADS + kv_head) * (tl.cdiv(num_splits, BLOCK_S) + 1)
        block_size = tl.minimum(num_splits - block * BLOCK_S, BLOCK_S)
        arrived = tl.atomic_add(counters + block, 1, sem="acq_rel", scope="gpu")
        if arrived == block_size - 1:
            tl.atomic_xchg(counters + block, 0, sem="relaxed", scope="gpu")  # left zero for the next launch
            first = block * BLOCK_S
            in_block = tl.minimum(active_splits - first, BLOCK_S)
            for row in tl.static_range(GROUP):
                stats = batch.to(tl.int64) * stride_stat_batch + (kv_head * GROUP + row) * stride_stat_head
                partials = batch.to(tl.int64) * stride_partial_batch + (kv_head * GROUP + row) * stride_partial_head
                fold_max, total, acc = fold_splits(partial_acc, partial_max, partial_sum, stats, partials, first,
                                                   in_block, 1, lanes, in_head, stride_partial_split, BLOCK_S)
                if active_splits <= BLOCK_S:
                    tl.store(out + batch.to(tl.int64) * stride_out_batch + (kv_head * GROUP + row) * stride_out_head
                             + lanes, normalized(total, acc).to(out.dtype.element_ty), mask=in_head)
                else:  # over the first split's partials, once every thread has read them
                    tl.debug_barrier()
                    tl.store(partial_max + stats + first, fold_max)
                    tl.store(partial_sum + stats + first, total)
                    tl.store(partial_acc + partials + first * stride_partial_split + lanes, acc, mask=in_head)
            if active_splits > BLOCK_S:
                tl.debug_barrier()  # every thread's block partial stores before the release
                active_blocks = tl.cdiv(active_splits, BLOCK_S)
                top = counters + tl.cdiv(num_splits, BLOCK_S)
                folded = tl.atomic_add(top, 1, sem="acq_rel", scope="gpu")
                if folded == active_blocks - 1:
                    tl.atomic_xchg(top, 0, sem="relaxed", scope="gpu")
                    for row in tl.static_range(GROUP):
                        stats = batch.to(tl.int64) * stride_stat_batch + (kv_head * GROUP + row) * stride_stat_head
                        partials = batch.to(tl.int64) * stride_partial_batch \
                            + (kv_head * GROUP + row) * stride_partial_head
                        _, total, acc = fold_splits(partial_acc, partial_max, partial_sum, stats, partials, 0,
                                                    active_blocks, BLOCK_S, lanes, in_head, stride_partial_split,
                                                    BLOCK_S)
                        tl.store(out + batch.to(tl.int64) * stride_out_batch
                                 + (kv_head * GROUP + row) * stride_out_head + lanes,
                                 normalized(total, acc).to(out.dtype.element_ty), mask=in_head)


_arrivals: dict[tuple, torch.Tensor] = {}


def _arrival_counters(device: torch.device, batch: int, num_kv_heads: int, num_splits: int) -> torch.Tensor:
    """Zeroed int32 counters, per (slot, KV head) one per block of MERGE_SPLITS splits and one for the blocks;
    every launch leaves them zero. Launches in one stream share them: a launch touches them only after its PDL
    wait, when every kernel before it has completed."""
    key = (device, batch, num_kv_heads, num_splits)
    if key not in _arrivals:
        _arrivals[key] = torch.zeros(batch, num_kv_heads, triton.cdiv(num_splits, MERGE_SPLITS) + 1,
                                     dtype=torch.int32, device=device)
    return _arrivals[key]


def attention_decode_step(
    qkv: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    lengths: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    gated: bool = True,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_align: int = DEFAULT_SPLIT_ALIGN,
    pdl: bool = False,
) -> torch.Tensor:
    """qk_norm_rotary then attention_decode, in one launch: return the attention of each row's normed and rotated
    q over its slot's first lengths[b] keys, out [B, Hq, D], after writing the row's normed and rotated k and its
    v into the cache at [b, :, positions[b]].

    qkv [B, width] as qk_norm_rotary takes it (row b is slot b's token); cos_sin from `rotary_table`; positions,
    lengths int32 [B] on the device (no host reads: graph capturable after a warm-up call at the same shapes;
    positions below the cache's and the table's length, not checked); key_cache, value_cache
    [max_batch, Hkv, max_length, D] in qkv's dtype. num_splits: as attention_decode's (default decode_splits).
    pdl: programmatic dependent launch (Hopper; operators/common.py).
    """
    batch, rotary_dim = check_norm_rotary_inputs(qkv, q_norm_weight, k_norm_weight, cos_sin, key_cache, value_cache,
                                                 num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                                 gated=gated)
    check_tensor("positions", positions, shape=(batch,), dtype=torch.int32, contiguous=True)
    check_tensor("lengths", lengths, shape=(batch,), dtype=torch.int32, contiguous=True)
    max_batch, _, cache_length, _ = key_cache.shape
    if batch > max_batch:
        raise ValueError(f"qkv has {batch} rows, more than key_cache's {max_batch} slots")
    if split_align <= 0:
        raise ValueError(f"split_align must be positive, got {split_align}")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    check_tensor("out", out, shape=(batch, num_heads, head_dim), dtype=qkv.dtype)
    check_same_device(qkv=qkv, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, cos_sin=cos_sin,
                      positions=positions, lengths=lengths, key_cache=key_cache, value_cache=value_cache, out=out)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_splits(batch, num_kv_heads, cache_length, qkv.device, split_align)
    if num_splits <= 0:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    group = num_heads // num_kv_heads
    partial_acc, partial_max, partial_sum = _workspace(qkv.device, batch, num_heads, num_splits, head_dim)
    _decode_step_kernel[(num_splits, num_kv_heads, batch)](
        qkv, q_norm_weight, k_norm_weight, cos_sin, positions, lengths, key_cache, value_cache,
        partial_acc, partial_max, partial_sum, _arrival_counters(qkv.device, batch, num_kv_heads, num_splits), out,
        num_splits, split_align, LOG2_E / math.sqrt(head_dim), eps,
        qkv.stride(0), cos_sin.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        partial_acc.stride(0), partial_acc.stride(1), partial_acc.stride(2),
        partial_max.stride(0), partial_max.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GATED=gated,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=qkv.dtype == torch.float32, BLOCK_S=MERGE_SPLITS, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


__all__ = ["attention_decode_step"]
