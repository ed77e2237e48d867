"""Buffers and sequence state of the Triton backend's decode step: every tensor a step of a batch bucket reads or
writes, allocated once, so the step is allocation-free and can be captured in a CUDA graph."""

from __future__ import annotations

import torch

from ..config import ModelConfig


def bucket(batch: int) -> int:
    """The CUDA-graph batch bucket of a batch: the next power of two."""
    size = 1
    while size < batch:
        size *= 2
    return size


class DecodeBuffers:
    """Every tensor a decode step of `size` rows reads or writes, allocated once. Row r of a step is the sequence
    in slot `slots[r]` at position `positions[r]` (slots 0..size-1 today), with its own sampling parameters."""

    def __init__(self, config: ModelConfig, size: int, device: torch.device, dtype: torch.dtype):
        c = config
        self.size = size
        self.token_ids = torch.zeros(size, device=device, dtype=torch.int64)
        self.positions = torch.zeros(size, device=device, dtype=torch.int32)
        self.lengths = torch.ones(size, device=device, dtype=torch.int32)
        self.slots = torch.arange(size, device=device, dtype=torch.int32)
        self.hidden = torch.zeros(size, c.hidden_size, device=device, dtype=dtype)
        self.attention_out = torch.zeros(size, c.num_attention_heads, c.head_dim, device=device, dtype=dtype)
        gate_width = c.num_attention_heads * c.head_dim if c.attn_output_gate else 0
        qkv_width = gate_width + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        projection_width = c.linear_conv_dim + c.linear_value_dim + 2 * c.linear_num_value_heads

        def zeros(*shape):
            return torch.zeros(*shape, device=device, dtype=dtype)

        self.scratch = {
            "attention_qkv": zeros(size, qkv_width),
            "attention_q": zeros(size, c.num_attention_heads, c.head_dim),
            "delta_projection": zeros(size, projection_width),
            "conv_out": zeros(size, c.linear_conv_dim),
            "delta_qk": zeros(size, 2 * c.linear_key_dim),
            "delta_out": zeros(size, c.linear_num_value_heads, c.linear_value_head_dim),
            "delta_normed": zeros(size, c.linear_value_dim),
            "mlp_hidden": zeros(size, c.intermediate_size),
        }
        self.logits = torch.zeros(size, c.vocab_size, device=device, dtype=torch.float32)
        self.next_tokens = torch.zeros(size, device=device, dtype=torch.int64)
        self.temperature = torch.zeros(size, device=device, dtype=torch.float32)
        self.top_k = torch.zeros(size, device=device, dtype=torch.int32)
        self.top_p = torch.ones(size, device=device, dtype=torch.float32)
        self.seed = torch.zeros(size, device=device, dtype=torch.int64)
        self.step = torch.zeros(size, device=device, dtype=torch.int64)
        self.min_p = torch.zeros(size, device=device, dtype=torch.float32)
        self.repetition_penalty = torch.ones(size, device=device, dtype=torch.float32)
        self.frequency_penalty = torch.zeros(size, device=device, dtype=torch.float32)
        self.presence_penalty = torch.zeros(size, device=device, dtype=torch.float32)
        # the penalties' history of each row's sequence: int32 counts of its generated tokens and a bool mask of
        # its prompt's tokens [size, vocab], made on the first penalized generation (penalty_history)
        self.token_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self._vocab, self._device = c.vocab_size, device
        # the ids of a step with feedback, written by its last kernel into row step % 2 (pinned host memory on a
        # GPU, read by the host once the step is done: engine/decode_pipeline.py)
        self.host_ids = torch.zeros(2, size, dtype=torch.int64, pin_memory=device.type == "cuda")
        if device.type != "cuda":
            self.host_ids = self.host_ids.to(device)
        self.fed_back = 0  # rows whose inputs the last step wrote (feedback); 0 when the host must give them

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The tensors a step reads from the host (or, with feedback, from the step before), and the token
        counts a penalized step advances."""
        counts = () if self.token_counts is None else (self.token_counts,)
        return (self.token_ids, self.positions, self.lengths, self.step) + counts

    def penalty_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_counts, prompt_mask), allocated on the first call."""
        if self.token_counts is None:
            self.token_counts = torch.zeros(self.size, self._vocab, device=self._device, dtype=torch.int32)
            self.prompt_mask = torch.zeros(self.size, self._vocab, device=self._device, dtype=torch.bool)
        return self.token_counts, self.prompt_mask

    def start_history(self, row: int, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s history at its prompt: no token generated, the prompt's ids marked. Returns its
        (counts, prompt_mask) rows, [1, vocab] views."""
        counts, prompt_mask = self.penalty_history()
        counts[row].zero_()
        prompt_mask[row].zero_()
        prompt_mask[row].index_fill_(0, prompt_ids.to(self._device, torch.int64), True)
        return counts[row:row + 1], prompt_mask[row:row + 1]

    def load(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The first rows' inputs; the bucket's padding rows run on their own slots at position 0, unused."""
        batch = token_ids.shape[0]
        self.fed_back = 0
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        self.lengths[:batch].copy_(positions + 1)
        if batch < self.size:
            self.token_ids[batch:].zero_()
            self.positions[batch:].zero_()
            self.lengths[batch:].fill_(1)
