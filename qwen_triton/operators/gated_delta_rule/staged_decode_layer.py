"""A Gated DeltaNet layer's whole decode step in one launch, every weight staged into shared memory (Gluon).

One sequence (B = 1). It computes what these two kernels compute, with their roundings:
    o, z = gated_delta_rule_decode_projected(h, ...)        in-projection (input RMSNorm), conv, gates, delta rule
    h = staged_out_projection_mlp(o, ..., head_norm=(z, w))  gated RMSNorm, out-projection, MLP, both residuals
but as one launch of one program per SM (128 at Qwen3.5-0.8B's shape), so no kernel boundary drains the
memory system and no kernel waits for the previous one's programs to leave its SMs (each of those launches
takes an SM's shared memory or registers whole: the thirteenth session measured the kernels after a staged tail
starting later, 72 us a decode step in all; docs/perf-notes.md).

Program p owns 16 value columns of value head p // (Dv / 16), and with them the 64 rows of the in-projection
that step needs or that nobody else computes: its 16 channels each of q, k and v (the q and k rows of its key
head at the same offset; so the 8 programs of a head together compute that head's q and k) and 16 rows of z
(rows p x 16 of each of the four A-row blocks q | k | v | z, A = H x D). Phase 0:
  - before the PDL wait, what no earlier kernel writes: the norm weights, the b and a weight rows of its head
    (2 x 1024, in registers), its channels' conv state and weights, its [Dk, 16] float32 slab of the state;
  - h normed into shared memory (the GEMV prologue's roundings); b and a as two dot products in registers;
  - its 64 rows from shared memory (the loading warp copied them first), rounded to bf16 as the GEMV stores
    them; the room they took is handed to the gate/up weights (mbarrier 4);
  - the conv step of its 48 channels (silu), the conv state advanced, the outputs q | k | v to `mixed` and z
    to `projection` (global: other programs read them);
  - a barrier of the head's programs (a counter per head), then q and k of the head from L2, the L2 norms, the
    gates and the delta rule on the slab, o's 16 values to `delta_out`;
  - a grid barrier: every head's o and z written.
Then staged_out_projection_mlp's three phases (`tail_phases`: head norm + out-projection, MLP norm + gate/up,
down), its two grid barriers and its pacing. The loading warp asks for the in-projection rows, then the
out-projection rows, then (once phase 0 has read its rows) the gate/up rows into the same room, then (past the
tail's first barrier) the down rows: 128 + 32 + 112 + 56 = 328 KB a program through 224 KB of shared memory.

Where it applies (`plan`): Hopper, bf16, as many value heads as key heads, Dk = Dv a power of two >= 32, a conv
of width 4, and the tail's launch plan (staged_out_projection_mlp.plan) with exactly Hv x Dv / 16 programs and
gate/up tiles room for the 64 rows. Elsewhere the engine runs the two kernels.

Floor at the real shapes (H 1024, 16 heads of 128, I 3584, bf16): the weights 16.8 + 4.2 + 14.7 + 7.3 = 43.0 MB,
the state read and written 2 MiB, the conv state ~100 KB: ~45 MB, ~10.7 us at the 4.2 TB/s the H200 copies at.
CUDA-graph capturable: no host reads, every buffer passed in, states updated in place, the counters left zero.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..common import check_same_device, check_tensor, launch_options, sm_count
from ..linear import staged_out_projection_mlp as tail
from ..linear.staged_out_projection_mlp import (
    INPUT_SLICES,
    TILE_COLUMNS,
    TRACE_POINTS,
    TILE_ROWS,
    WARPS,
    _mark,
    _mark_time,
    allocate_tiles,
    arrive,
    grid_barrier,
    groups_layout,
    load_weights,
    own_rows,
    phase_sums,
    previous_kernel_done,
    sigmoid,
    stage_rows,
    tail_phases,
    vector_offsets,
    wait_for,
)

SLAB = gl.constexpr(16)  # value columns a program steps; rows a program computes of each of q, k, v and z
WIDTH = 4  # the conv's width this kernel is written for (Qwen3.5's)
# the counters of a launch: the tail's four (its two barriers, departures, the error flag), the barrier after
# the step, then one per head
TAIL_COUNTERS = gl.constexpr(4)
# when the loading warp may copy the gate/up rows into the room the in-projection's rows took: once phase 0 has
# read them (0), once the head's barrier is passed (1), once every head's step is done (2), once this program's
# step is done (3)
GATE_UP_AFTER = 0
# the trace (diagnostics, `trace=`): [2, grid, TRACE_POINTS] int64; the first table staged_out_projection_mlp's
# points (its phases, here after phase 0), the second phase 0's: entry, the PDL wait, h normed, the in-projection
# rows arrived, their sums stored, the conv stored, the head's barrier passed, the step stored, the grid barrier,
# q | k stored and arrived at the head's barrier
PHASE_0_POINTS = 10


def counter_count(heads: int) -> int:
    """Counters a layer's launch uses (`new_counters`)."""
    return TAIL_COUNTERS.value + 1 + heads


@gluon.jit
def _softplus(x):
    """gating.py's softplus (torch's: threshold 20), log1p as log(u) t / (u - 1) with u = 1 + t."""
    small = gl.exp(-gl.abs(x))
    u = 1.0 + small
    log1p_small = gl.where(u == 1.0, small, gl.log(u) * (small / gl.where(u == 1.0, 1.0, u - 1.0)))
    return gl.where(x > 20.0, x, gl.maximum(x, 0.0) + log1p_small)


@gluon.jit
def _conv_step(new, old_0, old_1, old_2, conv_0, conv_1, conv_2, conv_3, state_row, mixed_ptrs, mask):
    """The conv step (width 4, silu) of the channels under mask: their outputs to mixed_ptrs, their state
    advanced one input (the new input `new`, as projected)."""
    conv = (old_0.to(gl.float32) * conv_0 + old_1.to(gl.float32) * conv_1 + old_2.to(gl.float32) * conv_2
            + new.to(gl.float32) * conv_3)
    gl.store(mixed_ptrs, (conv / (1.0 + gl.exp(-conv))).to(new.dtype), mask=mask)
    gl.store(state_row, old_1, mask=mask)
    gl.store(state_row + 1, old_2, mask=mask)
    gl.store(state_row + 2, new, mask=mask)


@gluon.jit
def _layer_kernel(
    in_descriptor, out_descriptor, gate_up_descriptor, down_descriptor,
    hidden_ptr, input_norm_ptr, weight_ptr, conv_weight_ptr, conv_state_ptr, a_log_ptr, dt_bias_ptr, state_ptr,
    projection_ptr, mixed_ptr, o_ptr, head_norm_ptr, norm_ptr, act_ptr, counter_ptr, trace_ptr, eps, scale,
    stride_wc, stride_cc,
    HIDDEN: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr, INTERMEDIATE: gl.constexpr,
    OUT_GROUPS: gl.constexpr, UP_GROUPS: gl.constexpr, OUT_PADDED: gl.constexpr, UP_PADDED: gl.constexpr,
    BLOCK_HIDDEN: gl.constexpr, USE_PDL: gl.constexpr, WARPS: gl.constexpr, PACED: gl.constexpr,
    GATE_UP_AFTER: gl.constexpr, TRACE: gl.constexpr, UNROLLED: gl.constexpr,
):
    ATTENDED: gl.constexpr = HEADS * HEAD_DIM
    SLICES: gl.constexpr = HIDDEN // TILE_COLUMNS
    OUT_SLICES: gl.constexpr = ATTENDED // TILE_COLUMNS
    DOWN_SLICES: gl.constexpr = INTERMEDIATE // TILE_COLUMNS
    dtype: gl.constexpr = out_descriptor.dtype
    tile_layout: gl.constexpr = out_descriptor.layout
    program = gl.program_id(0)
    programs = gl.num_programs(0)
    out_row = program * (OUT_GROUPS * TILE_ROWS)
    up_row = program * (UP_GROUPS * TILE_ROWS)

    out_tiles = allocate_tiles(dtype, OUT_SLICES, OUT_PADDED, tile_layout)
    # the gate and up rows, and before them the in-projection's (q | k in the gate tiles, v | z in the up tiles)
    gate_tiles = allocate_tiles(dtype, SLICES, UP_PADDED, tile_layout)
    up_tiles = allocate_tiles(dtype, SLICES, UP_PADDED, tile_layout)
    down_tiles = allocate_tiles(dtype, DOWN_SLICES, OUT_PADDED, tile_layout)
    inputs = gl.allocate_shared_memory(dtype, [INPUT_SLICES * TILE_COLUMNS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    projected = gl.allocate_shared_memory(dtype, [2 * UP_PADDED, TILE_ROWS],
                                          gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    # the tail's four mbarriers (its three phases' weights, the pacing), the room free (4), the in-projection (5)
    arrivals = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    for phase in gl.static_range(6):
        mbarrier.init(arrivals.index(phase), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute, (out_tiles, gate_tiles, up_tiles, down_tiles, inputs, projected, arrivals, hidden_ptr, input_norm_ptr,
                    weight_ptr, conv_weight_ptr, conv_state_ptr, a_log_ptr, dt_bias_ptr, state_ptr, projection_ptr,
                    mixed_ptr, o_ptr, head_norm_ptr, norm_ptr, act_ptr, counter_ptr, trace_ptr, eps, scale,
                    stride_wc, stride_cc, out_row, up_row, programs, HIDDEN, HEADS, HEAD_DIM, INTERMEDIATE,
                    OUT_GROUPS, UP_GROUPS, OUT_PADDED, UP_PADDED, BLOCK_HIDDEN, USE_PDL, WARPS, PACED,
                    GATE_UP_AFTER, TRACE, UNROLLED)),
        (_load_layer_weights, (in_descriptor, out_descriptor, gate_up_descriptor, down_descriptor, out_tiles,
                               gate_tiles, up_tiles, down_tiles, arrivals, trace_ptr, out_row, up_row, ATTENDED,
                               INTERMEDIATE, OUT_GROUPS, UP_GROUPS, OUT_SLICES, SLICES, DOWN_SLICES, PACED, TRACE)),
    ], [1], [64])
    for phase in gl.static_range(6):
        mbarrier.invalidate(arrivals.index(phase))


@gluon.jit
def _load_layer_weights(in_descriptor, out_descriptor, gate_up_descriptor, down_descriptor, out_tiles, gate_tiles,
                        up_tiles, down_tiles, arrivals, trace_ptr, out_row, up_row, ATTENDED: gl.constexpr,
                        INTERMEDIATE: gl.constexpr, OUT_GROUPS: gl.constexpr, UP_GROUPS: gl.constexpr,
                        OUT_SLICES: gl.constexpr, SLICES: gl.constexpr, DOWN_SLICES: gl.constexpr,
                        PACED: gl.constexpr, TRACE: gl.constexpr):
    """The loading warp: this program's 64 in-projection rows (mbarrier 5), then the tail's weights
    (`load_weights`, the gate/up rows once phase 0 has freed the room)."""
    tile_bytes: gl.constexpr = TILE_ROWS * TILE_COLUMNS * in_descriptor.dtype.primitive_bitwidth // 8
    GROUPS: gl.constexpr = SLAB // TILE_ROWS
    first = gl.program_id(0) * SLAB
    mbarrier.expect(arrivals.index(5), 4 * GROUPS * SLICES * tile_bytes)
    for block in gl.static_range(2):  # q and k into the gate tiles, v and z into the up tiles
        stage_rows(in_descriptor, gate_tiles, arrivals.index(5), block * ATTENDED + first, GROUPS, SLICES,
                   block * GROUPS)
        stage_rows(in_descriptor, up_tiles, arrivals.index(5), (2 + block) * ATTENDED + first, GROUPS, SLICES,
                   block * GROUPS)
    load_weights(out_descriptor, gate_up_descriptor, down_descriptor, out_tiles, gate_tiles, up_tiles, down_tiles, arrivals, trace_ptr, out_row, up_row, INTERMEDIATE,
                 OUT_GROUPS, UP_GROUPS, OUT_SLICES, SLICES, DOWN_SLICES, TRACE, PACED, True)


@gluon.jit
def _compute(out_tiles, gate_tiles, up_tiles, down_tiles, inputs, projected, arrivals, hidden_ptr, input_norm_ptr, weight_ptr,
             conv_weight_ptr, conv_state_ptr, a_log_ptr, dt_bias_ptr, state_ptr, projection_ptr, mixed_ptr, o_ptr,
             head_norm_ptr, norm_ptr, act_ptr, counter_ptr, trace_ptr, eps, scale, stride_wc, stride_cc, out_row,
             up_row, programs, HIDDEN: gl.constexpr, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr,
             INTERMEDIATE: gl.constexpr, OUT_GROUPS: gl.constexpr, UP_GROUPS: gl.constexpr,
             OUT_PADDED: gl.constexpr, UP_PADDED: gl.constexpr, BLOCK_HIDDEN: gl.constexpr,
             USE_PDL: gl.constexpr, WARPS: gl.constexpr, PACED: gl.constexpr, GATE_UP_AFTER: gl.constexpr,
             TRACE: gl.constexpr, UNROLLED: gl.constexpr):
    """The computing warps: phase 0 (module docstring), then the tail's phases."""
    ATTENDED: gl.constexpr = HEADS * HEAD_DIM
    SLICES: gl.constexpr = HIDDEN // TILE_COLUMNS
    dtype: gl.constexpr = out_tiles.dtype
    out_layout: gl.constexpr = groups_layout(OUT_PADDED, WARPS)
    up_layout: gl.constexpr = groups_layout(UP_PADDED, WARPS)
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [WARPS, 1], [1, 0])  # [SLAB, 4]: the 64 rows
    slab_layout: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [WARPS, 1], [1, 0])  # [HEAD_DIM, SLAB]
    pair_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, WARPS], [1, 0])  # [2, BLOCK_HIDDEN]
    program = gl.program_id(0)
    head = program // (HEAD_DIM // SLAB)
    first = program * SLAB  # = head x HEAD_DIM + this program's first value column
    phase_0_trace = trace_ptr + gl.num_programs(0) * TRACE_POINTS  # the second table
    _mark_time(trace_ptr, 13, TRACE)
    _mark(trace_ptr, 0, TRACE)
    _mark(phase_0_trace, 0, TRACE)

    # before the PDL wait, what no earlier kernel writes: the norm weights, the b and a rows of the head
    offsets = vector_offsets(WARPS)
    input_norm = gl.load(input_norm_ptr + offsets, mask=offsets < HIDDEN, other=0.0).to(gl.float32)
    norm_weight = gl.load(norm_ptr + offsets, mask=offsets < HIDDEN, other=0.0).to(gl.float32)
    pair = gl.arange(0, 2, layout=gl.SliceLayout(1, pair_layout))
    columns = gl.arange(0, BLOCK_HIDDEN, layout=gl.SliceLayout(0, pair_layout))
    pair_rows = 4 * ATTENDED + gl.expand_dims(pair, 1) * HEADS + head  # b, then a
    pair_weight = gl.load(weight_ptr + pair_rows * HIDDEN + gl.expand_dims(columns, 0),
                          mask=gl.expand_dims(columns < HIDDEN, 0), other=0.0)
    a_log = gl.load(a_log_ptr + head)
    dt_bias = gl.load(dt_bias_ptr + head)
    # ... this layer's own states: its channels' conv state and weights (flat row f of the 64: block f // 16 of
    # q | k | v | z, at that block's row `first` + f % 16, the channel of the conv for the first three)
    flat = (gl.expand_dims(gl.arange(0, SLAB, layout=gl.SliceLayout(1, rows_layout)), 1) * 4
            + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, rows_layout)), 0))
    index = (flat // SLAB) * ATTENDED + first + flat % SLAB
    conv_mask = flat < 3 * SLAB
    state_row = conv_state_ptr + index * stride_cc
    weight_row = conv_weight_ptr + index * stride_wc
    old_0 = gl.load(state_row, mask=conv_mask, other=0.0)
    old_1 = gl.load(state_row + 1, mask=conv_mask, other=0.0)
    old_2 = gl.load(state_row + 2, mask=conv_mask, other=0.0)
    conv_0 = gl.load(weight_row, mask=conv_mask, other=0.0).to(gl.float32)
    conv_1 = gl.load(weight_row + 1, mask=conv_mask, other=0.0).to(gl.float32)
    conv_2 = gl.load(weight_row + 2, mask=conv_mask, other=0.0).to(gl.float32)
    conv_3 = gl.load(weight_row + 3, mask=conv_mask, other=0.0).to(gl.float32)
    # ... and its slab of the recurrent state
    keys = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, slab_layout))
    values = gl.arange(0, SLAB, layout=gl.SliceLayout(0, slab_layout))
    slab = (state_ptr + head * (HEAD_DIM * HEAD_DIM) + gl.expand_dims(keys, 1) * HEAD_DIM + first % HEAD_DIM
            + gl.expand_dims(values, 0))
    old = gl.load(slab)
    previous_kernel_done(USE_PDL)
    _mark(trace_ptr, 1, TRACE)
    _mark(phase_0_trace, 1, TRACE)

    # this program's rows of h (the tail's residual), and h normed into shared memory (the GEMV's prologue)
    rows, row_mask = own_rows(out_row, HIDDEN, OUT_GROUPS, OUT_PADDED, out_layout)
    residual = gl.load(hidden_ptr + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
    h = gl.load(hidden_ptr + offsets, mask=offsets < HIDDEN, other=0.0, cache_modifier=".cg").to(gl.float32)
    rstd = gl.rsqrt(gl.sum(h * h, axis=0) / HIDDEN + eps)
    inputs.store((h * rstd * (1.0 + input_norm)).to(dtype))
    gl.thread_barrier()
    _mark(phase_0_trace, 2, TRACE)

    # b and a, rounded as the projection stores them; the gates
    x = inputs.slice(0, BLOCK_HIDDEN).load(gl.SliceLayout(0, pair_layout)).to(gl.float32)
    gates = gl.sum(pair_weight.to(gl.float32) * gl.expand_dims(x, 0), axis=1).to(dtype).to(gl.float32)
    b = gl.sum(gl.where(pair == 0, gates, 0.0), axis=0)
    a = gl.sum(gl.where(pair == 1, gates, 0.0), axis=0)
    decay = gl.exp(-gl.exp(a_log) * _softplus(a + dt_bias))
    beta = sigmoid(b).to(dtype).to(gl.float32)

    # the 64 in-projection rows, rounded as the GEMV stores them: first q | k, whose conv outputs this
    # program then stores and arrives at its head's barrier with, then v | z while the head's other programs
    # arrive; then their room is the gate/up weights'
    counter = counter_ptr + TAIL_COUNTERS + 1 + head
    mbarrier.wait(arrivals.index(5), 0)
    _mark(phase_0_trace, 3, TRACE)
    first_half = phase_sums(gate_tiles, inputs, UP_PADDED, SLICES, up_layout, UNROLLED)
    projected.slice(0, UP_PADDED).store(gl.convert_layout(first_half.to(dtype), rows_layout))
    gl.thread_barrier()
    _conv_step(projected.load(rows_layout), old_0, old_1, old_2, conv_0, conv_1, conv_2, conv_3, state_row,
               mixed_ptr + index, flat < 2 * SLAB)
    arrive(counter)
    _mark(phase_0_trace, 9, TRACE)
    second_half = phase_sums(up_tiles, inputs, UP_PADDED, SLICES, up_layout, UNROLLED)
    projected.slice(UP_PADDED, UP_PADDED).store(gl.convert_layout(second_half.to(dtype), rows_layout))
    gl.thread_barrier()
    if GATE_UP_AFTER == 0:
        mbarrier.arrive(arrivals.index(4))
    _mark(phase_0_trace, 4, TRACE)
    new = projected.load(rows_layout)
    _conv_step(new, old_0, old_1, old_2, conv_0, conv_1, conv_2, conv_3, state_row, mixed_ptr + index,
               (flat >= 2 * SLAB) & conv_mask)
    gl.store(projection_ptr + index, new, mask=flat >= 3 * SLAB)  # z, as projected
    _mark(phase_0_trace, 5, TRACE)

    # once the head's programs have stored its q and k: the delta rule on this program's slab (recurrent.py)
    wait_for(counter, counter_ptr + 3, HEAD_DIM // SLAB, WARPS)
    if GATE_UP_AFTER == 1:
        mbarrier.arrive(arrivals.index(4))
    _mark(phase_0_trace, 6, TRACE)
    q = gl.load(mixed_ptr + head * HEAD_DIM + keys, cache_modifier=".cg").to(gl.float32)
    k = gl.load(mixed_ptr + ATTENDED + head * HEAD_DIM + keys, cache_modifier=".cg").to(gl.float32)
    v = gl.load(mixed_ptr + 2 * ATTENDED + first + values, cache_modifier=".cg").to(gl.float32)
    q = q * (gl.rsqrt(gl.sum(q * q, axis=0) + 1e-6) * scale)
    k = k * gl.rsqrt(gl.sum(k * k, axis=0) + 1e-6)
    state = old * decay
    predicted = gl.sum(state * gl.expand_dims(k, 1), axis=0)
    delta = (v - predicted) * beta
    state = state + gl.expand_dims(k, 1) * gl.expand_dims(delta, 0)
    gl.store(slab, state)
    gl.store(o_ptr + first + values, gl.sum(state * gl.expand_dims(q, 1), axis=0).to(dtype))
    if GATE_UP_AFTER == 3:
        mbarrier.arrive(arrivals.index(4))
    _mark(phase_0_trace, 7, TRACE)

    # every head's o and z written: the tail, its head norm reading them
    grid_barrier(counter_ptr + TAIL_COUNTERS, counter_ptr + 3, programs, WARPS)
    if GATE_UP_AFTER == 2:
        mbarrier.arrive(arrivals.index(4))
    _mark(phase_0_trace, 8, TRACE)
    tail_phases(out_tiles, gate_tiles, up_tiles, down_tiles, inputs, arrivals, o_ptr,
                o_ptr, projection_ptr + 3 * ATTENDED, head_norm_ptr, hidden_ptr, act_ptr, counter_ptr, trace_ptr,
                eps, rows, row_mask, residual, norm_weight, up_row, programs, HIDDEN, ATTENDED, INTERMEDIATE,
                UP_GROUPS, OUT_PADDED, UP_PADDED, False, True, HEAD_DIM, True, USE_PDL, TRACE, True, WARPS, PACED,
                1 + HEADS, UNROLLED)


def plan(hidden: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, width: int,
         intermediate: int, programs: int) -> dict | None:
    """The launch at these sizes on `programs` SMs: staged_out_projection_mlp.plan's dict, with `copies` and
    `shared_bytes` this kernel's, or None where the kernel does not apply (module docstring)."""
    if key_heads != value_heads or key_dim != value_dim or width != WIDTH or value_dim % SLAB.value:
        return None
    if value_dim < 32 or value_dim & (value_dim - 1):
        return None
    attended = value_heads * value_dim
    launch = tail.plan(hidden, attended, intermediate, programs)
    if launch is None or launch["grid"] != attended // SLAB.value:
        return None
    if launch["up_padded"] != 2 * SLAB.value // TILE_ROWS.value:  # the gate/up room holds exactly the 64 rows
        return None
    shared_bytes = launch["shared_bytes"] + 2 * launch["up_padded"] * TILE_ROWS.value * 2 + 16
    if shared_bytes > tail.SHARED_MEMORY_LIMIT - 2 * 1024:
        return None
    copies = launch["copies"] + 4 * SLAB.value // TILE_ROWS.value * hidden // TILE_COLUMNS.value
    return dict(launch, copies=copies, shared_bytes=shared_bytes)


def weight_descriptors(projection_weight: torch.Tensor, out_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                       down_weight: torch.Tensor) -> tuple:
    """The TMA descriptors of a layer's four weights (staged_out_projection_mlp.tile_descriptor): build them
    once per layer and pass them to every call."""
    return (tail.tile_descriptor(projection_weight), *tail.weight_descriptors(out_weight, gate_up_weight,
                                                                                down_weight))


def new_counters(device, heads: int, layers: int = 1) -> torch.Tensor:
    """Zeroed counters, `counter_count(heads)` per layer ([layers, count] int32): a layer's own row at every
    call (the kernel leaves them zeroed; element 3 is the error flag a barrier that gave up sets)."""
    return torch.zeros(layers, counter_count(heads), device=device, dtype=torch.int32)


def staged_decode_layer(
    hidden: torch.Tensor,
    input_norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    head_norm_weight: torch.Tensor,
    out_weight: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    counters: torch.Tensor,
    projection: torch.Tensor,
    mixed: torch.Tensor,
    delta_out: torch.Tensor,
    act: torch.Tensor,
    pdl: bool = False,
    descriptors: tuple | None = None,
    programs: int | None = None,
    trace: torch.Tensor | None = None,
    gate_up_after: int = GATE_UP_AFTER,
    paced: bool = tail.PACED,
    unrolled: bool = tail.UNROLLED,
) -> torch.Tensor:
    """One sequence's Gated DeltaNet layer decode step, in place: hidden [1, H] (the residual stream) becomes
    the layer's output; conv_state [1, C, 3] and state [1, Hv, Dk, Dv] float32 advance one token.

    gated_delta_rule_decode_projected's arguments (hidden, input_norm, eps, weight [N, H] the fused
    q | k | v | z | b | a in-projection, conv_weight [C, 4], conv_state, A_log, dt_bias, state), then the
    tail's (head_norm_weight [Dv], the gated RMSNorm's; out_weight [H, Hv Dv]; norm_weight [H] the MLP norm's;
    gate_up_weight [2 I, H]; down_weight [H, I]); counters, a row of `new_counters` used by no other launch in
    flight. Buffers written: projection [1, N] (its z columns), mixed [1, C] (the conv's outputs), delta_out
    [1, Hv, Dv] (o, un-normed), act [1, I]. descriptors: from `weight_descriptors` (built here when None);
    programs: SMs to use (default all). Raises ValueError where `plan` says the kernel does not apply.
    Diagnostics (benchmarks/staged_layer_trace.py): trace, an int64 [2, grid, TRACE_POINTS] tensor, receives each
    program's clock at the trace points (PHASE_0_POINTS); gate_up_after: GATE_UP_AFTER's choices."""
    check_tensor("hidden", hidden, shape=(1, None), dtype=(torch.bfloat16,), contiguous=True)
    size = hidden.shape[1]
    check_tensor("state", state, shape=(1, None, None, None), dtype=torch.float32, contiguous=True)
    _, value_heads, key_dim, value_dim = state.shape
    check_tensor("weight", weight, shape=(None, size), dtype=hidden.dtype, contiguous=True)
    key_rows = weight.shape[0] - 2 * value_heads * value_dim - 2 * value_heads
    if key_rows <= 0 or key_rows % (2 * key_dim):
        raise ValueError(f"weight has {weight.shape[0]} rows, not 2 Hk x {key_dim} + 2 x {value_heads} x "
                         f"{value_dim} + 2 x {value_heads}")
    key_heads = key_rows // (2 * key_dim)
    channels = key_rows + value_heads * value_dim
    check_tensor("conv_weight", conv_weight, shape=(channels, None), dtype=hidden.dtype)
    width = conv_weight.shape[1]
    check_tensor("out_weight", out_weight, shape=(size, value_heads * value_dim), dtype=hidden.dtype,
                 contiguous=True)
    check_tensor("gate_up_weight", gate_up_weight, shape=(None, size), dtype=hidden.dtype, contiguous=True)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight has {gate_up_weight.shape[0]} rows, not gate and up rows of one width")
    intermediate = gate_up_weight.shape[0] // 2
    programs = sm_count(hidden.device) if programs is None else programs
    launch = plan(size, key_heads, value_heads, key_dim, value_dim, width, intermediate, programs)
    if launch is None:
        raise ValueError(f"staged_decode_layer does not apply to hidden {size}, {key_heads} key and {value_heads} "
                         f"value heads of {key_dim} and {value_dim}, conv width {width}, intermediate "
                         f"{intermediate} on {programs} programs (staged_decode_layer.plan)")
    check_tensor("conv_state", conv_state, shape=(1, channels, width - 1), dtype=hidden.dtype)
    for name, tensor in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(name, tensor, shape=(value_heads,), dtype=torch.float32, contiguous=True)
    for name, tensor, length in (("input_norm", input_norm, size), ("norm_weight", norm_weight, size),
                                 ("head_norm_weight", head_norm_weight, value_dim)):
        check_tensor(name, tensor, shape=(length,), dtype=hidden.dtype, contiguous=True)
    check_tensor("down_weight", down_weight, shape=(size, intermediate), dtype=hidden.dtype, contiguous=True)
    check_tensor("counters", counters, shape=(counter_count(value_heads),), dtype=(torch.int32,), contiguous=True)
    for name, tensor, shape in (("projection", projection, (1, weight.shape[0])), ("mixed", mixed, (1, channels)),
                                ("delta_out", delta_out, (1, value_heads, value_dim)),
                                ("act", act, (1, intermediate))):
        check_tensor(name, tensor, shape=shape, dtype=hidden.dtype, contiguous=True)
    check_same_device(hidden=hidden, input_norm=input_norm, weight=weight, conv_weight=conv_weight,
                      conv_state=conv_state, A_log=A_log, dt_bias=dt_bias, state=state,
                      head_norm_weight=head_norm_weight, out_weight=out_weight, norm_weight=norm_weight,
                      gate_up_weight=gate_up_weight, down_weight=down_weight, counters=counters,
                      projection=projection, mixed=mixed, delta_out=delta_out, act=act)
    if descriptors is None:
        descriptors = weight_descriptors(weight, out_weight, gate_up_weight, down_weight)
    _layer_kernel[(launch["grid"],)](
        *descriptors, hidden, input_norm, weight, conv_weight, conv_state, A_log, dt_bias, state, projection, mixed,
        delta_out, head_norm_weight, norm_weight, act, counters, counters if trace is None else trace, eps, key_dim**-0.5, conv_weight.stride(0),
        conv_state.stride(1),
        HIDDEN=size, HEADS=value_heads, HEAD_DIM=value_dim, INTERMEDIATE=intermediate,
        OUT_GROUPS=launch["out_groups"], UP_GROUPS=launch["up_groups"], OUT_PADDED=launch["out_padded"],
        UP_PADDED=launch["up_padded"], BLOCK_HIDDEN=triton.next_power_of_2(size), USE_PDL=pdl,
        WARPS=WARPS.value, PACED=paced, GATE_UP_AFTER=gate_up_after, TRACE=trace is not None,
        UNROLLED=unrolled,
        num_warps=WARPS.value, **launch_options(pdl),
    )
    return hidden


def staged_decode_layer_cost(hidden_size, heads, head_dim, intermediate, width=4, element_size=2):
    """(bytes, FLOPs) of the floor: the four weights, the recurrent state in and out, the conv state in and out
    and its weight, the small vectors (h in and out, o, z, the activations)."""
    attended = heads * head_dim
    channels = 3 * attended
    rows = 4 * attended + 2 * heads
    weights = rows * hidden_size + hidden_size * attended + 3 * intermediate * hidden_size
    data = element_size * (weights + channels * (2 * (width - 1) + width) + 4 * hidden_size + 4 * attended
                           + 2 * intermediate) + 2 * 4 * heads * head_dim * head_dim
    flops = 2 * weights + 7 * heads * head_dim * head_dim + channels * (2 * width + 4)
    return data, flops
