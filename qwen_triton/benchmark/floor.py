"""The bytes and FLOPs a forward pass must move: the floor every timing is quoted against.

Batch-1 decode is memory-bound: each token reads every weight once (the tied embedding once, as the LM
head), reads and writes the Gated DeltaNet states, and reads the KV cache of the context. Prefill is
compute-bound: 2 FLOPs per weight per token, plus attention's quadratic term and the delta rule's
chunk products. Counted here from the config alone, so the counts hold for any Qwen3.5 size.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..weights import expected_shapes


def parameter_count(config: ModelConfig) -> int:
    total = 0
    for shape in expected_shapes(config).values():
        count = 1
        for size in shape:
            count *= size
        total += count
    return total


@dataclass(frozen=True)
class DecodeBytes:
    weights: int
    recurrent_state: int  # read + written
    conv_state: int  # read + written
    kv_cache: int  # the context read, plus the new token's K and V written

    @property
    def total(self) -> int:
        return self.weights + self.recurrent_state + self.conv_state + self.kv_cache


def decode_bytes(config: ModelConfig, context: int, batch: int = 1, weight_bytes: int = 2,
                 activation_bytes: int = 2) -> DecodeBytes:
    """Bytes one decode step of `batch` sequences must move at `context` tokens of context per sequence: every
    weight once (shared by the rows), each row's recurrent and conv states read and written and its KV cache
    read (and the new token's K and V written)."""
    c = config
    linear_layers = len(c.linear_attention_layers)
    attention_layers = len(c.full_attention_layers)
    state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * activation_bytes
    kv_per_token = attention_layers * 2 * c.num_key_value_heads * c.head_dim * activation_bytes
    return DecodeBytes(
        weights=parameter_count(c) * weight_bytes,
        recurrent_state=2 * linear_layers * state * batch,
        conv_state=2 * linear_layers * conv * batch,
        kv_cache=kv_per_token * (context + 1) * batch,
    )


def decode_run_bytes(config: ModelConfig, context: int, steps: int, batch: int = 1, weight_bytes: int = 2,
                     activation_bytes: int = 2) -> int:
    """Bytes `steps` decode steps of `batch` sequences must move, the first at `context` tokens of context per
    sequence and each later one a token further (as generate runs them: step j reads context + j tokens)."""
    return sum(decode_bytes(config, context + step, batch, weight_bytes, activation_bytes).total
               for step in range(steps))


def kv_cache_bytes_per_token(config: ModelConfig, activation_bytes: int = 2) -> int:
    c = config
    return len(c.full_attention_layers) * 2 * c.num_key_value_heads * c.head_dim * activation_bytes


def prefill_flops(config: ModelConfig, tokens: int, start: int = 0, logits_rows: int = 1) -> int:
    """FLOPs of a prefill of `tokens` tokens after `start` cached ones, computing `logits_rows` rows of logits.

    Projections: 2 per weight per token (the embedding is a lookup; the LM head counted for logits_rows).
    Attention: QK^T and PV over the causal triangle, 2 * 2 * D per (query, visible key) per head.
    Gated delta rule (chunk C): per token and value head about 2*C*(Dk + Dv) for the intra-chunk products
    and the UT solve, plus 2 * 3 * Dk * Dv for reading, correcting and updating the state.
    """
    c = config
    weights = parameter_count(c) - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    flops = 2 * weights * tokens + 2 * c.vocab_size * c.hidden_size * logits_rows
    visible_pairs = tokens * start + tokens * (tokens + 1) // 2
    flops += len(c.full_attention_layers) * c.num_attention_heads * 4 * c.head_dim * visible_pairs
    chunk = 64
    per_token_head = 2 * chunk * (c.linear_key_head_dim + c.linear_value_head_dim) + \
        6 * c.linear_key_head_dim * c.linear_value_head_dim
    flops += len(c.linear_attention_layers) * c.linear_num_value_heads * tokens * per_token_head
    return flops


def decode_flops(config: ModelConfig, context: int, batch: int = 1) -> int:
    c = config
    flops = 2 * (parameter_count(c) - (c.vocab_size * c.hidden_size if not c.tie_word_embeddings else 0)) * batch
    flops += len(c.full_attention_layers) * c.num_attention_heads * 4 * c.head_dim * (context + 1) * batch
    flops += len(c.linear_attention_layers) * c.linear_num_value_heads * 8 * \
        c.linear_key_head_dim * c.linear_value_head_dim * batch
    return flops
