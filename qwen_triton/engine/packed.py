"""A packed prefill's inputs: several prompts laid out for one pass (operators/packed.py), its length buckets, and
the one int32 buffer its kernels read.

A pass of S prompts runs over T rows, T the token bucket of their aligned total (`token_buckets`: every multiple of
ALIGN = 64 up to FINE_TOKENS, then steps of about GROWTH, each a multiple of 64, up to max_length rounded up to 64),
so that the kernels' shapes, and a CUDA graph per bucket, serve any prompts that fit: a prompt of a length the process
has not seen runs at most a bucket's padding more (at most 63 rows up to FINE_TOKENS, about 12% past it). Prompts
whose aligned total exceeds the largest bucket run in several passes (`passes`).

Its inputs are one int32 buffer of `input_size(T, S)` entries, in this order (`PackedInputs.view` cuts it):

    token ids [T]   (0 on a padding row)            positions [T]   (start + index; 0 on a padding row)
    slots [T]       (-1 on a padding row)           blocks [T / 64, 4]   (operators/packed.py)
    last rows [S]   (each sequence's last token's row; row 0 for a sequence-bucket's padding entry)

built on the host (`pack_inputs`) and copied to the device in one copy; a prompt given on the device is copied into
its rows there. The buffer's views of a bucket lie at fixed offsets, so a graph captured on them replays with
whatever the host copied in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..operators.packed import ALIGN, FIELDS, PackedLayout, aligned
from .buffers import bucket

FINE_TOKENS = 512  # every multiple of ALIGN a bucket up to here
GROWTH = 1.125  # then each bucket about this much larger than the one before (a multiple of ALIGN)


def token_buckets(max_length: int) -> list[int]:
    """The token buckets of a model of max_length tokens: every multiple of ALIGN up to FINE_TOKENS, then steps of
    of at most GROWTH (the multiple of ALIGN at or below, at least one more), up to max_length rounded up to ALIGN
    (a pass's most rows): past FINE_TOKENS a pass runs at most 12.5% more rows than its prompts take."""
    largest = aligned(max_length)
    buckets = list(range(ALIGN, min(FINE_TOKENS, largest) + 1, ALIGN))
    while buckets[-1] < largest:
        step = max(int(buckets[-1] * GROWTH) // ALIGN * ALIGN, buckets[-1] + ALIGN)
        buckets.append(min(step, largest))
    return buckets


def token_bucket(rows: int, buckets: list[int]) -> int:
    """The smallest bucket that holds `rows` (an aligned total)."""
    for size in buckets:
        if size >= rows:
            return size
    raise ValueError(f"{rows} rows exceed the largest packed prefill bucket, {buckets[-1]}")


def sequence_buckets(max_batch: int) -> list[int]:
    """The sequence buckets of a pass (its LM head's rows): 1, 2, 4, ... up to bucket(max_batch)."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes


def passes(lengths: list[int], largest: int) -> list[list[int]]:
    """The prompts (indices into lengths) of each pass, in order: as many as fit `largest` rows each, aligned."""
    groups: list[list[int]] = [[]]
    rows = 0
    for index, length in enumerate(lengths):
        size = aligned(length)
        if size > largest:
            raise ValueError(f"prompt {index} has {length} tokens: more than a pass's {largest} rows")
        if groups[-1] and rows + size > largest:
            groups.append([])
            rows = 0
        groups[-1].append(index)
        rows += size
    return groups


def input_size(tokens: int, sequences: int) -> int:
    """The int32 entries of a pass's inputs: ids, positions and slots [T] each, blocks [T / 64, 4], last rows [S]."""
    return 3 * tokens + tokens // ALIGN * FIELDS + sequences


@dataclass(frozen=True)
class PackedInputs:
    """A pass's inputs as device views of one int32 buffer (module docstring)."""

    tokens: int
    sequences: int  # the entries of last_rows (the LM head's rows)
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    blocks: torch.Tensor
    last_rows: torch.Tensor
    layout: PackedLayout | None = None  # where the prompts lie (the host's: the operators' floors while tracing)

    @classmethod
    def view(cls, buffer: torch.Tensor, tokens: int, sequences: int,
             layout: PackedLayout | None = None) -> "PackedInputs":
        """The views of a pass of `tokens` rows and `sequences` LM-head rows at the start of `buffer`."""
        blocks = tokens // ALIGN * FIELDS
        ids, positions, slots, table, last = buffer[:input_size(tokens, sequences)].split(
            [tokens, tokens, tokens, blocks, sequences])
        return cls(tokens, sequences, ids, positions, slots, table.view(tokens // ALIGN, FIELDS), last, layout)

    def with_layout(self, layout: PackedLayout) -> "PackedInputs":
        return replace(self, layout=layout)


def pack_inputs(token_ids: list[torch.Tensor], starts: list[int], slots: list[int], tokens: int,
                sequences: int) -> tuple[torch.Tensor, PackedLayout]:
    """The host int32 buffer of a pass (module docstring) of prompts token_ids (each [T_s]) after starts cached
    tokens in slots, in `tokens` rows with `sequences` LM-head rows; and its layout. The ids of prompts on a device
    are left 0 (the caller copies them in on the device: `copy_device_prompts`)."""
    layout = PackedLayout.of([ids.shape[0] for ids in token_ids], starts, slots, tokens)
    buffer = np.zeros(input_size(tokens, sequences), dtype=np.int32)
    ids, positions, token_slots = buffer[:tokens], buffer[tokens:2 * tokens], buffer[2 * tokens:3 * tokens]
    blocks = buffer[3 * tokens:3 * tokens + tokens // ALIGN * FIELDS].reshape(-1, FIELDS)
    last = buffer[3 * tokens + tokens // ALIGN * FIELDS:]
    token_slots[:] = -1
    blocks[:, 3] = -1
    for index, (prompt, first, length, start, slot) in enumerate(
            zip(token_ids, layout.firsts, layout.lengths, layout.starts, layout.slots)):
        rows = slice(first, first + length)
        if prompt.device.type == "cpu":
            ids[rows] = prompt.numpy()
        positions[rows] = np.arange(start, start + length, dtype=np.int32)
        token_slots[rows] = slot
        blocks[first // ALIGN:(first + aligned(length)) // ALIGN] = (first, length, start, slot)
        last[index] = first + length - 1
    return torch.from_numpy(buffer), layout


def copy_device_prompts(inputs: PackedInputs, token_ids: list[torch.Tensor], layout: PackedLayout) -> None:
    """Copy the ids of the prompts given on the device into their rows of `inputs` (on the device, no host read)."""
    for prompt, first, length in zip(token_ids, layout.firsts, layout.lengths):
        if prompt.device.type != "cpu":
            inputs.token_ids[first:first + length].copy_(prompt)


def head_rows(sequences: int) -> int:
    """The LM head's rows of a pass of `sequences` prompts: their sequence bucket."""
    return bucket(sequences)


__all__ = ["ALIGN", "FINE_TOKENS", "GROWTH", "PackedInputs", "aligned", "copy_device_prompts", "head_rows",
           "input_size", "pack_inputs",
           "passes", "sequence_buckets", "token_bucket", "token_buckets"]
