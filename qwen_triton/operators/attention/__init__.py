"""Gated full attention (6 of the 24 layers): the kernels between the fused input projection and o_proj.

    qk_norm_rotary     per-head RMSNorm + RoPE of q and k, k and v written into the KV cache
    attention_prefill  causal GQA of one sequence's prompt (flash attention)
    attention_prefill_packed  the same for the sequences of a packed layout, each against its slot's cache
    attention_decode   one token per sequence, split over the keys (flash-decoding) and merged

The output gate (sigmoid) and o_proj belong to the GEMM that follows.
"""

from __future__ import annotations

import torch

from ..common import built_on_first_call
from .decode import attention_decode, attention_decode_cost, decode_splits
from .prefill import attention_prefill, attention_prefill_cost, attention_prefill_packed
from .qk_norm_rotary import qk_norm_rotary, qk_norm_rotary_cost, rotary_table

# Qwen3.5-0.8B's full-attention shapes
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, ROTARY_DIM, ROPE_THETA = 8, 2, 256, 64, 1.0e7


def benchmark_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """Timed cases at the real 0.8B shapes: dicts of name, fn (a no-argument callable), bytes, flops.

    Inputs are built lazily by the first call of each `fn` (so listing the cases allocates nothing) and
    reused after; the first call also autotunes, so time after a warm-up call.
    """
    cases = []


    def make_cache(length: int, batch: int = 1):
        shape = (batch, NUM_KV_HEADS, length, HEAD_DIM)
        return (torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype))

    def norm_rotary_case(rows: int):
        def build():
            width = (2 * NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
            qkv = torch.randn(rows, width, device=device, dtype=dtype)
            weight = torch.randn(HEAD_DIM, device=device, dtype=dtype) * 0.1
            table = rotary_table(max(rows, 4096), ROTARY_DIM, ROPE_THETA, device)
            positions = torch.arange(rows, device=device, dtype=torch.int32)
            slots = torch.zeros(rows, device=device, dtype=torch.int32)
            key_cache, value_cache = make_cache(max(rows, 4096))
            out = torch.empty(rows, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
            return lambda: qk_norm_rotary(
                qkv, weight, weight, table, positions, slots, key_cache, value_cache,
                num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, out=out,
            )

        data, flops = qk_norm_rotary_cost(rows, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        return {"name": f"attention.qk_norm_rotary rows={rows}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    def prefill_case(length: int):
        def build():
            q = torch.randn(length, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
            key_cache, value_cache = make_cache(length)
            out = torch.empty_like(q)
            return lambda: attention_prefill(q, key_cache, value_cache, 0, 0, out=out)

        data, flops = attention_prefill_cost(length, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        return {"name": f"attention.prefill T={length}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    def decode_case(length: int):
        def build():
            q = torch.randn(1, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
            key_cache, value_cache = make_cache(32768)
            lengths = torch.full((1,), length, device=device, dtype=torch.int32)
            out = torch.empty_like(q)
            return lambda: attention_decode(q, key_cache, value_cache, lengths, out=out)

        data, flops = attention_decode_cost(1, length, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
        return {"name": f"attention.decode L={length}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    cases += [norm_rotary_case(1), norm_rotary_case(4096)]
    cases += [prefill_case(128), prefill_case(4096)]
    cases += [decode_case(128), decode_case(4096), decode_case(32768)]
    return cases


__all__ = [
    "qk_norm_rotary", "rotary_table", "attention_prefill", "attention_prefill_packed", "attention_decode", "decode_splits",
    "benchmark_cases", "qk_norm_rotary_cost", "attention_prefill_cost", "attention_decode_cost",
]
