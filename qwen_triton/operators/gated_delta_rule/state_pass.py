"""The chunked delta rule's state pass (its kernel 2) in Gluon, on the transposed state: Hopper, 16-bit operands.

What it computes is chunk.py's kernel 2, `_chunk_state_kernel`: per head and chunk, from the chunk's W, U and
decayed keys K~ (kernel 1's), with S the state [Dk, Dv] at the chunk's start,
    store S (the chunk's start state, rounded to the operand dtype)
    V' = U - W S                                  store V' (rounded)
    S  = exp(G_C) S + K~^T V'
Its time is the chain of the two dependent products a chunk, 64 steps at 4096 tokens. The Triton kernel spends
about 1.6 us a step (102 us a layer at 4096 tokens, docs/decisions.md, D69): Triton takes the right operand of a
tensor-core product from shared memory only, so each step writes S and then V' there and waits for them.

This kernel carries S^T [BLOCK_V, Dk] instead, so that both products take the carried operand as their left one,
which the tensor cores (wgmma) read from registers:
    V'^T = U^T - S^T W^T       left: -S^T from registers;    right: the W tile [C, Dk] in shared memory, read
                               transposed; accumulator initialised with U^T
    S^T  = exp(G_C) S^T + V'^T K~   left: V'^T, the first product's accumulator rounded, from registers (the
                               accumulator's layout is the left operand's: no data moves); right: the K~ tile
No shared-memory round trip in the chain. The tiles come through TMA from one loading warp (warp specialisation)
into a ring of STAGES buffers, each counted in by an mbarrier and handed back by the computing warpgroup once
the step's second product is done with it; G_C is read a step ahead. A program is one warpgroup (4 warps: the
products' 64 rows are BLOCK_V = 64 state columns) and the loading warp; grid (Hv, Dv / 64): 32 programs at the
real shape, against 64 (BLOCK_V 32) of the Triton kernel's tuned config at 4096 tokens.

The loads are 2-D descriptors over the scratch's [Hv * T, D] rows, so the last chunk of a head reads the next
head's first rows (or zeros past the end) where the Triton kernel masks them to zeros: the step zeroes V'^T's
columns past the sequence's end, which is what those rows feed (W and U rows only reach V', and K~ rows are
multiplied by V' rows; the next head's rows are finite: kernel 1 wrote every one).

Packed (PACKED, chunk.py's gated_delta_rule_chunked_packed): the chunks are those of several sequences in the
packed layout (operators/packed.py: a chunk never straddles two), state_ptr holds every slot's states
[S, Hv, Dk, Dv]. Each step reads its chunk's aligned-block entry (its sequence's first row, length and slot;
before the wait for the tiles, so that the loads overlap it); a sequence's first chunk starts from its slot's state
(a pointer load in the accumulator's layout), and after its last chunk's second product the state is stored to the
slot (a pointer store). A chunk of padding rows holds zero W, U and K~ rows (kernel 1 writes every row of the
layout, from inputs loaded as zeros): it leaves the state as it is. The one-sequence form (PACKED False) is the
kernel as it was: its final state through TMA, no per-step load.
The sequences of a packed layout are independent, so a packed launch splits the chain: grid (Hv, Dv / 64, PARTS),
part p carrying the whole sequences that begin in the p-th of PARTS equal ranges of the layout's blocks (its chunks
from the first sequence start at or after its range's first block to the first at or after the next range's; the
bucket's tail, inert, to the last sequence's part). 16 prompts of 128 tokens: chains of 2 chunks in 16 parts, not
one chain of 32.
Measured on the H100 (docs/decisions.md, D153; benchmarks/packed_prefill.py --parts 16 against --parts 1): the
state pass of 16 x 128 tokens 1,318.4 -> 669.0 us over the 18 layers, `prefill_batch` 8.686 -> 7.796 ms.

Rounding as the Triton kernel's: S and V' rounded to the operand dtype for the products and the stores, float32
accumulation; U - W S accumulates W S onto U in the tensor core's order instead of subtracting the finished
product (a float32 rounding apart).

Floor (the real shape, 4096 tokens, per layer): reads W, U, K~ (4 + 4 + 4 KiB a token in bf16: 50 MB) and writes
V' and the chunk states (4 + 8 KiB a token: 50 MB): 101 MB, 25 us at 4.0 TB/s; FLOPs 2 x 2 x 64 x 128 x 128 a chunk
and head, 4.3 GFLOP in all. As a chain: 64 steps of two dependent wgmma groups (m64 n64 k128, then m64 n128 k64),
2.1 MFLOP a step and program, about 0.36 us of tensor-core work on one SM at the bf16 matmul rate measured beside
the profile (766 TFLOP/s over 132 SMs, the profile of commit c0e27c0; docs/decisions.md).
Measured on the H200 (docs/decisions.md, D69): 64.2-67.2 us a layer at 4096 tokens in the engine's
profile (102.1 for the Triton kernel), about 1.0 us a step; the engine's prefill of 4096 tokens 0.5-0.65 ms faster
replayed (benchmarks/prefill_options.py, commits 9626aa2, 4be166c), of 128 tokens within 7 us. The step's stores
issued before the first product instead of beside it (9626aa2): the same within the machines' spread. The state as
two halves of its keys, four independent chains of four wgmma instead of chains of eight and four (1f4aaed, D68): no
faster. What the rest of a step's 1.0 us is was not separated.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..common import hopper_or_later, interpreting
from ..packed import ALIGN_ROWS

BLOCK_V = 64  # state columns a program carries: the rows of both products (wgmma's m64 for one warpgroup)
WARPS = 4  # one warpgroup computes
STAGES = 4  # chunks of tiles in flight: (2 x C x Dk + C x 64) x 2 bytes each, 40 KiB at C = 64
LOADER_REGISTERS = gl.constexpr(40)  # the loading warp issues TMA copies and waits: few registers
PACKED_PARTS = 16  # a packed launch's parts (module docstring): at most this many chains run side by side

OPERAND_DTYPES = (torch.bfloat16, torch.float16)  # the operands a wgmma takes from registers at k_width 2
GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def applies(state: torch.Tensor, dot_dtype: torch.dtype, chunk: int) -> bool:
    """Whether this kernel serves the call: a Hopper GPU (not the interpreter, which runs no Gluon), 16-bit
    operands, Dv a multiple of BLOCK_V, Dk a multiple of 16 up to 256, chunks of a multiple of 16 rows whose W
    tiles hold the final state's float32 tile (STAGES x C >= 2 x BLOCK_V: chunks of 32 or more)."""
    key_dim, value_dim = state.shape[-2:]
    return (not interpreting() and hopper_or_later(state.device) and dot_dtype in OPERAND_DTYPES
            and value_dim % BLOCK_V == 0 and key_dim % 16 == 0 and key_dim <= 256 and chunk % 16 == 0
            and STAGES * chunk >= 2 * BLOCK_V)


@gluon.jit
def _state_pass_kernel(w_descriptor, u_descriptor, keys_descriptor, new_values_descriptor, chunk_states_descriptor,
                       state_descriptor, decay_ptr, state_ptr, blocks_ptr, length, chunks,
                       V_HEADS: gl.constexpr, K_DIM: gl.constexpr, V_DIM: gl.constexpr, CHUNK_ROWS: gl.constexpr,
                       STAGES: gl.constexpr, PACKED: gl.constexpr = False):
    """Grid (Hv, Dv / BLOCK_V, parts): program (h, j, p) carries columns j of head h's state through the chunks of
    part p (one part: all of them). PACKED: the chunks of a packed layout's sequences (blocks_ptr), state_ptr every
    slot's states (module docstring)."""
    dtype: gl.constexpr = w_descriptor.dtype
    BLOCK: gl.constexpr = u_descriptor.block_type.shape[1]
    head = gl.program_id(0)
    first_value = gl.program_id(1) * BLOCK
    first_row = head * length
    if PACKED:
        first_chunk, end_chunk = _part_chunks(blocks_ptr, gl.program_id(2), gl.num_programs(2), length, CHUNK_ROWS)
    else:
        first_chunk, end_chunk = 0, chunks

    w_tiles = gl.allocate_shared_memory(dtype, [STAGES, CHUNK_ROWS, K_DIM], w_descriptor.layout)
    key_tiles = gl.allocate_shared_memory(dtype, [STAGES, CHUNK_ROWS, K_DIM], keys_descriptor.layout)
    u_tiles = gl.allocate_shared_memory(dtype, [STAGES, CHUNK_ROWS, BLOCK], u_descriptor.layout)
    # what the step stores goes out through TMA from here (V' one head's rows [1, C, BLOCK]: the copy stops at
    # the sequence's end)
    new_values_tile = gl.allocate_shared_memory(dtype, new_values_descriptor.block_type.shape,
                                                new_values_descriptor.layout)
    chunk_state_tile = gl.allocate_shared_memory(dtype, chunk_states_descriptor.block_type.shape,
                                                 chunk_states_descriptor.layout)
    loaded = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    consumed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for stage in gl.static_range(STAGES):
        mbarrier.init(loaded.index(stage), count=1)
        mbarrier.init(consumed.index(stage), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_carry_state, (w_tiles, u_tiles, key_tiles, new_values_tile, chunk_state_tile, loaded, consumed,
                        new_values_descriptor, chunk_states_descriptor, state_descriptor, decay_ptr, state_ptr,
                        blocks_ptr, head, first_value, first_row, length, first_chunk, end_chunk, V_HEADS, K_DIM,
                        V_DIM, CHUNK_ROWS, BLOCK, STAGES, PACKED)),
        (_load_tiles, (w_descriptor, u_descriptor, keys_descriptor, w_tiles, u_tiles, key_tiles, loaded, consumed,
                       first_value, first_row, first_chunk, end_chunk, CHUNK_ROWS, STAGES)),
    ], [1], [LOADER_REGISTERS])
    for stage in gl.static_range(STAGES):
        mbarrier.invalidate(loaded.index(stage))
        mbarrier.invalidate(consumed.index(stage))


@gluon.jit
def _part_start(blocks_ptr, block, blocks, ALIGN: gl.constexpr):
    """The first block at or after `block` where a sequence of the packed layout begins; `blocks` (the layout's
    count) where none does (the bucket's tail, or past the end)."""
    entry = blocks_ptr + gl.minimum(block, blocks - 1) * 4
    first = gl.load(entry)
    sequence_end = (first + (gl.load(entry + 1) + ALIGN - 1) // ALIGN * ALIGN) // ALIGN
    start = gl.where(first == block * ALIGN, block, sequence_end)
    return gl.where((block >= blocks) | (gl.load(entry + 3) < 0), blocks, start)


@gluon.jit
def _part_chunks(blocks_ptr, part, parts, length, CHUNK_ROWS: gl.constexpr):
    """Part `part` of `parts` of a packed layout of `length` rows: its chunks [first, end), the whole sequences
    that begin in its share of the blocks (module docstring)."""
    blocks = length // ALIGN_ROWS
    first = _part_start(blocks_ptr, part * blocks // parts, blocks, ALIGN_ROWS)
    end = _part_start(blocks_ptr, (part + 1) * blocks // parts, blocks, ALIGN_ROWS)
    per_block: gl.constexpr = ALIGN_ROWS // CHUNK_ROWS
    return first * per_block, end * per_block


@gluon.jit
def _load_tiles(w_descriptor, u_descriptor, keys_descriptor, w_tiles, u_tiles, key_tiles, loaded, consumed,
                first_value, first_row, first_chunk, end_chunk, CHUNK_ROWS: gl.constexpr, STAGES: gl.constexpr):
    """The loading warp: the i-th chunk's W, K~ and U tiles into stage i % STAGES once the computing warps have
    handed it back (its previous chunk's second product done)."""
    tile_bytes: gl.constexpr = (w_descriptor.block_type.nbytes + keys_descriptor.block_type.nbytes
                                + u_descriptor.block_type.nbytes)
    for chunk in range(first_chunk, end_chunk):
        step = chunk - first_chunk
        stage = step % STAGES
        if step >= STAGES:
            mbarrier.wait(consumed.index(stage), (step // STAGES - 1) & 1)
        arrival = loaded.index(stage)
        mbarrier.expect(arrival, tile_bytes)
        row = first_row + chunk * CHUNK_ROWS
        tma.async_copy_global_to_shared(w_descriptor, [row, 0], arrival, w_tiles.index(stage))
        tma.async_copy_global_to_shared(keys_descriptor, [row, 0], arrival, key_tiles.index(stage))
        tma.async_copy_global_to_shared(u_descriptor, [row, first_value], arrival, u_tiles.index(stage))


@gluon.jit
def _carry_state(w_tiles, u_tiles, key_tiles, new_values_tile, chunk_state_tile, loaded, consumed,
                 new_values_descriptor, chunk_states_descriptor, state_descriptor, decay_ptr, state_ptr, blocks_ptr,
                 head, first_value, first_row, length, first_chunk, end_chunk, V_HEADS: gl.constexpr,
                 K_DIM: gl.constexpr, V_DIM: gl.constexpr, CHUNK_ROWS: gl.constexpr, BLOCK: gl.constexpr,
                 STAGES: gl.constexpr, PACKED: gl.constexpr):
    """The computing warpgroup: S^T in registers through the chunks (module docstring)."""
    dtype: gl.constexpr = w_tiles.dtype
    # accumulators: S^T [BLOCK, Dk] of the second product, V'^T [BLOCK, C] of the first; each product's left
    # operand is the other's accumulator, rounded
    state_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, K_DIM, 16])
    values_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, CHUNK_ROWS, 16])
    state_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=values_layout, k_width=2)
    values_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=state_layout, k_width=2)

    if PACKED:
        state = gl.zeros([BLOCK, K_DIM], gl.float32, state_layout)  # (the first chunk starts a sequence)
    else:
        state = gl.load(state_ptr + _state_offsets(head, first_value, K_DIM, V_DIM, BLOCK, state_layout))
    tokens = gl.arange(0, CHUNK_ROWS, layout=gl.SliceLayout(0, values_layout))
    new_values_view = new_values_tile.reshape([CHUNK_ROWS, BLOCK]).permute((1, 0))  # V'^T
    chunk_state_view = chunk_state_tile.permute((1, 0))  # S^T

    decay_base = decay_ptr + first_row
    decay_last = gl.load(decay_base + gl.minimum(first_chunk * CHUNK_ROWS + CHUNK_ROWS, length) - 1)
    for chunk in range(first_chunk, end_chunk):
        step = chunk - first_chunk
        stage = step % STAGES
        start = chunk * CHUNK_ROWS
        if PACKED:  # the chunk's sequence: its aligned block's entry (operators/packed.py), read before the wait
            entry = blocks_ptr + (start // ALIGN_ROWS) * 4
            sequence_first = gl.load(entry)
            sequence_end = sequence_first + (gl.load(entry + 1) + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
            slot = gl.load(entry + 3)
        mbarrier.wait(loaded.index(stage), (step // STAGES) & 1)
        if PACKED:
            if (slot >= 0) & (start == sequence_first):  # a sequence's first chunk starts from its slot's state
                state = gl.load(state_ptr + _state_offsets(slot * V_HEADS + head, first_value, K_DIM, V_DIM, BLOCK,
                                                           state_layout))
        u = u_tiles.index(stage).permute((1, 0)).load(values_layout).to(gl.float32)
        carried = state.to(dtype)
        left = gl.convert_layout(-carried, state_operand)
        new_values = warpgroup_mma(left, w_tiles.index(stage).permute((1, 0)), u, is_async=True)
        # while the first product runs: the decayed state (the second's accumulator), the start state's store,
        # and G_C of the next chunk (this chunk's again on the last)
        state = state * gl.exp(decay_last)
        tma.store_wait(pendings=0)  # the previous step's stores have left the tiles
        chunk_state_view.store(carried)
        fence_async_shared()
        tma.async_copy_shared_to_global(chunk_states_descriptor, [(chunk * V_HEADS + head) * K_DIM, first_value],
                                        chunk_state_tile)
        decay_last = gl.load(decay_base + gl.minimum(start + 2 * CHUNK_ROWS, length) - 1)
        # (the left operand among the dependencies: its registers stay untouched while the product reads them)
        new_values, left = warpgroup_mma_wait(num_outstanding=0, deps=(new_values, left))
        new_values = gl.where(tokens[None, :] < length - start, new_values, 0.0).to(dtype)
        left = gl.convert_layout(new_values, values_operand)
        state = warpgroup_mma(left, key_tiles.index(stage), state, is_async=True)
        # while the second runs: V''s store
        new_values_view.store(new_values)
        fence_async_shared()
        tma.async_copy_shared_to_global(new_values_descriptor, [head, start, first_value], new_values_tile)
        state, left = warpgroup_mma_wait(num_outstanding=0, deps=(state, left))
        if PACKED:
            if (slot >= 0) & (start + CHUNK_ROWS == sequence_end):  # a sequence's last chunk: its final state
                gl.store(state_ptr + _state_offsets(slot * V_HEADS + head, first_value, K_DIM, V_DIM, BLOCK,
                                                    state_layout), state)
        mbarrier.arrive(consumed.index(stage))
    if PACKED:
        tma.store_wait(pendings=0)
    else:
        # the final state through TMA from the first stages' W tiles (every load has landed): offsets for a
        # pointer store would stay live in registers through the loop, the initial load's being the same
        gl.static_assert(STAGES * CHUNK_ROWS * dtype.primitive_bitwidth >= BLOCK * 32,
                         "the W tiles must hold the final state's float32 tile")
        final_tile = w_tiles._reinterpret(gl.float32, state_descriptor.block_type.shape, state_descriptor.layout)
        final_tile.permute((1, 0)).store(state)
        fence_async_shared()
        tma.async_copy_shared_to_global(state_descriptor, [head * K_DIM, first_value], final_tile)
        tma.store_wait(pendings=0)


@gluon.jit
def _state_offsets(head, first_value, K_DIM: gl.constexpr, V_DIM: gl.constexpr, BLOCK: gl.constexpr,
                   layout: gl.constexpr):
    """Offsets of S^T [BLOCK, Dk] in the state [Hv, Dk, Dv]: S^T[v, k] = state[head, k, first_value + v]."""
    values = first_value + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    keys = gl.arange(0, K_DIM, layout=gl.SliceLayout(0, layout))
    return head * (K_DIM * V_DIM) + keys[None, :] * V_DIM + values[:, None]


def descriptor(tensor: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A TMA descriptor over a scratch tensor (or a view of it), tiles of `block`."""
    layout = gl.NVMMASharedLayout.get_default_for(block, GLUON_DTYPES[tensor.dtype])
    return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), block, layout)


def descriptors(state, w, u, decayed_keys, new_values, chunk_states, chunk: int) -> dict[str, TensorDescriptor]:
    """The kernel's TMA descriptors, by argument name, over chunk.py's scratch (see `launch`)."""
    value_heads, key_dim, value_dim = state.shape[-3:]
    rows = w.shape[0] * w.shape[1]
    return dict(
        w_descriptor=descriptor(w.view(rows, key_dim), [chunk, key_dim]),
        u_descriptor=descriptor(u.view(rows, value_dim), [chunk, BLOCK_V]),
        keys_descriptor=descriptor(decayed_keys.view(rows, key_dim), [chunk, key_dim]),
        new_values_descriptor=descriptor(new_values, [1, chunk, BLOCK_V]),
        chunk_states_descriptor=descriptor(chunk_states.view(-1, value_dim), [key_dim, BLOCK_V]),
        state_descriptor=descriptor(state.view(-1, value_dim), [key_dim, BLOCK_V]),
    )


def launch(state, w, u, decayed_keys, decay, new_values, chunk_states, chunk: int, blocks=None) -> None:
    """The state pass on the scratch of chunk.py (w, u, decayed_keys [Hv, T, D] in the operand dtype; decay [Hv, T]
    float32; new_values [Hv, T, Dv] and chunk_states [chunks, Hv, Dk, Dv] written; state [Hv, Dk, Dv] float32
    carried in place; with blocks, a packed layout's, every slot's states [S, Hv, Dk, Dv]). The caller checks
    `applies`."""
    value_heads, key_dim, value_dim = state.shape[-3:]
    length = decay.shape[1]
    parts = 1 if blocks is None else min(PACKED_PARTS, blocks.shape[0])
    _state_pass_kernel[(value_heads, value_dim // BLOCK_V, parts)](
        **descriptors(state, w, u, decayed_keys, new_values, chunk_states, chunk), decay_ptr=decay, state_ptr=state,
        blocks_ptr=decay if blocks is None else blocks, length=length, chunks=triton.cdiv(length, chunk),
        V_HEADS=value_heads, K_DIM=key_dim, V_DIM=value_dim, CHUNK_ROWS=chunk, STAGES=STAGES, PACKED=blocks is not None,
        num_warps=WARPS,
    )
