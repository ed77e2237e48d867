"""The interface both backends serve (reference/model.py, engine/triton_model.py): what `LLM` calls.

A backend holds `max_batch` sequence slots of up to `max_length` tokens. `prefill` runs one prompt into a slot
after `start` cached tokens; `decode` runs one token for each of B sequences at its own position, row r being the
sequence in slot `slots[r]` (any distinct slots below max_batch, in any order; None means row r is slot r).
`prefill_batch` runs several prompts, each into its own slot after its own cached tokens, and returns each
one's last logits: one pass over all of them where the backend can (the triton backend), else one prefill each.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..config import ModelConfig


def check_decode_slots(slots: torch.Tensor | None, rows: int, max_batch: int) -> None:
    """Raise ValueError unless slots (None, or [rows] of integers) can be a decode step's: on the host, also
    distinct and in 0..max_batch-1 (values on a device are not read: no synchronisation)."""
    if slots is None:
        return
    if not isinstance(slots, torch.Tensor) or slots.shape != (rows,):
        shape = list(slots.shape) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots must be a tensor of shape [{rows}] (one per row), got {shape}")
    if slots.dtype.is_floating_point or slots.dtype.is_complex or slots.dtype == torch.bool:
        raise ValueError(f"slots has dtype {slots.dtype}, expected an integer dtype")
    if slots.device.type == "cpu" and rows:
        values = slots.tolist()
        if min(values) < 0 or max(values) >= max_batch or len(set(values)) != rows:
            raise ValueError(f"slots {values} must be distinct slots in 0..{max_batch - 1}")


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

    def prefill_batch(self, token_ids: list[torch.Tensor], slots: list[int],
                      starts: list[int] | None = None) -> torch.Tensor:
        """Prompts token_ids[s] [T_s] of the sequences in distinct slots[s], after starts[s] cached tokens each
        (None: 0): float32 logits [S, vocab] of each prompt's last token."""
        ...

    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
               slots: torch.Tensor | None = None) -> torch.Tensor:
        """One step of B sequences (token_ids, positions, slots [B]; row r: slot slots[r], None: slot r).

        Returns float32 logits [B, vocab].
        """
        ...

    def reset(self, slot: int | None = None) -> None:
        """Forget the sequence in `slot` (all slots when None)."""
        ...


def check_prefill_batch(token_ids, slots, starts, max_batch: int, max_length: int) -> list[int]:
    """Raise ValueError unless (token_ids, slots, starts) can be a `prefill_batch`: as many slots (and starts) as
    prompts, distinct slots in 0..max_batch-1, each prompt non-empty and ending within max_length. Returns the
    starts (zeros for None)."""
    count = len(token_ids)
    if count == 0:
        raise ValueError("prefill_batch needs at least one prompt")
    if len(slots) != count:
        raise ValueError(f"slots has {len(slots)} entries for {count} prompts")
    starts = [0] * count if starts is None else list(starts)
    if len(starts) != count:
        raise ValueError(f"starts has {len(starts)} entries for {count} prompts")
    if len(set(slots)) != count or min(slots) < 0 or max(slots) >= max_batch:
        raise ValueError(f"slots {list(slots)} must be distinct slots in 0..{max_batch - 1}")
    for index, (ids, start) in enumerate(zip(token_ids, starts)):
        if ids.dim() != 1 or ids.shape[0] == 0:
            raise ValueError(f"prompt {index} must be a non-empty 1-D tensor of token ids")
        if start < 0 or start + ids.shape[0] > max_length:
            raise ValueError(f"prompt {index}: {ids.shape[0]} tokens after {start} cached exceed the maximum "
                             f"length {max_length}")
    return starts
