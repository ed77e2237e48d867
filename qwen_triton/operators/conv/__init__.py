"""The Gated DeltaNet's causal depthwise conv1d + SiLU over the q | k | v channels.

    causal_conv1d        prefill of one sequence, the conv state carried in place
    causal_conv1d_packed prefill of the sequences of a packed layout, each carrying its slot's conv state
    causal_conv1d_step   one decode step of B sequences, the conv state shifted in place
"""

from __future__ import annotations

import torch

from ..common import built_on_first_call
from .causal_conv1d import (causal_conv1d, causal_conv1d_cost, causal_conv1d_packed, causal_conv1d_step,
                            causal_conv1d_step_cost)

# Qwen3.5-0.8B: 2 x 16 x 128 (q, k) + 16 x 128 (v) channels, width 4
CHANNELS, WIDTH = 6144, 4


def benchmark_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """Timed cases at the real 0.8B shapes: dicts of name, fn (a no-argument callable), bytes, flops.

    Inputs are built by the first call of each `fn` (listing the cases allocates nothing) and reused;
    the first call also autotunes, so time after a warm-up call. x is the q | k | v column view of the
    fused projection row [qkv | z | b | a], as the engine passes it.
    """
    row_width = CHANNELS + 2048 + 2 * 16


    def weight():
        return torch.randn(CHANNELS, WIDTH, device=device, dtype=dtype) * 0.5

    def prefill_case(length: int):
        def build():
            x = torch.randn(length, row_width, device=device, dtype=dtype)[:, :CHANNELS]
            w, state = weight(), torch.zeros(CHANNELS, WIDTH - 1, device=device, dtype=dtype)
            out = torch.empty(length, CHANNELS, device=device, dtype=dtype)
            return lambda: causal_conv1d(x, w, state, out=out)

        data, flops = causal_conv1d_cost(length, CHANNELS, WIDTH)
        return {"name": f"conv.causal_conv1d T={length}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    def step_case(batch: int):
        def build():
            x = torch.randn(batch, row_width, device=device, dtype=dtype)[:, :CHANNELS]
            w, state = weight(), torch.zeros(batch, CHANNELS, WIDTH - 1, device=device, dtype=dtype)
            out = torch.empty(batch, CHANNELS, device=device, dtype=dtype)
            return lambda: causal_conv1d_step(x, w, state, out=out)

        data, flops = causal_conv1d_step_cost(batch, CHANNELS, WIDTH)
        return {"name": f"conv.causal_conv1d_step B={batch}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    return [prefill_case(128), prefill_case(4096), step_case(1), step_case(4)]


__all__ = ["causal_conv1d", "causal_conv1d_packed", "causal_conv1d_step", "causal_conv1d_cost", "causal_conv1d_step_cost", "benchmark_cases"]
