"""The Triton model's weights as its kernels read them, packed once at load.

Weights that are read by one projection are concatenated so each layer reads its input once: attention
[gate | q | k | v] (the q_proj rows of transformers' per-head [q, gate] layout regrouped so the gate and the q/k/v
part are plain column slices of the output), Gated DeltaNet [qkv | z | b | a], MLP [gate | up]. With fold_norms
the pre-projection RMSNorms' weights are folded into the projections' weights (W * (1 + w), rounded to the
weights' dtype once; the norms' weights the kernels see are then zeros), so a prefill's projection applies its
norm as a scale of its output rows in its epilogue (linear.py, "The folded norm").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, ModelConfig


@dataclass
class AttentionWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [gate (Hq*D, when gated) | q (Hq*D) | k | v] x hidden
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    out: torch.Tensor


@dataclass
class DeltaNetWeights:
    input_norm: torch.Tensor
    projection: torch.Tensor  # [qkv (conv_dim) | z (Hv*Dv) | b (Hv) | a (Hv)] x hidden
    conv: torch.Tensor  # [conv_dim, W]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.Tensor
    out: torch.Tensor


@dataclass
class MLPWeights:
    input_norm: torch.Tensor
    gate_up: torch.Tensor  # [gate | up] x hidden
    down: torch.Tensor


@dataclass
class PackedWeights:
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    layers: list  # AttentionWeights | DeltaNetWeights, one per layer
    mlps: list[MLPWeights]


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] * (1 + norm_weight [K]) over its columns, in float32, rounded once to weight's dtype: the
    projection of a zero-centred RMSNorm's output with the norm's weight folded in (linear.py)."""
    return (weight.float() * (1.0 + norm_weight.float())).to(weight.dtype)


def pack_weights(config: ModelConfig, weights: dict[str, torch.Tensor], fold_norms: bool) -> PackedWeights:
    """The checkpoint's tensors (names without the `model.` prefix) packed for the kernels."""
    c = config

    def norm_and_weight(norm_weight, weight):
        if not fold_norms:
            return norm_weight, weight
        return torch.zeros_like(norm_weight), fold_norm(weight, norm_weight).contiguous()

    embed = weights["embed_tokens.weight"]
    layers: list = []
    mlps: list[MLPWeights] = []
    for i, layer_type in enumerate(c.layer_types):
        p = f"layers.{i}."
        if layer_type == FULL_ATTENTION:
            a = p + "self_attn."
            q_rows = weights[a + "q_proj.weight"]
            if c.attn_output_gate:
                per_head = q_rows.view(c.num_attention_heads, 2, c.head_dim, c.hidden_size)
                q_rows = torch.cat([per_head[:, 1].reshape(-1, c.hidden_size),
                                    per_head[:, 0].reshape(-1, c.hidden_size)])
            input_norm, qkv = norm_and_weight(
                weights[p + "input_layernorm.weight"],
                torch.cat([q_rows, weights[a + "k_proj.weight"], weights[a + "v_proj.weight"]]).contiguous())
            layers.append(AttentionWeights(
                input_norm=input_norm,
                qkv=qkv,
                q_norm=weights[a + "q_norm.weight"],
                k_norm=weights[a + "k_norm.weight"],
                out=weights[a + "o_proj.weight"],
            ))
        else:
            a = p + "linear_attn."
            input_norm, projection = norm_and_weight(
                weights[p + "input_layernorm.weight"],
                torch.cat([weights[a + "in_proj_qkv.weight"], weights[a + "in_proj_z.weight"],
                           weights[a + "in_proj_b.weight"], weights[a + "in_proj_a.weight"]]).contiguous())
            layers.append(DeltaNetWeights(
                input_norm=input_norm,
                projection=projection,
                conv=weights[a + "conv1d.weight"][:, 0, :].contiguous(),
                A_log=weights[a + "A_log"].float().contiguous(),
                dt_bias=weights[a + "dt_bias"].float().contiguous(),
                norm=weights[a + "norm.weight"],
                out=weights[a + "out_proj.weight"],
            ))
        input_norm, gate_up = norm_and_weight(
            weights[p + "post_attention_layernorm.weight"],
            torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]]).contiguous())
        mlps.append(MLPWeights(input_norm=input_norm, gate_up=gate_up, down=weights[p + "mlp.down_proj.weight"]))
    return PackedWeights(
        embed=embed,
        lm_head=embed if c.tie_word_embeddings else weights["lm_head.weight"],
        final_norm=weights["norm.weight"],
        layers=layers,
        mlps=mlps,
    )
