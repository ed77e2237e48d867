"""Buffers and sequence state of the Triton backend's decode step: every tensor a step of a batch bucket reads or
writes, allocated once, so the step is allocation-free and can be captured in a CUDA graph.

Row r of a step decodes the sequence in slot `slots[r]` (any distinct slots below max_batch, in any order, written
into the device buffer `slots` before each step: a captured graph reads them there). The rows past the batch in
its bucket are padding: their slot is PADDING_SLOT (-1), for which every kernel reads and writes no per-sequence
state (operators/common.py), so a padding row can never touch a live sequence, whichever slots the real rows use.
What a row carries from step to step on the device (token id, position, draw counter: the feedback kernel's) is the
row's; what a sequence carries across steps whatever row it runs in is its slot's: its conv, recurrent and KV
state (ModelState) and its penalties' history (PenaltyHistory).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..operators.linear.fusion import SQUARES_COLUMNS


def bucket(batch: int, limit: int | None = None) -> int:
    """The CUDA-graph batch bucket of a batch: the next power of two, or `limit` (a model's max_batch, which
    need not be a power of two) where that is smaller."""
    size = 1
    while size < batch:
        size *= 2
    return size if limit is None else min(size, limit)


PADDING_SLOT = -1  # the slot of a bucket's padding rows: no state read or written


def host_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` by a copy that does not wait for the GPU: through pinned memory (a tensor already
    pinned as it is) and a copy queued on the stream (a pageable one waits for everything queued before it), so a
    host that builds a step's inputs while the step before runs keeps running. (PyTorch's pinned allocator keeps
    the pinned block until the copy is done.) A tensor already on a GPU moves as .to moves it."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class PenaltyHistory:
    """The penalties' history of each slot's sequence: int32 counts of its generated tokens and a bool mask of its
    prompt's tokens [max_batch, vocab], allocated on the first penalized generation (`tensors`). Per slot, so a
    sequence keeps its history whatever row and batch bucket it decodes in."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.slots, self.vocab, self.device = slots, vocab, device
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, prompt_mask), allocated on the first call."""
        if self.counts is None:
            self.counts = torch.zeros(self.slots, self.vocab, device=self.device, dtype=torch.int32)
            self.prompt_mask = torch.zeros(self.slots, self.vocab, device=self.device, dtype=torch.bool)
        return self.counts, self.prompt_mask

    def start(self, slot: int, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s history at its prompt: no token generated, the prompt's ids marked. Returns its
        (counts, prompt_mask) rows, [1, vocab] views."""
        counts, prompt_mask = self.tensors()
        counts[slot].zero_()
        prompt_mask[slot].zero_()
        prompt_mask[slot].index_fill_(0, host_to_device(prompt_ids.to(torch.int64), self.device), True)
        return counts[slot:slot + 1], prompt_mask[slot:slot + 1]


class DecodeBuffers:
    """Every tensor a decode step of `size` rows reads or writes, allocated once. Row r of a step is the sequence
    in slot `slots[r]` at position `positions[r]`, with its own sampling parameters; rows past the batch are
    padding (slot PADDING_SLOT)."""

    def __init__(self, config: ModelConfig, size: int, device: torch.device, dtype: torch.dtype):
        c = config
        self.size = size
        self.token_ids = torch.zeros(size, device=device, dtype=torch.int64)
        self.positions = torch.zeros(size, device=device, dtype=torch.int32)
        self.lengths = torch.ones(size, device=device, dtype=torch.int32)
        self._rows = torch.arange(size, device=device, dtype=torch.int32)
        self.slots = self._rows.clone()
        self._default_slots = size  # B when `slots` holds 0..B-1 then padding (loaded without slots), else None
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
        # the rows' sums of squares for the folded norms of a step that runs the GEMM (engine/plan.py)
        self.squares = torch.zeros(size, -(-c.hidden_size // SQUARES_COLUMNS), device=device, dtype=torch.float32)
        self.logits = torch.zeros(size, c.vocab_size, device=device, dtype=torch.float32)
        self.greedy_temperature = torch.zeros(size, device=device, dtype=torch.float32)  # the draw as an argmax
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
        # the ids of a step with feedback, written by its last kernel into row step % 2 (pinned host memory on a
        # GPU, read by the host once the step is done: engine/decode_pipeline.py)
        self.host_ids = torch.zeros(2, size, dtype=torch.int64, pin_memory=device.type == "cuda")
        if device.type != "cuda":
            self.host_ids = self.host_ids.to(device)
        self.fed_back = 0  # rows whose inputs the last step wrote (feedback); 0 when the host must give them

    @property
    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The per-row tensors a step reads from the host (or, with feedback, from the step before)."""
        return self.token_ids, self.positions, self.lengths, self.step

    def load(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None = None) -> None:
        """The first rows' inputs: row r is token_ids[r] at positions[r] of the sequence in slot slots[r] (distinct
        slots below max_batch, not checked: they may be device data; None: slot r). The bucket's padding rows
        get PADDING_SLOT at position 0: they run, their results unused, and touch no sequence's state."""
        batch = token_ids.shape[0]
        self.fed_back = 0
        self.token_ids[:batch].copy_(token_ids)
        self.positions[:batch].copy_(positions)
        self.lengths[:batch].copy_(positions + 1)
        if slots is None:
            if self._default_slots != batch:  # written when the batch changes only: no copy per step
                self.slots.copy_(torch.where(self._rows < batch, self._rows, PADDING_SLOT))
        else:
            if slots.shape != (batch,):
                raise ValueError(f"slots has shape {list(slots.shape)}, expected [{batch}] (one per row)")
            self.slots[:batch].copy_(slots)
            if batch < self.size:
                self.slots[batch:].fill_(PADDING_SLOT)
        self._default_slots = batch if slots is None else None
        if batch < self.size:
            self.token_ids[batch:].zero_()
            self.positions[batch:].zero_()
            self.lengths[batch:].fill_(1)
