"""Projections: the split-K GEMV (decode), the tiled GEMM (prefill) and the `linear` launcher over both; and
`out_projection_mlp`, a decode layer's out-projection and MLP, one program per SM."""

from __future__ import annotations

import torch

from .linear import linear
from .out_projection_mlp import out_projection_mlp, out_projection_mlp_cost

__all__ = ["linear", "out_projection_mlp", "out_projection_mlp_cost", "benchmark_cases"]

HIDDEN = 1024
# (name, weight rows, K, fusions): every projection of a Qwen3.5-0.8B layer
PROJECTIONS = [
    ("deltanet_in_proj+norm", 8224, HIDDEN, dict(norm=True)),
    ("attention_in_proj+norm", 5120, HIDDEN, dict(norm=True)),
    ("mlp_gate_up+norm+swiglu", 7168, HIDDEN, dict(norm=True, swiglu=True)),
    ("mlp_down+residual", HIDDEN, 3584, dict(residual=True)),
    ("attention_out_proj+gate+residual", HIDDEN, 2048, dict(gate=True, residual=True)),
    ("deltanet_out_proj+residual", HIDDEN, 2048, dict(residual=True)),
]


def benchmark_cases(device="cuda", dtype=torch.bfloat16, tokens=(1, 4096)) -> list[dict]:
    """Each projection of the model at decode (M = 1) and prefill (M = 4096 tokens), fused as the model
    runs it: dicts of name, fn (a callable running it once, into preallocated outputs), bytes (the floor
    of memory traffic: weights + x + out + residual/gate/norm weight) and flops (2*M*N*K)."""
    cases = []
    for name, rows, K, fusion in PROJECTIONS:
        weight = torch.randn(rows, K, device=device, dtype=dtype) * K ** -0.5
        N = rows // 2 if fusion.get("swiglu") else rows
        size = weight.element_size()
        for M in tokens:
            x = torch.randn(M, K, device=device, dtype=dtype)
            kwargs = dict(out=torch.empty(M, N, device=device, dtype=dtype))
            moved = rows * K + M * K + M * N
            if fusion.get("swiglu"):
                kwargs["activation"] = "swiglu"
            if fusion.get("norm"):
                kwargs["norm_weight"] = torch.randn(K, device=device, dtype=dtype) * 0.1
                moved += K
            if fusion.get("gate"):
                kwargs["gate"] = torch.randn(M, K, device=device, dtype=dtype)
                moved += M * K
            if fusion.get("residual"):
                kwargs["residual"] = torch.randn(M, N, device=device, dtype=dtype)
                moved += M * N
            cases.append(dict(
                name=f"linear {name} M={M} N={N} K={K}",
                fn=lambda x=x, weight=weight, kwargs=kwargs: linear(x, weight, **kwargs),
                bytes=moved * size,
                flops=2 * M * rows * K,
            ))
    return cases
