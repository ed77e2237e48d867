"""The interface both backends serve (reference/model.py, engine/triton_model.py): what `LLM` calls.

A backend holds `max_batch` sequence slots of up to `max_length` tokens. `prefill` runs one prompt into a slot
after `start` cached tokens; `decode` runs one token for each of slots 0..B-1 at its own position (row r: slot r).
The next steps widen these, keeping the names: a decode over any set of slots (a `slots` tensor beside
`positions`, each row with its sampling parameters: TritonModel.decode_tokens's DeviceSampling rows already are
per row), and a prefill of several prompts (lists of token_ids, slots and starts).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig


@runtime_checkable
class Backend(Protocol):
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_batch: int
    max_length: int

    def prefill(self, token_ids: torch.Tensor, slot: int = 0, start: int = 0,
                all_logits: bool = True) -> torch.Tensor:
        """Tokens [T] of the sequence in `slot` after `start` cached ones: float32 logits [T or 1, vocab]."""
        ...

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step for slots 0..B-1 (token_ids, positions [B]): float32 logits [B, vocab]."""
        ...

    def reset(self, slot: int | None = None) -> None:
        """Forget the sequence in `slot` (all slots when None)."""
        ...
