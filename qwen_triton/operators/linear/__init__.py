"""Projections: the split-K GEMV (one row), the resident-weights GEMM (a decode step of a few rows), the tiled GEMM
(more rows, prefill) and the `linear` launcher over them; and a
decode layer's out-projection and MLP: `out_projection_mlp` (three launches, one program per SM) and, for one
sequence on Hopper, `staged_out_projection_mlp` (one Gluon launch, every weight staged in shared memory)."""

from __future__ import annotations

import torch

from .linear import linear
from ..common import hopper_or_later
from .out_projection_mlp import out_projection_mlp, out_projection_mlp_cost

__all__ = ["linear", "out_projection_mlp", "out_projection_mlp_cost", "benchmark_cases", "layer_tail_cases"]

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
    return cases + layer_tail_cases(device, dtype)


def layer_tail_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """A decode layer's out-projection + residual and MLP for one token at the 0.8B shapes (H 1024, A 2048,
    I 3584): `out_projection_mlp` and, on Hopper in bfloat16, `staged_out_projection_mlp`."""
    from . import staged_out_projection_mlp as staged

    size, attended, intermediate = HIDDEN, 2048, 3584
    out_weight = torch.randn(size, attended, device=device, dtype=dtype) * attended ** -0.5
    norm_weight = torch.randn(size, device=device, dtype=dtype) * 0.1
    gate_up = torch.randn(2 * intermediate, size, device=device, dtype=dtype) * size ** -0.5
    down = torch.randn(size, intermediate, device=device, dtype=dtype) * intermediate ** -0.5
    x = torch.randn(1, attended, device=device, dtype=dtype)
    hidden = torch.randn(1, size, device=device, dtype=dtype)
    act = torch.empty(1, intermediate, device=device, dtype=dtype)
    moved, flops = out_projection_mlp_cost(1, size, attended, intermediate, element_size=out_weight.element_size())
    cases = [dict(name="layer tail out_projection_mlp (3 launches) M=1", bytes=moved, flops=flops,
                  fn=lambda: out_projection_mlp(x, out_weight, hidden, norm_weight, gate_up, down, 1e-6, act=act))]
    if dtype == torch.bfloat16 and hopper_or_later(device):
        counters = staged.new_counters(device)[0]
        descriptors = staged.weight_descriptors(out_weight, gate_up, down)
        cases.append(dict(name="layer tail staged_out_projection_mlp (1 launch) M=1", bytes=moved, flops=flops,
                          fn=lambda: staged.staged_out_projection_mlp(
                              x, out_weight, hidden, norm_weight, gate_up, down, 1e-6, counters, act=act,
                              descriptors=descriptors)))
    return cases
