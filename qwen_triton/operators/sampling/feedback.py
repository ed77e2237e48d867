"""Decode feedback: the ids a step chose become the next step's inputs, on the device.

Per row r < M: token_ids[r] = chosen[r]; positions[r] = min(positions[r] + 1, max_position);
lengths[r] = positions[r] + 1 (the keys the next step attends to); steps[r] += 1 (the row's draw counter).
The last kernel of a decode step when generation runs ahead: step k+1 is launched before the host has
read step k's ids (engine/decode_pipeline.py), so nothing waits on the host between steps. A row whose
position reaches max_position stays there (its later results are unused: the host stops it first).

With host_ids (int64 [2, M], pinned host memory on a GPU: the kernel writes it over the bus, its address
mapped into the device's), also host_ids[steps[r] % 2, r] = chosen[r] (steps before the increment): the
host reads a step's ids there once the step is done, with no copy on the stream between two steps (a
device-to-host copy there costs 10.6-19.0 us per step on the H200: docs/decisions.md, D103). Two rows, so
that the step launched ahead writes the other row while the host reads this one.

Floor: 5 * 8 bytes per row in, 4 * 8 out (at batch 1, 60 bytes) and 8 to the host: the cost is one launch,
hidden behind the LM head's drain by programmatic dependent launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import allow_next_kernel, check_same_device, check_tensor, launch_options, wait_for_previous_kernel


@triton.jit
def _feed_back_kernel(chosen_ptr, token_ids_ptr, positions_ptr, lengths_ptr, steps_ptr, host_ids_ptr, rows,
                      max_position, BLOCK: tl.constexpr, HAS_HOST: tl.constexpr, USE_PDL: tl.constexpr):
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.arange(0, BLOCK)
    mask = row < rows
    chosen = tl.load(chosen_ptr + row, mask=mask, other=0)
    position = tl.minimum(tl.load(positions_ptr + row, mask=mask, other=0) + 1, max_position)
    step = tl.load(steps_ptr + row, mask=mask, other=0)
    tl.store(token_ids_ptr + row, chosen.to(token_ids_ptr.dtype.element_ty), mask=mask)
    tl.store(positions_ptr + row, position.to(positions_ptr.dtype.element_ty), mask=mask)
    tl.store(lengths_ptr + row, (position + 1).to(lengths_ptr.dtype.element_ty), mask=mask)
    tl.store(steps_ptr + row, step + 1, mask=mask)
    if HAS_HOST:
        tl.store(host_ids_ptr + (step % 2) * rows + row, chosen, mask=mask)


def feed_back(chosen: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor,
              steps: torch.Tensor, max_position: int, pdl: bool = False, host_ids: torch.Tensor | None = None) -> None:
    """In place: token_ids <- chosen, positions <- min(positions + 1, max_position), lengths <- positions + 1,
    steps <- steps + 1, and host_ids[steps % 2] <- chosen (before the increment) when given. chosen, token_ids,
    steps: int64 [M]; positions, lengths: int32 [M]; host_ids: int64 [2, M], in pinned host memory when the
    others are on a GPU, on their device otherwise."""
    rows = chosen.shape[0] if isinstance(chosen, torch.Tensor) else 0
    check_tensor("chosen", chosen, shape=(None,), dtype=torch.int64, contiguous=True)
    check_tensor("token_ids", token_ids, shape=(rows,), dtype=torch.int64, contiguous=True)
    check_tensor("positions", positions, shape=(rows,), dtype=torch.int32, contiguous=True)
    check_tensor("lengths", lengths, shape=(rows,), dtype=torch.int32, contiguous=True)
    check_tensor("steps", steps, shape=(rows,), dtype=torch.int64, contiguous=True)
    check_same_device(chosen=chosen, token_ids=token_ids, positions=positions, lengths=lengths, steps=steps)
    if host_ids is not None:
        check_tensor("host_ids", host_ids, shape=(2, rows), dtype=torch.int64, contiguous=True)
        if chosen.device.type == "cuda":
            if host_ids.device.type != "cpu" or not host_ids.is_pinned():
                raise ValueError("host_ids must be in pinned host memory (pin_memory=True) when the step runs on a GPU")
        elif host_ids.device != chosen.device:
            raise ValueError(f"host_ids is on {host_ids.device}, the ids on {chosen.device}")
    if not 0 <= max_position < 2**31 - 1:
        raise ValueError(f"max_position must be in [0, 2**31 - 1), got {max_position}")
    if rows == 0:
        return
    _feed_back_kernel[(1,)](chosen, token_ids, positions, lengths, steps, chosen if host_ids is None else host_ids,
                            rows, max_position, BLOCK=triton.next_power_of_2(rows), HAS_HOST=host_ids is not None,
                            USE_PDL=pdl, **launch_options(pdl))
