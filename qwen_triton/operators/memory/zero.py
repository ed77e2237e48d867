"""Zero a fixed list of tensors in one launch: a slot's conv and recurrent states, before each prompt.

A prompt starts its sequence from zero states. The slot's states are 36 tensors at the Qwen3.5-0.8B shape (18
DeltaNet layers x [the conv state, the recurrent state]), 19.5 MB; `torch._foreach_zero_` over their views costs
the host 238 us a call on the H200 (docs/decisions.md, D101), which the bench's prefill of 128 tokens pays in
full: the GPU waits for the host before the prefill's graph. Here the tensors' addresses
and sizes go into a device table once (`ZeroPlan`), and every call is one launch of `_zero_kernel` over it: a
program per (tensor, block of BLOCK words), each storing zeros at the tensor's address, which the table keeps as
an offset in words from a pointer argument (the table's own). A pointer argument is known 16-byte aligned, so
where every address and size is a multiple of 16 bytes (the 0.8B shape's states) the words are 4 bytes and the
stores 16-byte vectors; otherwise (small test shapes) 2-byte words, stored one by one.

Floor at the 0.8B shape: 19.5 MB written, ~5 us at the H200's copy bandwidth; no reads but the table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_same_device

BLOCK = 4096  # words a program zeroes
WARPS = 4
ALIGNMENT = 16  # bytes: where every address and size is a multiple, 4-byte words in 16-byte vector stores


@triton.jit
def _zero_kernel(table_ptr, anchor_ptr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Program (tensor, block): zeros over words [block x BLOCK, + BLOCK) of table row `tensor`, (the tensor's
    address less anchor_ptr's, its size), both in words of anchor_ptr's type; ALIGNED: both multiples of 4."""
    tensor = tl.program_id(0)
    words = tl.load(table_ptr + 2 * tensor + 1)
    offset = tl.load(table_ptr + 2 * tensor)
    if ALIGNED:
        words = tl.multiple_of(words, 4)
        offset = tl.multiple_of(offset, 4)
    start = tl.program_id(1) * BLOCK
    if start < words:
        offsets = start + tl.arange(0, BLOCK)
        tl.store(anchor_ptr + offset + offsets, tl.zeros([BLOCK], anchor_ptr.dtype.element_ty), mask=offsets < words)


class ZeroPlan:
    """`plan()` zeroes every tensor of `tensors` (contiguous, on one device, of 2-byte or wider elements) in one
    launch. The tensors are kept alive by the plan; the table of their addresses is built here once, so a call
    does no host work but the launch. CUDA-graph capturable."""

    def __init__(self, tensors: list[torch.Tensor]):
        if not tensors:
            raise ValueError("ZeroPlan needs at least one tensor")
        check_same_device(**{f"tensor {i}": t for i, t in enumerate(tensors)})
        for i, tensor in enumerate(tensors):
            if not tensor.is_contiguous():
                raise ValueError(f"tensor {i} is not contiguous")
            if tensor.element_size() < 2:
                raise ValueError(f"tensor {i} is {tensor.dtype}: ZeroPlan zeroes 2-byte words, elements of 2 bytes "
                                 "or more")
        spans = [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors]
        self.aligned = all(address % ALIGNMENT == 0 and size % ALIGNMENT == 0 for address, size in spans)
        word = 4 if self.aligned else 2
        self.tensors = list(tensors)
        self.table = torch.empty(len(spans), 2, dtype=torch.int64, device=tensors[0].device)
        self.anchor = self.table.view(torch.int32 if self.aligned else torch.int16)
        anchor = self.table.data_ptr()
        self.table.copy_(torch.tensor([((address - anchor) // word, size // word) for address, size in spans]))
        self.grid = (len(spans), triton.cdiv(max(size // word for _, size in spans), BLOCK))

    def __call__(self) -> None:
        _zero_kernel[self.grid](self.table, self.anchor, BLOCK=BLOCK, ALIGNED=self.aligned, num_warps=WARPS)

