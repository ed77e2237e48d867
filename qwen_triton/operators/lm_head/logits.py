"""LM-head logits: logits[M, V] = rms_norm(x)? @ W[V, H].T in float32 (V = 248320, H = 1024, W tied to the
embedding table).

The projection kernels of `linear` with a float32 output: the GEMV (one program per BLOCK_N vocabulary rows over
the whole of K: 248320 / BLOCK_N programs fill the GPU without splitting K; it reads W once a row), or the GEMM,
which reads W once for all rows (gemv=False; by default the GEMV for M <= 16). The final norm can be fused as the
prologue (norm_weight=; the GEMM runs it as a pass of its own).

Floor at M = 1 (bf16 W): 248320 * 1024 * 2 = 508.6 MB of weights + 1 MB of float32 logits: 106 us at
4.8 TB/s, 0.51 GFLOP. It is the largest single read of a decode step (about a third of all the bytes);
the engine's greedy path uses lm_head_argmax, which reads the same weights but never writes the logits.
"""

from __future__ import annotations

import torch

from ..linear import linear


def lm_head_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
    gemv: bool | None = None,
) -> torch.Tensor:
    """float32 logits [M, V] of x [M, H] against weight [V, H] (optionally zero-centred-RMSNorm-ing x first);
    pdl: programmatic dependent launch of the GEMV (Hopper; operators/common.py)."""
    return linear(x, weight, norm_weight=norm_weight, eps=eps, out=out, out_dtype=torch.float32, split_k=False,
                  pdl=pdl, gemv=gemv)
