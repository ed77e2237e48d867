"""The cost model of `qwen-triton profile`: (bytes, FLOPs) of each operator's floor, the bytes it must move
through device memory and the FLOPs it must compute. Where an operator exports its own cost function, that is
the one used; the others are here. Evaluated only while a trace records (engine/trace.py)."""

from __future__ import annotations

from ..config import ModelConfig
from ..operators.gated_delta_rule import gated_delta_rule_decode_projected_cost
from ..operators.gated_delta_rule.chunk import chunk_size_for
from ..operators.linear import out_projection_mlp_cost
from ..operators.lm_head.screened import screened_lm_head_bytes
from ..operators.lm_head.screened_top_k import screened_top_k_bytes


def rows_read(rows: int, width: int, element: int, times: int = 2):
    """An operator that reads and writes `rows` rows of `width` (the embedding, a sums-of-squares pass)."""
    return times * rows * width * element, 0


def linear(x, weight, activation=None, residual=None, **_):
    rows, width = x.shape[0], weight.shape[0] // (2 if activation else 1)
    activations = rows * (x.shape[1] + width * (2 if residual is not None else 1))
    return weight.numel() * weight.element_size() + activations * x.element_size(), 2 * rows * weight.numel()


def qk_norm_rotary(c: ModelConfig, rows: int, element: int):
    heads = c.num_attention_heads + 2 * c.num_key_value_heads
    return 2 * rows * heads * c.head_dim * element, 10 * rows * heads * c.head_dim


def attention_prefill(c: ModelConfig, tokens: int, start: int, element: int):
    keys = start + tokens
    visible = tokens * start + tokens * (tokens + 1) // 2
    moved = (2 * tokens * c.num_attention_heads * c.head_dim + 2 * keys * c.num_key_value_heads * c.head_dim) * element
    return moved, 4 * c.num_attention_heads * c.head_dim * visible


def attention_prefill_packed(c: ModelConfig, sequences, element: int):
    """A packed pass's attention: each sequence's (length, start) as its own prefill (padding rows need nothing)."""
    parts = [attention_prefill(c, length, start, element) for length, start in sequences]
    return sum(moved for moved, _ in parts), sum(flops for _, flops in parts)


def attention_decode(c: ModelConfig, rows: int, context: int, element: int):
    """The KV cache at the traced context, q and the output."""
    keys = context + 1
    moved = rows * (2 * keys * c.num_key_value_heads + 2 * c.num_attention_heads) * c.head_dim * element
    return moved, 4 * rows * c.num_attention_heads * c.head_dim * keys


def conv_prefill(c: ModelConfig, tokens: int, element: int):
    return 2 * tokens * c.linear_conv_dim * element, 2 * tokens * c.linear_conv_dim * c.linear_conv_kernel_dim


def delta_states(c: ModelConfig, rows: int, element: int) -> int:
    """The recurrent and conv state of `rows` sequences of one DeltaNet layer, read and written."""
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * element
    return 2 * rows * (recurrent + conv)


def delta_rule_chunked(c: ModelConfig, tokens: int, element: int):
    """q, k, v and z in, the normed output out (the chunk size: chunk.py's choice)."""
    chunk = chunk_size_for(tokens)
    per_token_head = 2 * chunk * (c.linear_key_head_dim + c.linear_value_head_dim) + \
        6 * c.linear_key_head_dim * c.linear_value_head_dim
    return (delta_states(c, 1, element) + tokens * (c.linear_conv_dim + 2 * c.linear_value_dim) * element,
            tokens * c.linear_num_value_heads * per_token_head)


def delta_step(c: ModelConfig, rows: int, conv_weights: int, projection_width: int, element: int):
    moved = (delta_states(c, rows, element) + conv_weights * element
             + rows * (projection_width + c.linear_value_dim) * element)
    return moved, 8 * rows * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim


def delta_projected_step(c: ModelConfig, element: int):
    return gated_delta_rule_decode_projected_cost(
        c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
        c.linear_value_head_dim, c.linear_conv_kernel_dim, element)


def layer_tail(c: ModelConfig, rows: int, attended: int, gate: bool, element: int):
    return out_projection_mlp_cost(rows, c.hidden_size, attended, c.intermediate_size, gate=gate,
                                   element_size=element)


def lm_head(lm_head_weight, rows: int, logits: bool, screened: bool = False, screened_top_k: bool = False,
            penalized: bool = False):
    """screened: the greedy screened head; screened_top_k: top-k sampling's (its logits and, penalized, the
    penalties' histories included)."""
    flops = 2 * rows * lm_head_weight.numel()
    if screened_top_k:  # not the candidates' rows (data-dependent)
        return screened_top_k_bytes(*lm_head_weight.shape, rows, penalized), flops
    weight = lm_head_weight.numel() * lm_head_weight.element_size()
    if screened:  # the int8 copy and the per-row floats, not the candidates' rows (few, data-dependent)
        weight = screened_lm_head_bytes(*lm_head_weight.shape)
    return weight + rows * lm_head_weight.shape[0] * 4 * logits, flops


def sampling(c: ModelConfig, rows: int):
    return 2 * rows * c.vocab_size * 4, 0


def penalties(c: ModelConfig, rows: int):
    """The penalties kernel: the logits read and written, the counts and the prompt mask read."""
    return 13 * rows * c.vocab_size, 4 * rows * c.vocab_size


def token_count(rows: int):
    return 16 * rows, 0


def feedback(rows: int):
    return 72 * rows, 0
