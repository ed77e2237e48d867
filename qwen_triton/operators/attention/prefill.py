"""Causal grouped-query attention of one sequence's prompt against its KV cache (flash attention).

For the T queries of one sequence at positions start .. start+T-1 (q [T, Hq, D], already normed and
rotated) and the cached keys/values 0 .. start+T-1 of its slot (key_cache, value_cache
[max_batch, Hkv, max_length, D]):
    out[t, h] = sum_{j <= start+t} softmax_j(q[t, h] . k[j, h // G] / sqrt(D)) v[j, h // G],   G = Hq / Hkv
Softmax is computed online in fp32 (running max m, running sum l, fp32 accumulator rescaled by
exp2(m_old - m_new)), in the log2 domain (scores scaled by log2(e) / sqrt(D)); probabilities are rounded
to the value dtype before the P.V product, as the reference (transformers' eager attention) does.

Blocking: a program owns BLOCK_M rows = BLOCK_M / G tokens x the G query heads of one KV head, so a
group's heads share each K/V tile they load (one tensor-core product covers all G heads). It walks the
keys in BLOCK_N tiles: first the tiles wholly before its first query position (no mask), then the tiles
on the causal diagonal (masked). Grid (token blocks, Hkv), the latest (longest) token blocks first.

Floor at the real shapes (Hq 8, Hkv 2, D 256, bf16, start 0):
    FLOPs  = 4 Hq D T(T+1)/2             T=128: 67.6 MFLOP     T=4096: 68.7 GFLOP (~70 us at ~1 PFLOP/s)
    bytes  = 2 T Hq D 2 (q, out) + 2 T Hkv D 2 (K, V)
                                         T=128: 1.25 MiB       T=4096: 40 MiB
Prefill of a long prompt is compute-bound; a short one is launch/latency-bound.

Packed (`attention_prefill_packed`): the rows of several sequences in the packed layout (operators/packed.py),
each against its own slot's cache. The programs take an aligned block's rows in parts of TOKENS = BLOCK_M / G
(ceil(ALIGN / TOKENS) parts a block, the last one short where TOKENS does not divide ALIGN): a part's rows are of
one sequence, whose first row, length, start and slot the block's entry gives; it runs the same loops as the
one-sequence kernel over that slot's keys (`_attend_rows`), a part of padding none. Grid (T / ALIGN x parts,
Hkv), the latest blocks first.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common import (allow_next_kernel, autotune_configs, check_same_device, check_tensor, launch_options,
                      wait_for_previous_kernel)
from ..packed import ALIGN, ALIGN_ROWS, block_sequence, check_blocks

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2_E = 1.4426950408889634
MAX_GROUP = 64  # the smallest BLOCK_M below: a program holds at least one token's group


@triton.jit
def online_softmax_step(
    q_tile, k, v, m_i, l_i, acc, scale_log2, visible, MASKED: tl.constexpr, IEEE: tl.constexpr,
):
    """Fold one K/V tile into the running (max, sum, accumulator) of every row (prefill and decode)."""
    if IEEE:
        scores = tl.dot(q_tile, tl.trans(k), input_precision="ieee")
    else:
        scores = tl.dot(q_tile, tl.trans(k))
    scores = scores * scale_log2
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


def _configs():
    # D = 256 makes a K or V tile of 64 keys 32 KiB in bf16: the larger tiles need few stages. All fit the
    # H200's 227 KiB of shared memory without register spills (checked with an offline sm_90 compile;
    # 64 x 64 tiles on 4 warps spill and are left out).
    return autotune_configs([
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
    ])


@triton.jit
def _attend_rows(
    q, key_base, value_base, token, head, row_valid, query_position, first_position, last_position, unmasked_end,
    scale_log2, stride_q_token, stride_q_head, stride_k_position, stride_v_position,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The attention of a program's BLOCK_M rows (row r: q row token[r], head head[r], at query_position[r]) over
    the keys of one sequence's cache (key_base, value_base: its slot's KV head), those before unmasked_end without a
    mask, then those up to last_position on the causal diagonal: [BLOCK_M, BLOCK_D] float32."""
    lanes = tl.arange(0, BLOCK_D)
    in_head = lanes < HEAD_DIM
    q_tile = tl.load(
        q + token[:, None] * stride_q_token + head[:, None] * stride_q_head + lanes[None, :],
        mask=row_valid[:, None] & in_head[None, :], other=0.0,
    )
    keys_in_tile = tl.arange(0, BLOCK_N)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a row with nothing visible yet stays NaN-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # keys before the block's first query position are visible to every row: no causal mask
    for tile_start in range(0, unmasked_end, BLOCK_N):
        n = tile_start + keys_in_tile
        k = tl.load(key_base + n[:, None] * stride_k_position + lanes[None, :], mask=in_head[None, :], other=0.0)
        v = tl.load(value_base + n[:, None] * stride_v_position + lanes[None, :], mask=in_head[None, :], other=0.0)
        m_i, l_i, acc = online_softmax_step(q_tile, k, v, m_i, l_i, acc, scale_log2, None, False, IEEE)
    # the diagonal: key n is visible to the row at position p when n <= p
    for tile_start in range(unmasked_end, last_position + 1, BLOCK_N):
        n = tile_start + keys_in_tile
        loaded = (n <= last_position)[:, None] & in_head[None, :]
        k = tl.load(key_base + n[:, None] * stride_k_position + lanes[None, :], mask=loaded, other=0.0)
        v = tl.load(value_base + n[:, None] * stride_v_position + lanes[None, :], mask=loaded, other=0.0)
        visible = n[None, :] <= query_position[:, None]
        m_i, l_i, acc = online_softmax_step(q_tile, k, v, m_i, l_i, acc, scale_log2, visible, True, IEEE)

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / l_i[:, None]


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "length_bucket", "context_bucket"], cache_results=True)
@triton.jit
def _prefill_kernel(
    q, key, value, out,
    length, start, scale_log2,
    stride_q_token, stride_q_head,
    stride_k_head, stride_k_position, stride_v_head, stride_v_position,
    stride_out_token, stride_out_head,
    length_bucket, context_bucket,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    block = tl.cdiv(length, TOKENS) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    token = block * TOKENS + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < TOKENS * GROUP) & (token < length)
    first_position = start + block * TOKENS
    last_position = tl.minimum(first_position + TOKENS, start + length) - 1
    result = _attend_rows(
        q, key + kv_head.to(tl.int64) * stride_k_head, value + kv_head.to(tl.int64) * stride_v_head, token, head,
        row_valid, start + token, first_position, last_position, (first_position // BLOCK_N) * BLOCK_N, scale_log2,
        stride_q_token, stride_q_head, stride_k_position, stride_v_position, HEAD_DIM, BLOCK_D, IEEE, BLOCK_M, BLOCK_N)
    lanes = tl.arange(0, BLOCK_D)
    tl.store(
        out + token[:, None] * stride_out_token + head[:, None] * stride_out_head + lanes[None, :],
        result.to(out.dtype.element_ty), mask=row_valid[:, None] & (lanes < HEAD_DIM)[None, :],
    )


@triton.autotune(configs=_configs(), key=["HEAD_DIM", "GROUP", "length_bucket"], cache_results=True)
@triton.jit(do_not_specialize=["length_bucket"])  # a tuning key only
def _packed_prefill_kernel(
    q, key, value, out, blocks,
    scale_log2,
    stride_q_token, stride_q_head,
    stride_k_slot, stride_k_head, stride_k_position, stride_v_slot, stride_v_head, stride_v_position,
    stride_out_token, stride_out_head,
    length_bucket,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """Grid (T / ALIGN x PARTS, Hkv): the PARTS programs of an aligned block each take TOKENS of its rows (the last
    program of a block fewer when TOKENS does not divide ALIGN), the latest blocks first."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    PARTS: tl.constexpr = (ALIGN_ROWS + TOKENS - 1) // TOKENS
    program = tl.num_programs(0) - 1 - tl.program_id(0)
    aligned_block = program // PARTS
    part = program % PARTS
    kv_head = tl.program_id(1)
    first, length, start, slot = block_sequence(blocks, aligned_block * ALIGN_ROWS)
    rows = tl.arange(0, BLOCK_M)
    in_block = part * TOKENS + rows // GROUP
    token = aligned_block * ALIGN_ROWS + in_block  # the q and out row
    head = kv_head * GROUP + rows % GROUP
    in_part = (rows < TOKENS * GROUP) & (in_block < ALIGN_ROWS)
    row_valid = in_part & (token - first < length)
    # the program's first row in its sequence, and its valid rows (none in padding, or in the bucket's tail)
    first_index = aligned_block * ALIGN_ROWS + part * TOKENS - first
    count = tl.maximum(tl.minimum(tl.minimum(TOKENS, ALIGN_ROWS - part * TOKENS), length - first_index), 0)
    first_position = start + first_index
    key_offset = tl.maximum(slot, 0).to(tl.int64)
    result = _attend_rows(
        q, key + key_offset * stride_k_slot + kv_head.to(tl.int64) * stride_k_head,
        value + key_offset * stride_v_slot + kv_head.to(tl.int64) * stride_v_head, token, head, row_valid,
        start + token - first, first_position, first_position + count - 1,
        tl.where(count > 0, (first_position // BLOCK_N) * BLOCK_N, 0), scale_log2,
        stride_q_token, stride_q_head, stride_k_position, stride_v_position, HEAD_DIM, BLOCK_D, IEEE, BLOCK_M, BLOCK_N)
    lanes = tl.arange(0, BLOCK_D)
    # a padding row's output is zero (its q too: nothing it could read is written)
    tl.store(
        out + token[:, None] * stride_out_token + head[:, None] * stride_out_head + lanes[None, :],
        tl.where(row_valid[:, None], result, 0.0).to(out.dtype.element_ty),
        mask=in_part[:, None] & (lanes < HEAD_DIM)[None, :],
    )


def attention_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot: int,
    start: int,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Causal GQA of q [T, Hq, D] (positions start .. start+T-1) against keys 0 .. start+T-1 of `slot`.

    key_cache, value_cache [max_batch, Hkv, max_length, D] in q's dtype (keys of this chunk already
    written, e.g. by qk_norm_rotary). q and out may have strided tokens/heads (unit last stride).
    Returns out [T, Hq, D] in q's dtype. pdl: launch with programmatic dependent launch (Hopper;
    operators/common.py).
    """
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    length, num_heads, head_dim = q.shape
    check_tensor("key_cache", key_cache, shape=(None, None, None, head_dim), dtype=q.dtype)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=q.dtype)
    max_batch, num_kv_heads, max_length, _ = key_cache.shape
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(
            f"q has {num_heads} heads: expected a multiple of key_cache's {num_kv_heads} KV heads, "
            f"at most {MAX_GROUP} per KV head"
        )
    if not 0 <= slot < max_batch:
        raise ValueError(f"slot {slot} is outside key_cache's {max_batch} slots")
    if start < 0 or start + length > max_length:
        raise ValueError(f"positions {start}..{start + length - 1} exceed key_cache's max_length {max_length}")
    if out is None:
        out = torch.empty(length, num_heads, head_dim, device=q.device, dtype=q.dtype)
    check_tensor("out", out, shape=(length, num_heads, head_dim), dtype=q.dtype)
    check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, out=out)
    if length == 0:
        return out
    group = num_heads // num_kv_heads
    key, value = key_cache[slot], value_cache[slot]
    grid = lambda meta: (triton.cdiv(length, meta["BLOCK_M"] // group), num_kv_heads)  # noqa: E731
    _prefill_kernel[grid](
        q, key, value, out,
        length, start, LOG2_E / math.sqrt(head_dim),
        q.stride(0), q.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        out.stride(0), out.stride(1),
        triton.next_power_of_2(length), triton.next_power_of_2(start + length),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def attention_prefill_packed(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Causal GQA of the sequences of a packed layout (operators/packed.py): q [T, Hq, D] their rows, blocks
    [T / ALIGN, 4] where they lie; sequence s's rows (positions start_s .. start_s + T_s - 1) against keys
    0 .. start_s + T_s - 1 of its slot (those of this pass already written, e.g. by qk_norm_rotary). Returns out
    [T, Hq, D]: padding rows zero."""
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    length, num_heads, head_dim = q.shape
    check_blocks(blocks, length)
    check_tensor("key_cache", key_cache, shape=(None, None, None, head_dim), dtype=q.dtype)
    check_tensor("value_cache", value_cache, shape=tuple(key_cache.shape), dtype=q.dtype)
    num_kv_heads = key_cache.shape[1]
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        raise ValueError(
            f"q has {num_heads} heads: expected a multiple of key_cache's {num_kv_heads} KV heads, "
            f"at most {MAX_GROUP} per KV head"
        )
    if out is None:
        out = torch.empty(length, num_heads, head_dim, device=q.device, dtype=q.dtype)
    check_tensor("out", out, shape=(length, num_heads, head_dim), dtype=q.dtype)
    check_same_device(q=q, key_cache=key_cache, value_cache=value_cache, blocks=blocks, out=out)
    if length == 0:
        return out
    group = num_heads // num_kv_heads

    def grid(meta):
        tokens = meta["BLOCK_M"] // group
        return length // ALIGN * triton.cdiv(ALIGN, tokens), num_kv_heads

    _packed_prefill_kernel[grid](
        q, key_cache, value_cache, out, blocks,
        LOG2_E / math.sqrt(head_dim),
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        out.stride(0), out.stride(1),
        triton.next_power_of_2(length),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        IEEE=q.dtype == torch.float32, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def attention_prefill_cost(length: int, num_heads: int, num_kv_heads: int, head_dim: int, start: int = 0,
                           element_bytes: int = 2):
    """(bytes, FLOPs) floor: q and out once, K and V of the whole context once; causal QK^T and PV."""
    visible_pairs = length * start + length * (length + 1) // 2
    flops = 4 * num_heads * head_dim * visible_pairs
    data = (2 * length * num_heads + 2 * (start + length) * num_kv_heads) * head_dim * element_bytes
    return data, flops


__all__ = ["attention_prefill", "attention_prefill_cost", "attention_prefill_packed"]
