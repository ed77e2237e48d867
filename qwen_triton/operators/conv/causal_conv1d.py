"""The Gated DeltaNet's causal depthwise conv1d of width W, then SiLU: prefill and the decode step.

For every channel c and token t, with x[-W+1..-1] the W-1 inputs before the sequence (the conv state):
    y[t, c] = silu(sum_{j<W} weight[c, j] x[t - (W-1) + j, c])           float32, rounded once
and afterwards the conv state holds the last W-1 inputs (from the old state when T < W-1).

Shapes: prefill x [T, C] (strided rows: the q | k | v columns of the fused projection), weight [C, W],
conv_state [C, W-1] updated in place, y [T, C] in x's dtype. Decode x [B, C], conv_state [S, C, W-1] of S
sequence slots, row b's at slot slots[b] (rows 0..B-1 without slots; operators/common.py), updated in place,
y [B, C].

Blocking. Prefill: a program computes a [BLOCK_T, BLOCK_C] tile from W shifted loads of x (the W-1
halo rows are cache hits); its first rows read the old state. The grid is (channel blocks, time blocks),
channel blocks first, so programs that run together cover whole rows. The new state is written by the
programs of the first time block, the only readers of the old state, after a barrier: no program reads
what another writes. Those programs and the others run two branches of the kernel (since 93cc029): the
others load x alone, as 16-byte vectors, without the state's masked gathers and the layout conversions
they brought: at 4096 tokens 72.9 us per layer with the 16 x 128 tile (profile of 4ca1bd6) -> 49.5 us with
the same tile in the prefill (62e2f1a; docs/decisions.md, D95; PREFILL_PICK below); 3.68 -> 3.55 us
at 128 tokens (profiles of 501113a, fb3e19c). That tile kernel (WALK_BLOCKS = 0) still issues W loads per
x element (3 of them L1/L2 hits) and reloads the taps, through a layout conversion, per tile.

The walking kernel (configs with WALK_BLOCKS > 0; LONG_PREFILL_PICK, below, for long prompts): a program walks
down the time axis for one block of BLOCK_C channels, over WALK_BLOCKS consecutive time blocks of BLOCK_T rows
(grid (channel blocks, segments of BLOCK_T x WALK_BLOCKS rows), channel blocks first). Every x row is a
[BLOCK_C] vector (BLOCK_C = 8 x 32 x warps: one 16-byte load per thread and row; 4 x 32 x warps: 8 bytes, half
the registers), loaded once: the program carries the last W-1 rows (float32) in registers from row to row, and
reads only the W-1 rows before its segment twice (from x, or the old state in the first segment). The W taps
are loaded once per program as float32 [BLOCK_C] vectors in the rows' layout, so the loop has no layout
conversion. A time block's BLOCK_T loads are issued before its first store (the compiler may not hoist a load
above a store through another pointer), BLOCK_T x 16 bytes in flight per thread. Each output is the tile
kernel's sum (from zero, tap 0 first, same FMA chain) and SiLU, rounded once: bit-identical. The first
segment's programs write the new state after a barrier, as the tile kernel's first time block does; a segment
spans at least W-1 rows, so no other program reads the state. Per x element: 1 + (W-1)/(BLOCK_T x WALK_BLOCKS)
loads instead of W (per 8 elements, one 16-byte load and one store instead of W loads and a store), and no
shared-memory traffic in the loop (the tile kernel converts each tap through shared memory). Measured in the
engine's 4096-token prefill (the pin comment below): 34.4 us per layer against the tile's 48.8-49.1, 70% of
the 24 us byte floor; at 128 tokens its few long programs lose to the tile, which short prompts keep.

Packed prefill (`causal_conv1d_packed`): the rows of several sequences in the packed layout (operators/packed.py:
each sequence from a multiple of ALIGN = 64 rows, its padding after it), conv_states [S, C, W-1]. The same kernel
(PACKED): a program's rows (a tile's BLOCK_T, a walk's BLOCK_T x WALK_BLOCKS; configs whose rows do not divide
ALIGN are pruned) lie in one aligned block, whose entry gives the sequence's first row, length and slot; the program
then runs as the one-sequence kernel on that sequence's rows (its tile counted from the sequence's first row), so
a token near its sequence's start reads its slot's state and never the previous sequence's tokens, and the
sequence's first programs write its last W-1 inputs to its slot. Padding rows are neither read by a token nor
written; a block of the bucket's tail (slot -1) reads and writes nothing. The same arithmetic as one call per
sequence: the same values bit for bit.

Decode: a program owns BLOCK_C channels of one row's sequence; it reads its slot's state and the weight as
[BLOCK_C, W] tiles, then shifts the state in place after a barrier. A padding row (negative slot) reads and
writes nothing.

Floor at the real shapes (C = 6144, W = 4, bf16): prefill reads 12 KiB of x and writes 12 KiB of y per
token, plus the 48 KiB weight: 101 MB for T = 4096, ~3.2 MB for T = 128; 2W + 4 FLOPs per element. Decode per
sequence: 12 KiB of x and y, 36 KiB of state read and written, 48 KiB of weight: ~130 KB, one launch of
latency. The decode step is CUDA-graph capturable (no host reads, `out=`, state in place).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import active
from ..common import (allow_next_kernel, autotune_configs, check_same_device, check_slots, check_tensor,
                      keep_preferred, launch_options, sequence_slot, wait_for_previous_kernel)
from ..packed import ALIGN, ALIGN_ROWS, block_sequence, check_blocks

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_WIDTH = 16  # the state reads of a prefill program stay inside the first time block (BLOCK_T >= 16)
MIN_BLOCK_T = 16  # the fewest rows of a prefill program, tile or walk (BLOCK_T x WALK_BLOCKS)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the time blocks or segments)


def prefill_config_space() -> list:
    """Every config of the prefill kernel (the autotuner's space before `autotune_configs`): the tile kernel's
    (WALK_BLOCKS = 0), then the walking kernel's."""
    def tile(block_t, block_c, warps):
        return triton.Config({"BLOCK_T": block_t, "BLOCK_C": block_c, "WALK_BLOCKS": 0}, num_warps=warps)

    def walk(block_t, block_c, warps, blocks):
        # BLOCK_C = 8 x 32 x warps: a 16-byte vector of bf16 per thread and row; 4 x 32 x warps: 8 bytes, half
        # the registers (the tuple of BLOCK_T rows, the taps and the window), more programs per SM
        return triton.Config({"BLOCK_T": block_t, "BLOCK_C": block_c, "WALK_BLOCKS": blocks}, num_warps=warps)

    return [
        # the tile kernel; the first config is the interpreter's
        tile(16, 128, 4), tile(32, 128, 4), tile(64, 128, 8), tile(32, 256, 8), tile(16, 256, 4), tile(64, 64, 4),
        # the walking kernel: at 4096 tokens and 6144 channels, 384 to 1536 programs of 16 to 128 rows (the
        # last, 6144 programs of 16 rows: 192 at 128 tokens)
        walk(16, 1024, 4, 4), walk(16, 1024, 4, 2), walk(8, 1024, 4, 4), walk(16, 1024, 4, 1),
        walk(16, 512, 2, 4), walk(16, 256, 1, 8), walk(16, 512, 4, 4), walk(8, 512, 4, 4), walk(8, 256, 1, 2),
    ]


# Each prompt runs one config: PREFILL_PICK below the length bucket LONG_PREFILL_FROM, LONG_PREFILL_PICK (a walk)
# from it, from this GPU's tuning table (tuning/h200.py, with what was measured); without a table the autotuner
# chooses. Each output element is the same 4-tap sum in the same order whatever the tiles and the kernel (tile or
# walking): no result depends on them.
PREFILL_PICK = active().conv_prefill_pick
LONG_PREFILL_PICK = active().conv_long_prefill_pick
# the length bucket (the prompt length rounded up to a power of two, at most 4096)
LONG_PREFILL_FROM = active().conv_long_prefill_from


def rows_per_program(meta) -> int:
    """The rows of x one prefill program covers: a tile's (WALK_BLOCKS = 0) or a walk's time blocks."""
    return meta["BLOCK_T"] * max(meta["WALK_BLOCKS"], 1)


def _prune_prefill(configs, named_args, **kwargs):
    if kwargs.get("PACKED"):  # a program's rows inside one aligned block of the packed layout
        configs = [c for c in configs if ALIGN % rows_per_program(c.kwargs) == 0]
    long = named_args["length_bucket"] >= LONG_PREFILL_FROM
    return keep_preferred(configs, LONG_PREFILL_PICK if long else PREFILL_PICK)


@triton.jit
def _store_silu(out_ptr, rows, cols, row_mask, col_mask, stride_ot, acc):
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _write_new_state(x_ptr, state_ptr, cols, col_mask, length, stride_xt, stride_sc,
                     WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """The new state of channels `cols`, the last W-1 inputs: x's tail, or (T < W-1) the old state's tail then
    all of x. The caller's program must be the only reader of these channels' old state (the barrier orders
    its own reads before the overwrite)."""
    slot = tl.arange(0, BLOCK_W)
    tail = length - (WIDTH - 1) + slot
    in_state = slot < WIDTH - 1
    tail_from_x = in_state & (tail >= 0)
    tail_from_state = in_state & (tail < 0)
    tail_x = tl.load(x_ptr + tail[None, :] * stride_xt + cols[:, None],
                     mask=tail_from_x[None, :] & col_mask[:, None], other=0.0)
    tail_old = tl.load(state_ptr + cols[:, None] * stride_sc + (WIDTH - 1 + tail)[None, :],
                       mask=tail_from_state[None, :] & col_mask[:, None], other=0.0)
    new = tl.where(tail_from_x[None, :], tail_x.to(state_ptr.dtype.element_ty), tail_old)
    tl.debug_barrier()  # every read of the old state in this program happens before it is overwritten
    tl.store(state_ptr + cols[:, None] * stride_sc + slot[None, :], new,
             mask=in_state[None, :] & col_mask[:, None])


@triton.jit
def _shifted_tiles(x_ptr, weight_ptr, state_ptr, out_ptr, length, channels, stride_xt, stride_wc, stride_sc,
                   stride_ot, time_block, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr):
    """The tile kernel: one [BLOCK_T, BLOCK_C] tile per program from W shifted loads of x (time block
    `time_block` of the sequence)."""
    rows = time_block * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < length
    col_mask = cols < channels

    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    # two branches (the first time block's programs read and write the state; the others only x): the
    # others compile to vector loads of x alone, without the state's masked loads and layout conversions
    if time_block > 0:
        # every tap reads x (BLOCK_T >= MAX_WIDTH > W - 1): W shifted loads of one tile, the halo rows cache hits
        for j in tl.static_range(WIDTH):
            x = tl.load(x_ptr + (rows - (WIDTH - 1) + j)[:, None] * stride_xt + cols[None, :],
                        mask=row_mask[:, None] & col_mask[None, :], other=0.0)
            tap = tl.load(weight_ptr + cols * stride_wc + j, mask=col_mask, other=0.0).to(tl.float32)
            acc += x.to(tl.float32) * tap[None, :]
        _store_silu(out_ptr, rows, cols, row_mask, col_mask, stride_ot, acc)  # (in each branch: no layout merge)
    else:
        # the first rows' taps read the old state; these programs then write the new state
        for j in tl.static_range(WIDTH):
            source = rows - (WIDTH - 1) + j  # the input this tap reads; negative: the old state
            from_x = row_mask & (source >= 0)
            from_state = row_mask & (source < 0)
            x = tl.load(x_ptr + source[:, None] * stride_xt + cols[None, :],
                        mask=from_x[:, None] & col_mask[None, :], other=0.0)
            old = tl.load(state_ptr + cols[None, :] * stride_sc + (WIDTH - 1 + source)[:, None],
                          mask=from_state[:, None] & col_mask[None, :], other=0.0)
            tap = tl.load(weight_ptr + cols * stride_wc + j, mask=col_mask, other=0.0).to(tl.float32)
            acc += (x.to(tl.float32) + old.to(tl.float32)) * tap[None, :]
        _store_silu(out_ptr, rows, cols, row_mask, col_mask, stride_ot, acc)
        _write_new_state(x_ptr, state_ptr, cols, col_mask, length, stride_xt, stride_sc, WIDTH, BLOCK_W)


@triton.jit
def _walked_rows(x_ptr, weight_ptr, state_ptr, out_ptr, length, channels, stride_xt, stride_wc, stride_sc,
                 stride_ot, segment, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_C: tl.constexpr, WALK_BLOCKS: tl.constexpr):
    """The walking kernel: a program walks WALK_BLOCKS time blocks of BLOCK_T rows down BLOCK_C channels (segment
    `segment` of the sequence), each x row loaded once as a [BLOCK_C] vector, the last W-1 rows carried in
    registers."""
    # a segment spans at least W-1 rows: the W-1 rows before any later segment are x's, and only the first
    # segment's programs, which write the new state, read the old one
    tl.static_assert(BLOCK_T * WALK_BLOCKS >= WIDTH - 1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < channels
    start = segment * (WALK_BLOCKS * BLOCK_T)

    # the taps once per program, float32 [BLOCK_C] vectors in the rows' layout (any conversion is out of the loop)
    taps = ()
    for j in tl.static_range(WIDTH):
        taps = taps + (tl.load(weight_ptr + cols * stride_wc + j, mask=col_mask, other=0.0).to(tl.float32),)
    # the window: the W-1 inputs before the next row, in float32, oldest first; before the segment they are
    # x's rows, or (the first segment) the old state
    window = ()
    for j in tl.static_range(WIDTH - 1):
        source = start - (WIDTH - 1) + j
        earlier = tl.load(x_ptr + source * stride_xt + cols, mask=col_mask & (source >= 0), other=0.0)
        old = tl.load(state_ptr + cols * stride_sc + (WIDTH - 1 + source), mask=col_mask & (source < 0), other=0.0)
        window = window + (earlier.to(tl.float32) + old.to(tl.float32),)  # one of the two is zero: exact

    for block in range(tl.minimum(WALK_BLOCKS, tl.cdiv(length - start, BLOCK_T))):
        first = start + block * BLOCK_T
        # all the block's loads before its first store: the compiler may not move a load above a store to
        # another pointer (they could alias), and BLOCK_T independent vector loads per thread stay in flight
        inputs = ()
        for r in tl.static_range(BLOCK_T):
            inputs = inputs + (tl.load(x_ptr + (first + r) * stride_xt + cols,
                                       mask=col_mask & (first + r < length), other=0.0),)
        for r in tl.static_range(BLOCK_T):
            current = inputs[r].to(tl.float32)
            # the tile kernel's sum: from zero, tap 0 (the oldest input) first
            acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
            for j in tl.static_range(WIDTH - 1):
                acc += window[j] * taps[j]
            acc += current * taps[WIDTH - 1]
            y = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + (first + r) * stride_ot + cols, y.to(out_ptr.dtype.element_ty),
                     mask=col_mask & (first + r < length))
            window = window[1:] + (current,)

    if segment == 0:  # the only readers of the old state write the new one
        _write_new_state(x_ptr, state_ptr, cols, col_mask, length, stride_xt, stride_sc, WIDTH, BLOCK_W)


@triton.autotune(configs=autotune_configs(prefill_config_space()), key=["channels", "WIDTH", "length_bucket"],
                 restore_value=["state_ptr"], prune_configs_by={"early_config_prune": _prune_prefill},
                 cache_results=True)
@triton.jit(do_not_specialize=["length_bucket"])  # a tuning key only: no recompilation per bucket
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, state_ptr, out_ptr, blocks_ptr,
    length, channels, stride_xt, stride_wc, stride_sc, stride_ot, stride_slot, length_bucket,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    WALK_BLOCKS: tl.constexpr, USE_PDL: tl.constexpr = False, PACKED: tl.constexpr = False,
):
    # the grid: (channel blocks, time blocks) for the tile kernel (WALK_BLOCKS = 0), (channel blocks, segments
    # of WALK_BLOCKS time blocks) for the walking kernel; channel blocks vary fastest: the programs running
    # together read and write whole rows of x and y (contiguous), not a strip of each of many rows
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    index = tl.program_id(1)
    if PACKED:
        # the program's rows lie in one aligned block: its sequence's rows and slot, the program's tile counted
        # from the sequence's first row; a block of the bucket's tail (slot -1) reads and writes nothing
        ROWS: tl.constexpr = BLOCK_T * (1 if WALK_BLOCKS == 0 else WALK_BLOCKS)
        tl.static_assert(ALIGN_ROWS % ROWS == 0)
        first, length, _, slot = block_sequence(blocks_ptr, index * ROWS)
        index = (index * ROWS - first) // ROWS
        channels = tl.where(slot >= 0, channels, 0)
        x_ptr += first.to(tl.int64) * stride_xt
        out_ptr += first.to(tl.int64) * stride_ot
        state_ptr += tl.maximum(slot, 0).to(tl.int64) * stride_slot
    if WALK_BLOCKS == 0:
        _shifted_tiles(x_ptr, weight_ptr, state_ptr, out_ptr, length, channels, stride_xt, stride_wc, stride_sc,
                       stride_ot, index, WIDTH, BLOCK_W, BLOCK_T, BLOCK_C)
    else:
        _walked_rows(x_ptr, weight_ptr, state_ptr, out_ptr, length, channels, stride_xt, stride_wc, stride_sc,
                     stride_ot, index, WIDTH, BLOCK_W, BLOCK_T, BLOCK_C, WALK_BLOCKS)


@triton.jit
def conv_step_operands(weight_ptr, state_row, cols, col_mask, stride_wc, stride_sc,
                       WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """The stored inputs [C, BLOCK_W] (slots 0..W-2, the rest zero) and the weights [C, BLOCK_W] of one
    sequence's channels `cols`: what `conv_step_output` combines with the new input (loaded apart, so a
    caller can load them before waiting for the kernel that writes the input)."""
    slot = tl.arange(0, BLOCK_W)
    old = tl.load(state_row + cols[:, None] * stride_sc + slot[None, :],
                  mask=col_mask[:, None] & (slot[None, :] < WIDTH - 1), other=0.0)
    weight = tl.load(weight_ptr + cols[:, None] * stride_wc + slot[None, :],
                     mask=col_mask[:, None] & (slot[None, :] < WIDTH), other=0.0)
    return old, weight


@triton.jit
def conv_step_output(x, old, weight, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """silu(conv) in float32 of the channels whose new input is x and `conv_step_operands` (old, weight)."""
    slot = tl.arange(0, BLOCK_W)
    # window [C, W]: the W-1 stored inputs, then x
    window = tl.where(slot[None, :] == WIDTH - 1, x.to(tl.float32)[:, None], old.to(tl.float32))
    acc = tl.sum(window * weight.to(tl.float32), axis=1)
    return acc / (1.0 + tl.exp(-acc))


@triton.jit
def conv_step_channels(x, weight_ptr, state_row, cols, col_mask, stride_wc, stride_sc,
                       WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """silu(conv) in float32 of one sequence's channels `cols`, from their new input x and conv state."""
    old, weight = conv_step_operands(weight_ptr, state_row, cols, col_mask, stride_wc, stride_sc, WIDTH, BLOCK_W)
    return conv_step_output(x, old, weight, WIDTH, BLOCK_W)


@triton.jit
def conv_state_shifted(state_row, cols, col_mask, stride_sc, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """The stored inputs of channels `cols` moved down one slot ([C, BLOCK_W]: slot j holds slot j + 1, the
    last slot zero): what `store_conv_state` completes with the new input (loaded apart, so that a caller can
    load it before waiting for the kernel that writes the input)."""
    slot = tl.arange(0, BLOCK_W)
    return tl.load(state_row + cols[:, None] * stride_sc + slot[None, :] + 1,
                   mask=col_mask[:, None] & (slot[None, :] < WIDTH - 2), other=0.0)


@triton.jit
def store_conv_state(x, shifted, state_row, cols, col_mask, stride_sc, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Advance the conv state of channels `cols` by one input: `conv_state_shifted`'s slots, then x.

    The caller's program must be the only one touching these channels' state, and every read of their old
    state (in all its threads) must precede this store (a barrier between them)."""
    slot = tl.arange(0, BLOCK_W)
    new = tl.where(slot[None, :] == WIDTH - 2, x.to(state_row.dtype.element_ty)[:, None], shifted)
    tl.store(state_row + cols[:, None] * stride_sc + slot[None, :], new,
             mask=col_mask[:, None] & (slot[None, :] < WIDTH - 1))


@triton.jit
def shift_conv_state(x, state_row, cols, col_mask, stride_sc, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Advance the conv state of channels `cols` by one input: slot j takes slot j + 1, the last takes x.

    The caller's program must be the only one touching these channels' state: the barrier orders this
    program's reads of the old state before the overwrite, not other programs'.
    """
    shifted = conv_state_shifted(state_row, cols, col_mask, stride_sc, WIDTH, BLOCK_W)
    tl.debug_barrier()
    store_conv_state(x, shifted, state_row, cols, col_mask, stride_sc, WIDTH, BLOCK_W)


def _step_configs():
    return autotune_configs([
        triton.Config({"BLOCK_C": 256}, num_warps=4),
        triton.Config({"BLOCK_C": 128}, num_warps=2),
        triton.Config({"BLOCK_C": 128}, num_warps=4),
        triton.Config({"BLOCK_C": 512}, num_warps=4),
        triton.Config({"BLOCK_C": 1024}, num_warps=8),
    ])


@triton.autotune(configs=_step_configs(), key=["batch", "channels", "WIDTH"], restore_value=["state_ptr"], cache_results=True)
@triton.jit
def _causal_conv1d_step_kernel(
    x_ptr, weight_ptr, state_ptr, out_ptr, slots_ptr,
    batch, channels, stride_xb, stride_wc, stride_sb, stride_sc, stride_ob,
    WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    row = tl.program_id(0)
    slot = sequence_slot(slots_ptr, row, HAS_SLOTS)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = (cols < channels) & (slot >= 0)  # a padding row: nothing read or written
    state_row = state_ptr + slot.to(tl.int64) * stride_sb
    x = tl.load(x_ptr + row * stride_xb + cols, mask=col_mask, other=0.0)
    y = conv_step_channels(x, weight_ptr, state_row, cols, col_mask, stride_wc, stride_sc, WIDTH, BLOCK_W)
    tl.store(out_ptr + row * stride_ob + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)
    shift_conv_state(x, state_row, cols, col_mask, stride_sc, WIDTH, BLOCK_W)


def _check_weight(weight, channels: int):
    check_tensor("weight", weight, shape=(channels, None), dtype=ACTIVATION_DTYPES)
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"weight has width {width}, expected 2 to {MAX_WIDTH}")
    return width


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """Prefill of one sequence: y = silu(conv(x)) [T, C]; conv_state [C, W-1] updated in place. pdl: launch with
    programmatic dependent launch (Hopper; operators/common.py)."""
    check_tensor("x", x, shape=(None, None), dtype=ACTIVATION_DTYPES)
    length, channels = x.shape
    width = _check_weight(weight, channels)
    check_tensor("conv_state", conv_state, shape=(channels, width - 1), dtype=ACTIVATION_DTYPES)
    if out is None:
        out = torch.empty(length, channels, device=x.device, dtype=x.dtype)
    check_tensor("out", out, shape=(length, channels), dtype=x.dtype)
    check_same_device(x=x, weight=weight, conv_state=conv_state, out=out)
    if length == 0 or channels == 0:
        return out
    if triton.cdiv(length, MIN_BLOCK_T) > MAX_GRID_Y:
        raise ValueError(f"x has {length} rows: at most {MAX_GRID_Y * MIN_BLOCK_T} tokens in one prefill call")

    def grid(meta):
        return triton.cdiv(channels, meta["BLOCK_C"]), triton.cdiv(length, rows_per_program(meta))

    _causal_conv1d_kernel[grid](
        x, weight, conv_state, out, x,  # (no packed layout: x stands in for blocks)
        length, channels, x.stride(0), weight.stride(0), conv_state.stride(0), out.stride(0), 0,
        min(triton.next_power_of_2(length), 4096),
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def causal_conv1d_packed(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, blocks: torch.Tensor,
    out: torch.Tensor | None = None, pdl: bool = False,
) -> torch.Tensor:
    """Prefill of the sequences of a packed layout (operators/packed.py): x [T, C] their rows, blocks [T / ALIGN,
    4] where they lie; each sequence's rows read its slot's conv state (conv_states [S, C, W-1]) before its first
    token and write its last W-1 inputs there. y [T, C]: each sequence's rows (padding rows unwritten)."""
    check_tensor("x", x, shape=(None, None), dtype=ACTIVATION_DTYPES)
    length, channels = x.shape
    width = _check_weight(weight, channels)
    check_blocks(blocks, length)
    check_tensor("conv_states", conv_states, shape=(None, channels, width - 1), dtype=ACTIVATION_DTYPES)
    if out is None:
        out = torch.empty(length, channels, device=x.device, dtype=x.dtype)
    check_tensor("out", out, shape=(length, channels), dtype=x.dtype)
    check_same_device(x=x, weight=weight, conv_states=conv_states, blocks=blocks, out=out)
    if length == 0 or channels == 0:
        return out
    if triton.cdiv(length, MIN_BLOCK_T) > MAX_GRID_Y:
        raise ValueError(f"x has {length} rows: at most {MAX_GRID_Y * MIN_BLOCK_T} tokens in one prefill call")

    def grid(meta):
        return triton.cdiv(channels, meta["BLOCK_C"]), length // rows_per_program(meta)

    _causal_conv1d_kernel[grid](
        x, weight, conv_states, out, blocks,
        length, channels, x.stride(0), weight.stride(0), conv_states.stride(1), out.stride(0), conv_states.stride(0),
        min(triton.next_power_of_2(length), 4096),
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), USE_PDL=pdl, PACKED=True, **launch_options(pdl),
    )
    return out


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode step of B sequences: y = silu(conv) [B, C]; conv_state [S, C, W-1] (S >= B slots) updated in place
    at row b's slot slots[b] (int32 [B] on the device, distinct, below S; negative: a padding row, untouched, its
    y unwritten; None: row b is slot b)."""
    check_tensor("x", x, shape=(None, None), dtype=ACTIVATION_DTYPES)
    batch, channels = x.shape
    width = _check_weight(weight, channels)
    check_tensor("conv_state", conv_state, shape=(None, channels, width - 1), dtype=ACTIVATION_DTYPES)
    if conv_state.shape[0] < batch:
        raise ValueError(f"conv_state has {conv_state.shape[0]} slots, fewer than x's {batch} rows")
    slots, has_slots = check_slots(slots, batch, x)
    if out is None:
        out = torch.empty(batch, channels, device=x.device, dtype=x.dtype)
    check_tensor("out", out, shape=(batch, channels), dtype=x.dtype)
    check_same_device(x=x, weight=weight, conv_state=conv_state, out=out, slots=slots)
    if batch == 0 or channels == 0:
        return out
    grid = lambda meta: (batch, triton.cdiv(channels, meta["BLOCK_C"]))  # noqa: E731
    _causal_conv1d_step_kernel[grid](
        x, weight, conv_state, out, slots,
        batch, channels, x.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), out.stride(0),
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), HAS_SLOTS=has_slots,
    )
    return out


def causal_conv1d_cost(length, channels, width, element_size=2):
    """(bytes, FLOPs) of the prefill floor: x in, y out, the weight and the state once; 2W + 4 FLOPs each."""
    data = element_size * (2 * length * channels + channels * width + 2 * channels * (width - 1))
    return data, length * channels * (2 * width + 4)


def causal_conv1d_step_cost(batch, channels, width, element_size=2):
    """(bytes, FLOPs) of the decode-step floor: x in, y out, the state in and out, the weight once."""
    data = element_size * (2 * batch * channels + channels * width + 2 * batch * channels * (width - 1))
    return data, batch * channels * (2 * width + 4)
