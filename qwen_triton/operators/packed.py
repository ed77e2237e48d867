"""The packed layout: several sequences' prompts in one prefill pass, and what its kernels read of it.

The prompts' tokens lie one after another, sequence s's T_s tokens from row first_s, each padded at its end to a
multiple of ALIGN = 64 rows (the largest chunk of the chunked delta rule), and the whole padded further to the
pass's token bucket T (a multiple of ALIGN):

    rows  | s0: T_0 tokens, padding to 64k | s1: T_1 tokens, padding | ... | the bucket's tail |

A block of ALIGN rows therefore holds rows of one sequence (its tokens, then perhaps its padding) or none (the
tail), and so does every tile of rows that divides ALIGN: a chunk of the delta rule (32 or 64 rows), a conv
program's rows, a slice of an attention program's query rows. Each kernel finds its tile's sequence from the
tile's block, in `blocks` int32 [T / ALIGN, 4] on the device:

    blocks[b] = (first, length, start, slot)   of the sequence that owns block b:
                first   its first row in the layout (a multiple of ALIGN)
                length  its tokens in this pass, T_s (0: a block of the tail)
                start   the tokens of the sequence cached before them (its positions start there)
                slot    its state slot (the KV cache, conv and recurrent states; -1: a block of the tail)

Because the kernels read the layout from the device, one CUDA graph of a bucket serves any prompts, lengths and
slots that fit it (engine/graphs.py, PackedPrefillGraphs). A padding row is inert: a row-wise kernel (the GEMMs,
norms, embedding) computes it and no other row reads it; the kernels that mix rows (the conv, the chunked delta
rule, attention) load only a sequence's own rows (and its slot's states and cache), give its padding rows no
decay and no write strength (g = 0, beta = 0: they change no state), and the q/k norm writes no cache for them
(their slot -1). The LM head reads each sequence's last row (`last_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import check_tensor

ALIGN = 64
ALIGN_ROWS = tl.constexpr(ALIGN)  # (ALIGN inside the kernels)
FIELDS = 4  # first, length, start, slot


def aligned(rows: int) -> int:
    """rows rounded up to a multiple of ALIGN."""
    return -(-rows // ALIGN) * ALIGN


@triton.jit
def block_sequence(blocks_ptr, row):
    """(first row, length, start, slot) of the sequence owning packed row `row` (length 0 and slot -1 in the
    bucket's tail)."""
    entry = blocks_ptr + (row // ALIGN_ROWS) * 4
    return tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3)


def check_blocks(blocks: torch.Tensor, tokens: int) -> None:
    """Raise ValueError unless `blocks` can describe a packed layout of `tokens` rows (a multiple of ALIGN)."""
    if tokens % ALIGN:
        raise ValueError(f"a packed layout has a multiple of {ALIGN} rows, got {tokens}")
    check_tensor("blocks", blocks, shape=(tokens // ALIGN, FIELDS), dtype=torch.int32, contiguous=True)


@dataclass(frozen=True)
class PackedLayout:
    """Where each sequence of a pass lies (host side): sequence s's lengths[s] tokens from row firsts[s], after
    starts[s] cached tokens, in slot slots[s]; tokens: the layout's rows T."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    slots: tuple[int, ...]
    firsts: tuple[int, ...]
    tokens: int

    @classmethod
    def of(cls, lengths, starts=None, slots=None, tokens: int | None = None) -> "PackedLayout":
        """The layout of sequences of `lengths` tokens (each at least 1) after `starts` cached ones (None: 0) in
        `slots` (None: 0, 1, ...), in T = tokens rows (None: the aligned total; else a multiple of ALIGN that
        holds it)."""
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"a packed layout needs at least one sequence, each of at least one token: {lengths}")
        starts = (0,) * len(lengths) if starts is None else tuple(int(n) for n in starts)
        slots = tuple(range(len(lengths))) if slots is None else tuple(int(n) for n in slots)
        if len(starts) != len(lengths) or len(slots) != len(lengths):
            raise ValueError("lengths, starts and slots must have one entry per sequence")
        if min(starts) < 0 or min(slots) < 0 or len(set(slots)) != len(slots):
            raise ValueError(f"starts must be >= 0 and slots distinct and >= 0: {starts}, {slots}")
        firsts, row = [], 0
        for length in lengths:
            firsts.append(row)
            row += aligned(length)
        tokens = row if tokens is None else tokens
        if tokens % ALIGN or tokens < row:
            raise ValueError(f"{tokens} rows cannot hold the layout's {row} (a multiple of {ALIGN} is needed)")
        return cls(lengths, starts, slots, tuple(firsts), tokens)

    @property
    def used(self) -> int:
        """The rows the sequences take, their padding included (the rest is the bucket's tail)."""
        return self.firsts[-1] + aligned(self.lengths[-1])

    def blocks(self) -> torch.Tensor:
        """int32 [T / ALIGN, 4] (first, length, start, slot) per block, on the CPU (module docstring)."""
        table = torch.zeros(self.tokens // ALIGN, FIELDS, dtype=torch.int32)
        table[:, 3] = -1
        for first, length, start, slot in zip(self.firsts, self.lengths, self.starts, self.slots):
            table[first // ALIGN:(first + aligned(length)) // ALIGN] = torch.tensor([first, length, start, slot],
                                                                                  dtype=torch.int32)
        return table

    def positions(self) -> torch.Tensor:
        """int32 [T]: each token's position in its sequence (start + index); 0 for a padding row."""
        out = torch.zeros(self.tokens, dtype=torch.int32)
        for first, length, start in zip(self.firsts, self.lengths, self.starts):
            out[first:first + length] = torch.arange(start, start + length, dtype=torch.int32)
        return out

    def token_slots(self) -> torch.Tensor:
        """int32 [T]: each token's slot; -1 for a padding row (the q/k norm writes no cache for it)."""
        out = torch.full((self.tokens,), -1, dtype=torch.int32)
        for first, length, slot in zip(self.firsts, self.lengths, self.slots):
            out[first:first + length] = slot
        return out

    def last_rows(self) -> list[int]:
        """Each sequence's last token's row."""
        return [first + length - 1 for first, length in zip(self.firsts, self.lengths)]

    def pack(self, pieces: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """The rows of pieces[s] ([T_s, ...] each) at sequence s's rows of a [T, ...] tensor, `fill` elsewhere."""
        out = pieces[0].new_full((self.tokens, *pieces[0].shape[1:]), fill)
        for first, piece in zip(self.firsts, pieces):
            out[first:first + piece.shape[0]] = piece
        return out

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """Each sequence's rows of a [T, ...] tensor (views)."""
        return [packed[first:first + length] for first, length in zip(self.firsts, self.lengths)]


__all__ = ["ALIGN", "ALIGN_ROWS", "PackedLayout", "aligned", "block_sequence", "check_blocks"]
