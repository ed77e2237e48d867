"""The gated delta rule of the Gated DeltaNet layers (18 of the 24): between the causal conv and out_proj.

    gating                       g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (fused into the two below)
    gated_delta_rule_chunked     prefill of one sequence, 32 or 64 tokens at a time (the UT / WY form)
    gated_delta_rule_chunked_packed  the same for the sequences of a packed layout, each from and to its slot
    gated_delta_rule_recurrent   one decode step of B sequences, the float32 state updated in place
    gated_rms_norm               per-head RMSNorm of the output, gated by silu(z)
    gated_delta_rule_decode_fused  conv step + gates + norms + recurrent step + gated norm of a layer's
                                 decode, in one kernel (the three launchers above and the conv step, fused)
    gated_delta_rule_decode_projected  one sequence's decode from the layer's input row: the in-projection
                                 GEMV's tiles and the fused step's work, in one kernel (projected_decode.py)
"""

from __future__ import annotations

import torch

from ..common import built_on_first_call
from .chunk import gated_delta_rule_chunked, gated_delta_rule_chunked_cost, gated_delta_rule_chunked_packed
from .fused_decode import gated_delta_rule_decode_fused, gated_delta_rule_decode_fused_cost
from .projected_decode import gated_delta_rule_decode_projected, gated_delta_rule_decode_projected_cost
from .gated_rms_norm import gated_rms_norm, gated_rms_norm_cost
from .gating import gating, gating_cost
from .recurrent import gated_delta_rule_recurrent, gated_delta_rule_recurrent_cost

# Qwen3.5-0.8B's Gated DeltaNet shapes
NUM_KEY_HEADS, NUM_VALUE_HEADS, KEY_DIM, VALUE_DIM = 16, 16, 128, 128


def benchmark_cases(device="cuda", dtype=torch.bfloat16) -> list[dict]:
    """Timed cases at the real 0.8B shapes: dicts of name, fn (a no-argument callable), bytes, flops.

    Inputs are built by the first call of each `fn` (listing the cases allocates nothing) and reused;
    the first call also autotunes, so time after a warm-up call. q, k, v are views of a conv output
    [T, 6144] and a, b, z views of the fused projection row [qkv | z | b | a], as the engine passes them.
    """
    Hk, Hv, Dk, Dv = NUM_KEY_HEADS, NUM_VALUE_HEADS, KEY_DIM, VALUE_DIM
    conv_dim = 2 * Hk * Dk + Hv * Dv


    def layer_inputs(rows: int):
        mixed = torch.randn(rows, conv_dim, device=device, dtype=dtype)
        projection = torch.randn(rows, conv_dim + Hv * Dv + 2 * Hv, device=device, dtype=dtype)
        q = mixed[:, :Hk * Dk].view(rows, Hk, Dk)
        k = mixed[:, Hk * Dk:2 * Hk * Dk].view(rows, Hk, Dk)
        v = mixed[:, 2 * Hk * Dk:].view(rows, Hv, Dv)
        z = projection[:, conv_dim:conv_dim + Hv * Dv]
        b = projection[:, conv_dim + Hv * Dv:conv_dim + Hv * Dv + Hv]
        a = projection[:, conv_dim + Hv * Dv + Hv:]
        A_log = torch.empty(Hv, device=device).uniform_(1, 16).log()
        dt_bias = torch.full((Hv,), -4.0, device=device)
        return q, k, v, z, b, a, A_log, dt_bias

    def chunked_case(length: int, dot_precision=None):
        def build():
            q, k, v, _, b, a, A_log, dt_bias = layer_inputs(length)
            state = torch.zeros(Hv, Dk, Dv, device=device)
            out = torch.empty(length, Hv, Dv, device=device, dtype=dtype)
            return lambda: gated_delta_rule_chunked(
                q, k, v, a, b, A_log, dt_bias, state, out=out, dot_precision=dot_precision)

        data, flops = gated_delta_rule_chunked_cost(length, Hk, Hv, Dk, Dv)
        suffix = "" if dot_precision is None else f" {dot_precision}"
        return {"name": f"gated_delta_rule.chunked T={length}{suffix}", "fn": built_on_first_call(build), "bytes": data,
                "flops": flops}

    def recurrent_case(batch: int):
        def build():
            q, k, v, _, b, a, A_log, dt_bias = layer_inputs(batch)
            state = torch.zeros(batch, Hv, Dk, Dv, device=device)
            out = torch.empty(batch, Hv, Dv, device=device, dtype=dtype)
            return lambda: gated_delta_rule_recurrent(q, k, v, a, b, A_log, dt_bias, state, out=out)

        data, flops = gated_delta_rule_recurrent_cost(batch, Hk, Hv, Dk, Dv)
        return {"name": f"gated_delta_rule.recurrent B={batch}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    def norm_case(rows: int):
        def build():
            _, _, _, z, _, _, _, _ = layer_inputs(rows)
            x = torch.randn(rows, Hv, Dv, device=device, dtype=dtype)
            weight = torch.ones(Dv, device=device, dtype=dtype)
            out = torch.empty(rows, Hv * Dv, device=device, dtype=dtype)
            return lambda: gated_rms_norm(x, z, weight, 1e-6, out=out)

        data, flops = gated_rms_norm_cost(rows, Hv, Dv)
        return {"name": f"gated_delta_rule.gated_rms_norm M={rows}", "fn": built_on_first_call(build), "bytes": data,
                "flops": flops}

    def fused_decode_case(batch: int):
        def build():
            _, _, _, z, b, a, A_log, dt_bias = layer_inputs(batch)
            x = torch.randn(batch, conv_dim + 2048, device=device, dtype=dtype)[:, :conv_dim]
            conv_weight = torch.randn(conv_dim, 4, device=device, dtype=dtype) * 0.5
            conv_state = torch.zeros(batch, conv_dim, 3, device=device, dtype=dtype)
            norm_weight = torch.ones(Dv, device=device, dtype=dtype)
            state = torch.zeros(batch, Hv, Dk, Dv, device=device)
            delta_out = torch.empty(batch, Hv, Dv, device=device, dtype=dtype)
            out = torch.empty(batch, Hv * Dv, device=device, dtype=dtype)
            return lambda: gated_delta_rule_decode_fused(
                x, z, a, b, conv_weight, conv_state, A_log, dt_bias, norm_weight, 1e-6, state,
                out=out, delta_out=delta_out)

        data, flops = gated_delta_rule_decode_fused_cost(batch, Hk, Hv, Dk, Dv)
        return {"name": f"gated_delta_rule.decode_fused B={batch}", "fn": built_on_first_call(build), "bytes": data,
                "flops": flops}

    def projected_decode_case():
        def build():
            hidden_size, rows = 1024, conv_dim + Hv * Dv + 2 * Hv
            hidden = torch.randn(1, hidden_size, device=device, dtype=dtype)
            input_norm = torch.randn(hidden_size, device=device, dtype=dtype) * 0.1
            weight = torch.randn(rows, hidden_size, device=device, dtype=dtype) * hidden_size**-0.5
            conv_weight = torch.randn(conv_dim, 4, device=device, dtype=dtype) * 0.5
            conv_state = torch.zeros(1, conv_dim, 3, device=device, dtype=dtype)
            _, _, _, _, _, _, A_log, dt_bias = layer_inputs(1)
            state = torch.zeros(1, Hv, Dk, Dv, device=device)
            projection = torch.empty(1, rows, device=device, dtype=dtype)
            qk = torch.empty(1, 2 * Hk * Dk, device=device, dtype=dtype)
            delta_out = torch.empty(1, Hv, Dv, device=device, dtype=dtype)
            return lambda: gated_delta_rule_decode_projected(
                hidden, input_norm, 1e-6, weight, conv_weight, conv_state, A_log, dt_bias, state, projection, qk,
                delta_out)

        data, flops = gated_delta_rule_decode_projected_cost(1024, Hk, Hv, Dk, Dv)
        return {"name": "gated_delta_rule.decode_projected B=1", "fn": built_on_first_call(build), "bytes": data,
                "flops": flops}

    def gating_case(rows: int):
        def build():
            _, _, _, _, b, a, A_log, dt_bias = layer_inputs(rows)
            out = (torch.empty(rows, Hv, device=device), torch.empty(rows, Hv, device=device))
            return lambda: gating(a, b, A_log, dt_bias, out=out)

        data, flops = gating_cost(rows, Hv)
        return {"name": f"gated_delta_rule.gating M={rows}", "fn": built_on_first_call(build), "bytes": data, "flops": flops}

    return [
        chunked_case(128), chunked_case(4096), chunked_case(4096, "tf32"),
        recurrent_case(1), recurrent_case(4), fused_decode_case(1), fused_decode_case(4), projected_decode_case(),
        norm_case(1), norm_case(4096),
        gating_case(1),
    ]


__all__ = [
    "gating", "gated_delta_rule_chunked", "gated_delta_rule_chunked_packed", "gated_delta_rule_recurrent",
    "gated_rms_norm", "benchmark_cases",
    "gated_delta_rule_decode_fused", "gating_cost", "gated_delta_rule_chunked_cost",
    "gated_delta_rule_recurrent_cost", "gated_rms_norm_cost", "gated_delta_rule_decode_fused_cost",
    "gated_delta_rule_decode_projected", "gated_delta_rule_decode_projected_cost",
]
