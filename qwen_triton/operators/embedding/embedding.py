"""Token embedding: out[m, :] = table[ids[m], :], a gather of rows.

ids [M] int32 or int64, table [V, H] (Qwen3.5-0.8B: V = 248320, H = 1024, bf16; tied to the LM head),
out [M, H]. Grid (M, cdiv(H, BLOCK_H)): each program copies BLOCK_H contiguous elements of one row.
Floor: 2*M*H*2 bytes + the ids, no FLOPs: 4 KB at decode (launch-bound), 16.8 MB for a 4096-token prefill.
An id outside [0, V) gives a row of zeros (no device assert, nothing read on the host).

Autotuning: BLOCK_H and num_warps per (H, dtypes), cached on disk like the projections (linear/linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_tensor

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.autotune(
    configs=autotune_configs([
        triton.Config({"BLOCK_H": 32}, num_warps=1),  # the interpreter's: several blocks per row in the tests
        triton.Config({"BLOCK_H": 1024}, num_warps=4),
        triton.Config({"BLOCK_H": 512}, num_warps=2),
        triton.Config({"BLOCK_H": 256}, num_warps=1),
        triton.Config({"BLOCK_H": 1024}, num_warps=8),
    ]),
    key=["H"], cache_results=True,
)
@triton.jit
def _embedding_kernel(ids_ptr, table_ptr, out_ptr, V, H, stride_table, stride_out, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < V)
    mask = offs < H
    values = tl.load(table_ptr + token * stride_table + offs, mask=mask & valid, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, values, mask=mask)


def embedding(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of table [V, H] at ids [M] (int32 or int64): out [M, H] in table's dtype."""
    check_tensor("ids", ids, shape=(None,), dtype=(torch.int32, torch.int64))
    check_tensor("table", table, shape=(None, None), dtype=FLOAT_DTYPES)
    M = ids.shape[0]
    V, H = table.shape
    if out is None:
        out = torch.empty(M, H, dtype=table.dtype, device=table.device)
    else:
        check_tensor("out", out, shape=(M, H), dtype=table.dtype)
    check_same_device(ids=ids, table=table, out=out)
    if M == 0 or H == 0:
        return out

    def grid(meta):
        return (M, triton.cdiv(H, meta["BLOCK_H"]))

    _embedding_kernel[grid](ids, table, out, V, H, table.stride(0), out.stride(0))
    return out


def benchmark_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """The embedding of Qwen3.5-0.8B at decode (M = 1) and prefill (M = 4096): callables, bytes, FLOPs."""
    vocab, hidden = 248320, 1024
    table = torch.randn(vocab, hidden, device=device, dtype=dtype)
    cases = []
    for M in (1, 4096):
        ids = torch.randint(0, vocab, (M,), device=device, dtype=torch.int64)
        out = torch.empty(M, hidden, device=device, dtype=dtype)
        cases.append(dict(
            name=f"embedding M={M} H={hidden}",
            fn=lambda ids=ids, out=out: embedding(ids, table, out=out),
            bytes=2 * M * hidden * table.element_size() + M * ids.element_size(),
            flops=0,
        ))
    return cases
