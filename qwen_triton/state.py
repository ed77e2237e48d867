"""The per-sequence state of a generation, shared by both backends: everything preallocated for
`max_batch` sequences (slots) of up to `max_length` tokens.

- full-attention layers: the KV cache, key and value [slot, kv head, position, head dim], so one head's
  keys are contiguous for decode reads;
- Gated DeltaNet layers: the conv state [slot, channel, width - 1] (the last inputs of the causal conv) in
  the activation dtype, and the recurrent state [slot, value head, key dim, value dim] in float32.
"""

from __future__ import annotations

import torch

from .config import FULL_ATTENTION, ModelConfig


class ModelState:
    def __init__(self, config: ModelConfig, max_batch: int, max_length: int, device, dtype):
        c = config
        self.key: dict[int, torch.Tensor] = {}
        self.value: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self._slot_states: dict[int, list[torch.Tensor]] = {}  # reset's views of one slot's conv and recurrent states
        for i, layer_type in enumerate(c.layer_types):
            if layer_type == FULL_ATTENTION:
                shape = (max_batch, c.num_key_value_heads, max_length, c.head_dim)
                self.key[i] = torch.zeros(shape, device=device, dtype=dtype)
                self.value[i] = torch.zeros(shape, device=device, dtype=dtype)
            else:
                self.conv[i] = torch.zeros(
                    max_batch, c.linear_conv_dim, c.linear_conv_kernel_dim - 1, device=device, dtype=dtype
                )
                self.recurrent[i] = torch.zeros(
                    max_batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                    device=device, dtype=torch.float32,
                )

    def slot_states(self, slot: int) -> list[torch.Tensor]:
        """The conv and recurrent states of `slot`, every DeltaNet layer's (views, made once: Python work on
        every prompt otherwise)."""
        if slot not in self._slot_states:
            self._slot_states[slot] = [t[slot] for tensors in (self.conv, self.recurrent) for t in tensors.values()]
        return self._slot_states[slot]

    def reset(self, slot: int) -> None:
        """Start the sequence in `slot` afresh: its conv and recurrent states zeroed (`torch._foreach_zero_`,
        238 us of host time a call at the 0.8B shape on the H200; the Triton engine zeroes them with one launch of
        its own kernel instead, operators/memory/zero.py: 12.9 us, docs/decisions.md, D101). The KV cache is left
        as it is: a sequence's attention never sees a position at or past its length (the Triton kernels do not
        load them, the reference masks their scores to -inf), and zeroing it would write the whole cache, 405 MB at
        max_length 32768 and the 0.8B shape, before every prompt. (Measured together, on the H200: the prefill
        of 128 tokens as the bench times it, reset included, 2.188 -> 2.010 ms; docs/decisions.md, D104.)"""
        torch._foreach_zero_(self.slot_states(slot))
