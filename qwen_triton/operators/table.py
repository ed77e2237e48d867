"""Operator -> kernel, per phase: the one table the Triton engine is composed from (`qwen-triton ops`).

Each entry names `module:kernel` under `qwen_triton.operators`; `tests/operators/test_table.py` imports
every named kernel, so the table cannot name a kernel that does not exist. Where an operator is fused
into another kernel, the entry says which kernel carries it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Operator:
    rows: str
    name: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    note: str = ""


LINEAR_PREFILL = "linear.gemm:_gemm_kernel"
LINEAR_DECODE = "linear.gemv:_gemv_kernel"
PROLOGUE_PREFILL = "linear.gemm:_prologue_kernel"  # the GEMM's gate or final norm, a row pass before it
# the rows' sums of squares of the embedding's output, for the first layer's folded norm (prefill)
ROW_SQUARES_PREFILL = "norm.rms_norm:_row_squares_kernel"
# a one-sequence decode step's DeltaNet in-projection, conv, gating and delta rule (engine option
# projected_delta_decode); several sequences run the GEMV, then the fused step
PROJECTED_STEP_DECODE = "gated_delta_rule.projected_decode:_projected_step_kernel"
FUSED_STEP_DECODE = "gated_delta_rule.fused_decode:_fused_step_kernel"
# a decode step's out-projection + residual, MLP norm, gate/up + SwiGLU and down + residual: for one sequence on
# Hopper one launch with every weight staged in shared memory (engine option staged_out_projection_mlp), else
# three phases of one kernel, one program per SM
STAGED_TAIL_DECODE = "linear.staged_out_projection_mlp:_staged_kernel"
LAYER_TAIL_DECODE = "linear.out_projection_mlp:_out_projection_mlp_kernel"

OPERATORS: tuple[Operator, ...] = (
    Operator("1", "embedding lookup", ("embedding.embedding:_embedding_kernel", ROW_SQUARES_PREFILL),
             ("embedding.embedding:_embedding_kernel",),
             "prefill: then the rows' sums of squares for the first layer's folded norm"),
    Operator("2", "fused input projections (attention gate|q|k|v; DeltaNet qkv|z|b|a)",
             (LINEAR_PREFILL,), (LINEAR_DECODE, PROJECTED_STEP_DECODE),
             "weights concatenated at load, the input RMSNorm's (1 + w) folded into them; the norm's 1/rms: the "
             "GEMV's prologue (decode), the GEMM's epilogue from the sums of squares the kernel before left (prefill); "
             "a one-sequence decode step's DeltaNet projection is the tiles of the projected step kernel"),
    Operator("3-4", "per-head q/k RMSNorm + partial RoPE, k and v written to the KV cache",
             ("attention.qk_norm_rotary:_qk_norm_rotary_kernel",),
             ("attention.qk_norm_rotary:_qk_norm_rotary_kernel",)),
    Operator("5-7, 20-21", "attention: scores, scale, causal mask, softmax, PV",
             ("attention.prefill:_prefill_kernel", "attention.prefill:_packed_prefill_kernel"),
             ("attention.decode:_decode_split_kernel", "attention.decode:_decode_merge_kernel"),
             "prefill: flash (online softmax), several prompts of a packed pass each against its slot's cache "
             "(_packed_prefill_kernel); decode: split-KV then merge"),
    Operator("8-9", "sigmoid output gate, attention output projection, residual add",
             (PROLOGUE_PREFILL, LINEAR_PREFILL), (STAGED_TAIL_DECODE, LAYER_TAIL_DECODE),
             "gate: a prologue (decode, phase 1 of the layer's tail kernel: staged for one sequence on Hopper, "
             "else out_projection_mlp), a row pass (prefill); residual (and, prefill, the rows' sums of squares) "
             "in the epilogue"),
    Operator("10-11", "RMSNorm, gate/up projection, SiLU x up",
             (LINEAR_PREFILL,), (STAGED_TAIL_DECODE, LAYER_TAIL_DECODE),
             "norm: (1 + w) folded into the weights; 1/rms in a prologue (decode, phase 2 of the tail kernel), "
             "in the epilogue (prefill); SwiGLU in the epilogue"),
    Operator("12-13", "down projection, residual add", (LINEAR_PREFILL,), (STAGED_TAIL_DECODE, LAYER_TAIL_DECODE),
             "residual (and, prefill, the rows' sums of squares) in the epilogue (decode: phase 3 of the tail "
             "kernel)"),
    Operator("14-15", "RMSNorm with (1 + w) weights, fused with the residual add",
             (LINEAR_PREFILL,), (LINEAR_DECODE, STAGED_TAIL_DECODE, LAYER_TAIL_DECODE),
             "the add is the previous projection's epilogue; the norm's (1 + w) folded into the next projection's "
             "weights, its 1/rms that projection's prologue (decode) or epilogue, from the sums of squares the "
             "add's epilogue wrote (prefill)"),
    Operator("16-17", "LM head (tied embedding) and argmax",
             (LINEAR_PREFILL, LINEAR_DECODE, "embedding.embedding:_embedding_kernel"),
             ("lm_head.screened:_quantize_kernel", "lm_head.screened:_screen_kernel", "lm_head.screened:_check_kernel",
              "lm_head.screened_top_k:_screen_top_k_kernel", "lm_head.screened_top_k:_threshold_kernel",
              "lm_head.screened_top_k:_check_top_k_kernel", "lm_head.argmax:_lm_head_argmax_kernel",
              "lm_head.argmax:_argmax_reduce_kernel"),
             "prefill: logits of the rows needed through the projection kernels (a packed pass: each prompt's "
             "last row gathered by the embedding kernel first); decode: partial argmax (or "
             "Gumbel-max for temperature sampling) per vocabulary block, then a reduction, no logits written; "
             "greedy, up to 16 sequences: an int8 copy of the head screens the rows, the candidates' logits "
             "computed exactly (screened_lm_head); top-k sampling (top_k <= 64), up to 16 sequences: the same screen "
             "writes logits exact at every token that can reach the top k (penalties applied there), bounds "
             "elsewhere, for the sampler"),
    Operator("18-19", "KV cache write and read",
             ("attention.qk_norm_rotary:_qk_norm_rotary_kernel", "attention.prefill:_prefill_kernel"),
             ("attention.qk_norm_rotary:_qk_norm_rotary_kernel", "attention.decode:_decode_split_kernel"),
             "cache [slot, kv head, position, dim]: a head's keys are contiguous"),
    Operator("22", "causal depthwise conv1d (width 4) + SiLU",
             ("conv.causal_conv1d:_causal_conv1d_kernel",),
             (PROJECTED_STEP_DECODE, FUSED_STEP_DECODE),
             "prefill: one prompt, or a packed pass's prompts each from its slot's conv state (PACKED); "
             "decode: the one-step conv update inside the DeltaNet step (one sequence: the projected step kernel, "
             "its projection tiles; several: the fused step)"),
    Operator("23", "gating prep: L2 norm of q, k; beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias)",
             ("gated_delta_rule.chunk:_chunk_prepare_kernel", "gated_delta_rule.chunk:_chunk_inverse_kernel",
              "gated_delta_rule.chunk:_chunk_products_kernel"),
             (PROJECTED_STEP_DECODE, FUSED_STEP_DECODE),
             "fused into the delta rule kernels (standalone: gated_delta_rule.gating:_gating_kernel)"),
    Operator("24", "gated delta rule",
             ("memory.zero:_zero_kernel", "gated_delta_rule.chunk:_chunk_prepare_kernel",
              "gated_delta_rule.chunk:_chunk_inverse_kernel", "gated_delta_rule.chunk:_chunk_products_kernel",
              "gated_delta_rule.state_pass:_state_pass_kernel", "gated_delta_rule.chunk:_chunk_state_kernel",
              "gated_delta_rule.chunk:_chunk_output_kernel"),
             (PROJECTED_STEP_DECODE, FUSED_STEP_DECODE),
             "prefill: chunks of 32 tokens up to 1024, else 64, UT form, fp32 state (the chunk's preparation one "
             "kernel up to 2048 tokens, else two; the sequential state pass in Gluon on Hopper with 16-bit "
             "operands, else in Triton; a packed pass's prompts each from and to its slot's state, padding rows "
             "g = beta = 0); decode: one recurrent step on the fp32 state in place, "
             "after the in-projection in one kernel for one sequence (projected_decode.py), else the fused step; "
             "a new prompt's conv and recurrent states zeroed first, every layer's in one launch (reset)"),
    Operator("25", "gated RMSNorm: norm(o) * w * SiLU(z)",
             ("gated_delta_rule.chunk:_chunk_output_kernel",),
             (STAGED_TAIL_DECODE, LAYER_TAIL_DECODE),
             "prefill: the chunked rule's output kernel, each program whole head rows (standalone: "
             "gated_delta_rule.gated_rms_norm:_gated_rms_norm_kernel); decode: the out-projection's prologue "
             "(phase 1 of the layer's tail kernel, each program for the whole row); without "
             "out_projection_mlp, the fused step's last program per head"),
    Operator("26", "final RMSNorm", (PROLOGUE_PREFILL, LINEAR_DECODE), ("lm_head.argmax:_lm_head_argmax_kernel",),
             "the LM head's prologue, or its row pass when it projects more than 16 rows "
             "(standalone: norm.rms_norm:_rms_norm_kernel)"),
    Operator("27", "sampling: penalties, temperature, min-p, top-k, top-p, seeded",
             ("sampling.penalties:_penalties_kernel", "sampling.sample:_stats_kernel",
              "sampling.sample:_search_kernel", "sampling.sample:_draw_kernel", "sampling.penalties:_count_kernel"),
             ("sampling.penalties:_penalties_kernel", "sampling.sample:_stats_kernel",
              "sampling.sample:_search_kernel", "sampling.sample:_draw_kernel", "sampling.penalties:_count_kernel"),
             "on the device, inside the decode CUDA graph; the penalties (on the logits, in place, or, for top-k "
             "behind the screened head, inside its check) and the counts of the generated ids only when a row has a "
             "penalty (engine/device_sampling.py's modes)"),
)


def kernels() -> set[str]:
    return {entry for op in OPERATORS for entry in op.prefill + op.decode}


def format_table() -> str:
    lines = ["| # | operator | prefill kernel | decode kernel | notes |", "|---|---|---|---|---|"]
    for op in OPERATORS:
        lines.append(f"| {op.rows} | {op.name} | {', '.join(op.prefill)} | {', '.join(op.decode)} | {op.note} |")
    return "\n".join(lines)
