"""Decode attention: one query token per sequence against its KV cache, split over the keys.

For row b, the sequence in cache slot s = slots[b] with L_b = lengths[b] valid keys (its own new key
included), q [B, Hq, D]:
    out[b, h] = sum_{j < L_b} softmax_j(q[b, h] . k[s, h // G, j] / sqrt(D)) v[s, h // G, j],  G = Hq / Hkv
A row whose slot is negative (a padding row of a batch bucket) reads no keys and gets zeros, as L_b = 0 does.

Batch-1 decode has only Hkv = 2 KV heads, far too few programs for 132 SMs, so the keys are split
(flash-decoding). Two kernels:
  1. split: grid (S, Hkv, B). The S splits of row b share its keys evenly in whole multiples of
     `split_align` keys: split_length = ceil(ceil(L_b / S) / split_align) * split_align, split s owns keys
     [s split_length, (s+1) split_length) clipped to L_b. Each program loads a K/V tile once for all G
     query heads of its KV head (the G heads are the rows of one tensor-core product, padded to 16) and
     keeps an online softmax: it writes the partial max m_s (log2 domain), sum l_s and the unnormalised
     fp32 accumulator a_s. Splits past L_b (split s with s split_length >= L_b) write nothing.
  2. merge: grid (Hq, B, D / BLOCK_D). It recomputes the active split count ceil(L_b / split_length)
     from the device length and folds them in a fixed order: M = max m_s,
     out = sum_s exp2(m_s - M) a_s / sum_s exp2(m_s - M) l_s,
     times sigmoid(gate) when a gate is given (Qwen3.5's output gate, otherwise a pass before the out-projection).
The grid depends only on B, Hkv, S and D (S is chosen on the host from B, Hkv, max_length and the SM
count), never on device data (the kernels read the slots and lengths), and the workspace is cached per shape:
the pair is CUDA-graph capturable and allocates nothing after the first call. Summation order depends only on
L_b and the tuned tile size, so results are run-to-run identical.

Floor at the real shapes (Hq 8, Hkv 2, D 256, bf16, batch 1), dominated by reading K and V once:
    bytes = 2 Hkv L D 2     L=128: 256 KiB    L=4096: 8 MiB (~1.7 us at 4.8 TB/s)    L=32768: 64 MiB (~14 us)
    FLOPs = 4 Hq L D        L=128: 1.0 MFLOP  L=4096: 33.6 MFLOP                     L=32768: 268 MFLOP
The partials add S Hq (D + 2) 4 bytes, written then read (~1 MiB at 128 active splits): ~3% at 32768.
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
    check_slots,
    check_tensor,
    launch_options,
    sequence_slot,
    sm_count,
    wait_for_previous_kernel,
)
from .prefill import online_softmax_step

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2_E = 1.4426950408889634
DEFAULT_SPLIT_ALIGN = 64
PROGRAMS_PER_SM = 2  # decode_splits' target: split programs per SM at full length (see decode_splits)


def _split_configs():
    # a 64-key K or V tile at D = 256 is 32 KiB of bf16: deep pipelines only for the smaller tiles
    return autotune_configs([
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=4),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_N": 16}, num_warps=2, num_stages=4),
    ])


# No pin: in the engine's decode step no pinned split or merge config was faster at both 128 and 32768 keys
# than the autotuner's choice (docs/decisions.md, D46; TritonModel makes the choice at full length).
@triton.autotune(configs=_split_configs(), key=["HEAD_DIM", "GROUP", "num_splits", "split_align"],
                 cache_results=True)
@triton.jit
def _decode_split_kernel(
    q, key, value, lengths, slots, partial_acc, partial_max, partial_sum,
    num_splits, split_align, scale_log2,
    stride_q_batch, stride_q_head,
    stride_k_batch, stride_k_head, stride_k_position,
    stride_v_batch, stride_v_head, stride_v_position,
    stride_partial_batch, stride_partial_head, stride_partial_split,
    stride_stat_batch, stride_stat_head,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_SLOTS: tl.constexpr, USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    split = tl.program_id(0)
    kv_head = tl.program_id(1)
    batch = tl.program_id(2)
    slot = sequence_slot(slots, batch, HAS_SLOTS)
    length = tl.where(slot >= 0, tl.load(lengths + batch), 0)  # a padding row: no keys
    split_length = tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), split_align), 1) * split_align
    begin = split * split_length
    end = tl.minimum(begin + split_length, length)  # <= begin for the splits past the length: no keys

    group_rows = tl.arange(0, BLOCK_H)
    head = kv_head * GROUP + group_rows
    head_valid = group_rows < GROUP
    lanes = tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    q_tile = tl.load(
        q + batch.to(tl.int64) * stride_q_batch + head[:, None] * stride_q_head + lanes[None, :],
        mask=head_valid[:, None] & in_head[None, :], other=0.0,
    )
    key_base = key + slot.to(tl.int64) * stride_k_batch + kv_head.to(tl.int64) * stride_k_head
    value_base = value + slot.to(tl.int64) * stride_v_batch + kv_head.to(tl.int64) * stride_v_head
    keys_in_tile = tl.arange(0, BLOCK_N)

    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile_start in range(begin, end, BLOCK_N):
        n = tile_start + keys_in_tile
        valid = n < end
        loaded = valid[:, None] & in_head[None, :]
        k = tl.load(key_base + n[:, None] * stride_k_position + lanes[None, :], mask=loaded, other=0.0)
        v = tl.load(value_base + n[:, None] * stride_v_position + lanes[None, :], mask=loaded, other=0.0)
        m_i, l_i, acc = online_softmax_step(q_tile, k, v, m_i, l_i, acc, scale_log2, valid[None, :],
                                            MASKED=True, IEEE=IEEE)

    active = begin < length
    stat = batch.to(tl.int64) * stride_stat_batch + head * stride_stat_head + split
    tl.store(partial_max + stat, m_i, mask=head_valid & active)
    tl.store(partial_sum + stat, l_i, mask=head_valid & active)
    partial = batch.to(tl.int64) * stride_partial_batch + head[:, None] * stride_partial_head \
        + split * stride_partial_split + lanes[None, :]
    tl.store(partial_acc + partial, acc, mask=head_valid[:, None] & in_head[None, :] & active)


def _merge_configs():
    return autotune_configs([
        triton.Config({"BLOCK_S": 16, "BLOCK_D": 64}, num_warps=2),
        triton.Config({"BLOCK_S": 16, "BLOCK_D": 128}, num_warps=4),
        triton.Config({"BLOCK_S": 32, "BLOCK_D": 64}, num_warps=4),
        triton.Config({"BLOCK_S": 8, "BLOCK_D": 256}, num_warps=4),
        triton.Config({"BLOCK_S": 32, "BLOCK_D": 32}, num_warps=2),
    ])


@triton.autotune(configs=_merge_configs(), key=["HEAD_DIM", "num_splits", "split_align"], cache_results=True)
@triton.jit
def _decode_merge_kernel(
    partial_acc, partial_max, partial_sum, lengths, slots, out, gate,
    num_splits, split_align,
    stride_partial_batch, stride_partial_head, stride_partial_split,
    stride_stat_batch, stride_stat_head,
    stride_out_batch, stride_out_head, stride_gate_batch,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SLOTS: tl.constexpr, HAS_GATE: tl.constexpr, USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    head = tl.program_id(0)
    batch = tl.program_id(1)
    lanes = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    slot = sequence_slot(slots, batch, HAS_SLOTS)
    length = tl.where(slot >= 0, tl.load(lengths + batch), 0)  # as the split kernel saw it
    split_length = tl.maximum(tl.cdiv(tl.cdiv(length, num_splits), split_align), 1) * split_align
    active = tl.cdiv(length, split_length)
    stats = batch.to(tl.int64) * stride_stat_batch + head * stride_stat_head
    partials = batch.to(tl.int64) * stride_partial_batch + head * stride_partial_head
    splits_in_tile = tl.arange(0, BLOCK_S)

    running_max = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for tile_start in range(0, active, BLOCK_S):
        s = tile_start + splits_in_tile
        m = tl.load(partial_max + stats + s, mask=s < active, other=float("-inf"))
        running_max = tl.maximum(running_max, m)
    overall_max = tl.max(running_max, axis=0)

    acc = tl.zeros([BLOCK_S, BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_S], tl.float32)
    for tile_start in range(0, active, BLOCK_S):
        s = tile_start + splits_in_tile
        used = s < active
        m = tl.load(partial_max + stats + s, mask=used, other=float("-inf"))
        weight = tl.exp2(m - overall_max)
        total += weight * tl.load(partial_sum + stats + s, mask=used, other=0.0)
        tile = tl.load(partial_acc + partials + s[:, None] * stride_partial_split + lanes[None, :],
                       mask=used[:, None] & in_head[None, :], other=0.0)
        acc += weight[:, None] * tile
    denominator = tl.sum(total, axis=0)
    denominator = tl.where(denominator > 0.0, denominator, 1.0)  # length 0: zeros, not NaN
    result = (tl.sum(acc, axis=0) / denominator).to(out.dtype.element_ty)
    if HAS_GATE:  # the output gate, rounded as the projection's prologue rounds it (linear/fusion.py, prologue)
        gate_value = tl.load(gate + batch.to(tl.int64) * stride_gate_batch + head * HEAD_DIM + lanes, mask=in_head,
                             other=0.0).to(tl.float32)
        result = (result.to(tl.float32) * tl.sigmoid(gate_value)).to(out.dtype.element_ty)
    tl.store(out + batch.to(tl.int64) * stride_out_batch + head * stride_out_head + lanes, result, mask=in_head)


_WORKSPACES: dict = {}


def decode_splits(
    batch: int, num_kv_heads: int, max_length: int, device, split_align: int = DEFAULT_SPLIT_ALIGN
) -> int:
    """The split count S: about PROGRAMS_PER_SM programs per SM at full length, no split shorter than
    split_align.

    Host-only: S depends on the shapes and the device, never on the current lengths.
    """
    device = torch.device(device)
    wanted = math.ceil(PROGRAMS_PER_SM * sm_count(device) / max(1, batch * num_kv_heads))
    return max(1, min(wanted, triton.cdiv(max_length, split_align)))


def _workspace(device, batch: int, num_heads: int, num_splits: int, head_dim: int):
    key = (device, batch, num_heads, num_splits, head_dim)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = (
            torch.empty(batch, num_heads, num_splits, head_dim, device=device, dtype=torch.float32),
            torch.empty(batch, num_heads, num_splits, device=device, dtype=torch.float32),
            torch.empty(batch, num_heads, num_splits, device=device, dtype=torch.float32),
        )
    return _WORKSPACES[key]


def attention_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    lengths: torch.Tensor,
    out: torch.Tensor | None = None,
    max_length: int | None = None,
    *,
    slots: torch.Tensor | None = None,
    num_splits: int | None = None,
    split_align: int = DEFAULT_SPLIT_ALIGN,
    gate: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (one token of each of B sequences) over the first lengths[b] keys of cache slot
    slots[b], row b's sequence.

    key_cache, value_cache [max_batch, Hkv, max_length, D] in q's dtype; lengths int32 [B] on the device
    (each at most max_length; 0 gives zeros); slots int32 [B] on the device (distinct, below max_batch; a
    negative slot: a padding row, zeros; None: row b is slot b). max_length (default: the cache's) is the
    longest length the call must serve; with B and the SM count it fixes the split count, unless num_splits is
    given.
    gate [B, Hq * D] (row stride free, unit column stride): out is multiplied by sigmoid(gate) as the merge stores it,
    rounded to q's dtype before and after, as the out-projection's gate prologue would (Qwen3.5's output gate, one
    launch fewer).
    Returns out [B, Hq, D] in q's dtype. Host-read free: capturable in a CUDA graph after a warm-up call
    at the same shapes (the warm-up autotunes and allocates the workspace). pdl: launch both kernels with
    programmatic dependent launch (Hopper; operators/common.py).
    """
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    batch, num_heads, head_dim = q.shape
    check_tensor("key_cache", key_cache, shape=(None, None, None, head_dim), dtype=q.dtype)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=q.dtype)
    max_batch, num_kv_heads, cache_length, _ = key_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads: expected a multiple of key_cache's {num_kv_heads} KV heads")
    if batch > max_batch:
        raise ValueError(f"q has batch {batch}, more than key_cache's {max_batch} slots")
    check_tensor("lengths", lengths, shape=(batch,), dtype=torch.int32, contiguous=True)
    slots, has_slots = check_slots(slots, batch, lengths)
    max_length = cache_length if max_length is None else max_length
    if not 0 < max_length <= cache_length:
        raise ValueError(f"max_length {max_length} must be in 1..{cache_length} (key_cache's length)")
    if split_align <= 0:
        raise ValueError(f"split_align must be positive, got {split_align}")
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, device=q.device, dtype=q.dtype)
    check_tensor("out", out, shape=(batch, num_heads, head_dim), dtype=q.dtype)
    if gate is not None:
        check_tensor("gate", gate, shape=(batch, num_heads * head_dim), dtype=q.dtype)
    check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, lengths=lengths, slots=slots, out=out,
                      gate=gate)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_splits(batch, num_kv_heads, max_length, q.device, split_align)
    if num_splits <= 0:
        raise ValueError(f"num_splits must be positive, got {num_splits}")
    group = num_heads // num_kv_heads
    partial_acc, partial_max, partial_sum = _workspace(q.device, batch, num_heads, num_splits, head_dim)
    _decode_split_kernel[(num_splits, num_kv_heads, batch)](
        q, key_cache, value_cache, lengths, slots, partial_acc, partial_max, partial_sum,
        num_splits, split_align, LOG2_E / math.sqrt(head_dim),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        partial_acc.stride(0), partial_acc.stride(1), partial_acc.stride(2),
        partial_max.stride(0), partial_max.stride(1),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=q.dtype == torch.float32,
        HAS_SLOTS=has_slots, USE_PDL=pdl, **launch_options(pdl),
    )
    merge_grid = lambda meta: (num_heads, batch, triton.cdiv(head_dim, meta["BLOCK_D"]))  # noqa: E731
    _decode_merge_kernel[merge_grid](
        partial_acc, partial_max, partial_sum, lengths, slots, out, out if gate is None else gate,
        num_splits, split_align,
        partial_acc.stride(0), partial_acc.stride(1), partial_acc.stride(2),
        partial_max.stride(0), partial_max.stride(1),
        out.stride(0), out.stride(1), 0 if gate is None else gate.stride(0),
        HEAD_DIM=head_dim, HAS_SLOTS=has_slots, HAS_GATE=gate is not None, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def attention_decode_cost(batch: int, length: int, num_heads: int, num_kv_heads: int, head_dim: int,
                          element_bytes: int = 2):
    """(bytes, FLOPs) floor: K and V of `length` keys per slot once, q and out once; QK^T and PV."""
    data = (2 * batch * num_kv_heads * length + 2 * batch * num_heads) * head_dim * element_bytes
    return data, 4 * batch * num_heads * length * head_dim


__all__ = ["attention_decode", "attention_decode_cost", "decode_splits"]
