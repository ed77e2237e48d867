"""A decode layer's out-projection and MLP in one launch, every weight staged into shared memory first (Gluon).

The same three phases and roundings as out_projection_mlp.py, for one token (x, gate, z [1, A]; h [1, H]):
    phase 1   h = h + x' @ W_o^T                        x' = x * sigmoid(gate), or gated_rms_norm(x, z)
    phase 2   a = swiglu(rms_norm(h) (1 + w) @ W_gu^T)
    phase 3   h = h + a @ W_d^T
but as one launch of one program per SM, each of which owns fixed output rows of every phase and asks the
TMA engine for all of its weight rows (a loading warp; the first copies before the PDL wait, so during the
previous kernel's drain): 200 KB a program at the Qwen3.5-0.8B shape, 26.2 MB in all, the whole layer tail in
the machine's shared memory. The phases meet at two grid-wide barriers (a counter in global memory: each
program's release add, then a poll), and the weights of the later phases arrive while the earlier ones
compute and the programs wait for each other. That is the difference from the one-launch tail built from
`tl` (docs/decisions.md, D18), which can keep one tile ahead in registers and leaves HBM idle at
every barrier, and from the three launches of out_projection_mlp.py, whose PDL boundaries each cost a drain
and a ramp of the memory system.

Written in Gluon (`triton.experimental.gluon`, Triton's lower-level language that ships with Triton 3.6),
which exposes what `tl` does not: shared-memory allocations, TMA copies (`tma.async_copy_global_to_shared`),
mbarriers and warp specialisation. Hopper or later; the interpreter does not run Gluon, so the CPU tests
compile it for sm_90 and the GPU tests check it against the three-launch kernel and float64.

Each program: its rows of W_o and W_d, and its gate and up rows of W_gu, as tiles of [TILE_ROWS, TILE_COLUMNS]
(4 x 256) stored column slice by column slice, one mbarrier per phase counting the phase's bytes. A phase's
input vector x' (the prologue applied: the gate or the head norm, the MLP's RMSNorm) is formed by every
program into shared memory; 8 computing warps then hold the phase's row groups across warps (a group's 4 rows
in one warp, 8 consecutive columns a lane), multiply slice by slice and reduce each row within its warp. The
program's own rows of h are loaded with phase 1's input, before the weight copies fill the memory system's
queues, and phase 3 adds to phase 1's result in registers; the rows every program wrote (h after phase 1, the
activations) are read back past L1 (".cg").

The grid barrier: every program's threads meet (`thread_barrier`), one thread adds 1 to the phase's counter
with release semantics, one thread a program polls it (a relaxed read handed to the others through shared
memory) until it reads the number of programs, then an acquire. The last program to leave resets the counters
(CUDA-graph replay). Every program of the grid must be resident at once for the barriers to complete: one
program per SM (its shared memory takes the SM), and the next kernel is let launch (PDL) only past the second
barrier, so it cannot take an SM a program still needs. A poll gives up after SPIN_LIMIT reads and raises the
counters' error flag (a wrong result and a flag the host can read, instead of a hung GPU).

Pacing: the down projection's weights are requested once the program is past the first barrier.
With every weight requested at once, the first barrier's adds and polls wait behind the whole layer's
copies in the memory system's queues (per-program clock marks: docs/decisions.md, D9).

Floor at the real shapes (H 1024, A 2048, I 3584, bf16): the weights, 4.2 + 14.7 + 7.3 = 26.2 MB (~6.2 us at
the 4.25 TB/s the H200 copies at); activations a few KB; 26 MFLOP. Measured on the H200 (docs/decisions.md,
D8): 10.8 us a layer back to back in a CUDA graph with PDL (2.4 TB/s; the three
launches 12.05-12.25 us in `decode_sweep.py --parts tail`); in the engine's
decode step 641.4 against 714.6 us at context 128 (`engine_options.py`)."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..common import check_same_device, check_tensor, launch_options, sm_count

WARPS = gl.constexpr(8)  # the computing warps (and one loading warp)
TILE_ROWS = gl.constexpr(4)
TILE_COLUMNS = gl.constexpr(256)  # 32 lanes x 8 bf16 (16-byte shared-memory loads); the TMA box's longest side
INPUT_SLICES = gl.constexpr(16)  # the input vector's room in shared memory: K <= 16 x 256
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes a Hopper program may allocate
SPIN_LIMIT = gl.constexpr(1 << 24)  # polls of a barrier counter before a program gives up (a bug, never a wait)
# the counters a launch uses: [the two barriers, departures, the error flag]
COUNTERS = 4


# operators/common.py's wait_for_previous_kernel and allow_next_kernel, in Gluon (a Gluon kernel cannot call
# `triton.jit` functions): the same two PTX instructions
@gluon.jit
def _previous_kernel_done(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _next_kernel_may_launch(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.constexpr_function
def _groups_layout(groups, warps):
    # [groups, TILE_ROWS, TILE_COLUMNS] in registers: warps over the groups first, then over a group's rows (no
    # product is reduced across warps); 8 consecutive columns a lane (16-byte shared-memory loads)
    across_groups = min(groups, warps)
    return gl.BlockedLayout([1, 1, 8], [1, 1, 32], [across_groups, warps // across_groups, 1], [2, 1, 0])


@gluon.jit
def _stage(descriptor, tiles, barrier, first_row, GROUPS: gl.constexpr, SLICES: gl.constexpr):
    """TMA copies of GROUPS row groups (TILE_ROWS rows each from first_row) of a weight, every column, into tiles
    [SLICES, padded groups, TILE_ROWS, TILE_COLUMNS] (column slice s of row group g at [s, g]; the padding
    groups are never written), counted on barrier. Rows past the weight arrive as zeros."""
    for part in gl.static_range(SLICES):
        for group in gl.static_range(GROUPS):
            tma.async_copy_global_to_shared(descriptor, [0, first_row + group * TILE_ROWS, part * TILE_COLUMNS],
                                            barrier, tiles.index(part).slice(group, 1))


@gluon.jit
def _phase_sums(tiles, inputs, PADDED: gl.constexpr, SLICES: gl.constexpr, layout: gl.constexpr):
    """The dot products of every staged row with the input vector in shared memory: [PADDED, TILE_ROWS]
    float32 in SliceLayout(2, layout) (garbage in the padding groups)."""
    acc = gl.zeros([PADDED, TILE_ROWS, TILE_COLUMNS], gl.float32, layout)
    for part in gl.static_range(SLICES):
        weight = tiles.index(part).load(layout).to(gl.float32)
        x = inputs.slice(part * TILE_COLUMNS, TILE_COLUMNS).load(gl.SliceLayout(0, gl.SliceLayout(0, layout)))
        acc += weight * gl.expand_dims(gl.expand_dims(x.to(gl.float32), 0), 0)
    return gl.sum(acc, axis=2)


@gluon.jit
def _vector_offsets(WARPS: gl.constexpr):
    """Offsets 0 .. INPUT_SLICES * TILE_COLUMNS - 1, 8 consecutive a lane."""
    return gl.arange(0, INPUT_SLICES * TILE_COLUMNS, layout=gl.BlockedLayout([8], [32], [WARPS], [0]))


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _poll(counter_ptr, WARPS: gl.constexpr):
    """The counter's value, read past L1 by one thread and handed to the others through shared memory, so a
    program sends one read a poll, not one a warp (every thread polling measured 1.3 us slower a layer)."""
    thread = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    return gl.max(gl.load(counter_ptr + thread * 0, mask=thread == 0, other=0, volatile=True), axis=0)


@gluon.jit
def _grid_barrier(counter_ptr, error_ptr, programs, WARPS: gl.constexpr):
    """Wait until every program of the grid has reached this barrier (its counter, see the module docstring);
    everything each wrote before is then visible to every program's loads past L1."""
    gl.thread_barrier()
    gl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = _poll(counter_ptr, WARPS)
    spins = 0
    while (arrived < programs) & (spins < SPIN_LIMIT):
        arrived = _poll(counter_ptr, WARPS)
        spins += 1
    if spins >= SPIN_LIMIT:
        gl.atomic_xchg(error_ptr, 1, sem="relaxed", scope="gpu")
    gl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    gl.thread_barrier()


@gluon.jit
def _own_rows(first_row, N, GROUPS: gl.constexpr, PADDED: gl.constexpr, layout: gl.constexpr):
    """(rows, mask) [PADDED, TILE_ROWS] in SliceLayout(2, layout), as `_phase_sums` returns its sums: row
    first_row + g * TILE_ROWS + r, masked past the first GROUPS groups and past N."""
    group = gl.arange(0, PADDED, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
    row = gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
    rows = first_row + gl.expand_dims(group, 1) * TILE_ROWS + gl.expand_dims(row, 0)
    return rows, (gl.expand_dims(group, 1) < GROUPS) & (rows < N)


@gluon.jit
def _staged_kernel(
    out_descriptor, gate_up_descriptor, down_descriptor,
    x_ptr, gate_ptr, z_ptr, head_norm_ptr, hidden_ptr, norm_ptr, act_ptr, counter_ptr, eps,
    HIDDEN: gl.constexpr, ATTENDED: gl.constexpr, INTERMEDIATE: gl.constexpr,
    OUT_GROUPS: gl.constexpr, UP_GROUPS: gl.constexpr, OUT_PADDED: gl.constexpr, UP_PADDED: gl.constexpr,
    HAS_GATE: gl.constexpr, HEAD_NORM: gl.constexpr, HEAD_DIM: gl.constexpr, ROUND_PRODUCT: gl.constexpr,
    USE_PDL: gl.constexpr, WARPS: gl.constexpr,
):
    OUT_SLICES: gl.constexpr = ATTENDED // TILE_COLUMNS
    UP_SLICES: gl.constexpr = HIDDEN // TILE_COLUMNS
    DOWN_SLICES: gl.constexpr = INTERMEDIATE // TILE_COLUMNS
    dtype: gl.constexpr = out_descriptor.dtype
    tile_layout: gl.constexpr = out_descriptor.layout
    program = gl.program_id(0)
    programs = gl.num_programs(0)
    out_row = program * (OUT_GROUPS * TILE_ROWS)
    up_row = program * (UP_GROUPS * TILE_ROWS)

    out_tiles = gl.allocate_shared_memory(dtype, [OUT_SLICES, OUT_PADDED, TILE_ROWS, TILE_COLUMNS], tile_layout)
    gate_tiles = gl.allocate_shared_memory(dtype, [UP_SLICES, UP_PADDED, TILE_ROWS, TILE_COLUMNS], tile_layout)
    up_tiles = gl.allocate_shared_memory(dtype, [UP_SLICES, UP_PADDED, TILE_ROWS, TILE_COLUMNS], tile_layout)
    down_tiles = gl.allocate_shared_memory(dtype, [DOWN_SLICES, OUT_PADDED, TILE_ROWS, TILE_COLUMNS], tile_layout)
    inputs = gl.allocate_shared_memory(dtype, [INPUT_SLICES * TILE_COLUMNS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    # an mbarrier per phase's weights, and one the computing warps arrive on once past the first grid barrier
    # (pacing the loading warp)
    arrivals = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for phase in gl.static_range(4):
        mbarrier.init(arrivals.index(phase), count=1)
    fence_async_shared()

    # one warp asks for every weight of the three phases, in the order the phases read them, while the
    # others wait for the previous kernel and compute
    gl.warp_specialize([
        (_compute, (out_tiles, gate_tiles, up_tiles, down_tiles, inputs, arrivals, x_ptr, gate_ptr, z_ptr,
                    head_norm_ptr, hidden_ptr, norm_ptr, act_ptr, counter_ptr, eps, out_row, up_row,
                    programs, HIDDEN, ATTENDED, INTERMEDIATE, OUT_GROUPS, UP_GROUPS, OUT_PADDED, UP_PADDED,
                    HAS_GATE, HEAD_NORM, HEAD_DIM, ROUND_PRODUCT, USE_PDL, WARPS)),
        (_load_weights, (out_descriptor, gate_up_descriptor, down_descriptor, out_tiles, gate_tiles, up_tiles,
                         down_tiles, arrivals, out_row, up_row, INTERMEDIATE, OUT_GROUPS, UP_GROUPS,
                         OUT_SLICES, UP_SLICES, DOWN_SLICES)),
    ], [1], [64])
    for phase in gl.static_range(4):
        mbarrier.invalidate(arrivals.index(phase))


@gluon.jit
def _load_weights(out_descriptor, gate_up_descriptor, down_descriptor, out_tiles, gate_tiles, up_tiles, down_tiles,
                  arrivals, out_row, up_row, INTERMEDIATE: gl.constexpr, OUT_GROUPS: gl.constexpr,
                  UP_GROUPS: gl.constexpr, OUT_SLICES: gl.constexpr, UP_SLICES: gl.constexpr,
                  DOWN_SLICES: gl.constexpr):
    """The loading warp: TMA copies of this program's rows of the three weights, each phase's on its mbarrier;
    phase 3's only once the computing warps are past the first grid barrier (mbarrier 3: pacing)."""
    tile_bytes: gl.constexpr = TILE_ROWS * TILE_COLUMNS * out_descriptor.dtype.primitive_bitwidth // 8
    mbarrier.expect(arrivals.index(0), OUT_GROUPS * OUT_SLICES * tile_bytes)
    _stage(out_descriptor, out_tiles, arrivals.index(0), out_row, OUT_GROUPS, OUT_SLICES)
    mbarrier.expect(arrivals.index(1), 2 * UP_GROUPS * UP_SLICES * tile_bytes)
    _stage(gate_up_descriptor, gate_tiles, arrivals.index(1), up_row, UP_GROUPS, UP_SLICES)
    _stage(gate_up_descriptor, up_tiles, arrivals.index(1), INTERMEDIATE + up_row, UP_GROUPS, UP_SLICES)
    mbarrier.wait(arrivals.index(3), 0)
    mbarrier.expect(arrivals.index(2), OUT_GROUPS * DOWN_SLICES * tile_bytes)
    _stage(down_descriptor, down_tiles, arrivals.index(2), out_row, OUT_GROUPS, DOWN_SLICES)


@gluon.jit
def _compute(out_tiles, gate_tiles, up_tiles, down_tiles, inputs, arrivals, x_ptr, gate_ptr, z_ptr, head_norm_ptr,
             hidden_ptr, norm_ptr, act_ptr, counter_ptr, eps, out_row, up_row, programs,
             HIDDEN: gl.constexpr, ATTENDED: gl.constexpr, INTERMEDIATE: gl.constexpr, OUT_GROUPS: gl.constexpr,
             UP_GROUPS: gl.constexpr, OUT_PADDED: gl.constexpr, UP_PADDED: gl.constexpr, HAS_GATE: gl.constexpr,
             HEAD_NORM: gl.constexpr, HEAD_DIM: gl.constexpr,
             ROUND_PRODUCT: gl.constexpr, USE_PDL: gl.constexpr, WARPS: gl.constexpr):
    """The computing warps: the three phases and the two grid barriers."""
    OUT_SLICES: gl.constexpr = ATTENDED // TILE_COLUMNS
    UP_SLICES: gl.constexpr = HIDDEN // TILE_COLUMNS
    DOWN_SLICES: gl.constexpr = INTERMEDIATE // TILE_COLUMNS
    out_layout: gl.constexpr = _groups_layout(OUT_PADDED, WARPS)
    up_layout: gl.constexpr = _groups_layout(UP_PADDED, WARPS)
    dtype: gl.constexpr = out_tiles.dtype
    # what no earlier kernel writes, loaded before the PDL wait: the MLP's norm weight (and the head norm's)
    offsets = _vector_offsets(WARPS)
    norm_weight = gl.load(norm_ptr + offsets, mask=offsets < HIDDEN, other=0.0).to(gl.float32)
    _previous_kernel_done(USE_PDL)
    # this program's rows of h, loaded with phase 1's input, before the weight copies fill the memory system's
    # queues (a load issued behind them waits microseconds); phase 3 adds to phase 1's result in registers
    rows, row_mask = _own_rows(out_row, HIDDEN, OUT_GROUPS, OUT_PADDED, out_layout)
    residual = gl.load(hidden_ptr + rows, mask=row_mask, other=0.0, cache_modifier=".cg")

    # phase 1: x' into shared memory, then h[out rows] += x' @ W_o[out rows]^T
    if HEAD_NORM:
        # the Gated DeltaNet output norm per head (gated_rms_norm.py's roundings), heads as rows
        HEAD_ROWS: gl.constexpr = INPUT_SLICES * TILE_COLUMNS // HEAD_DIM
        head_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [WARPS, 1], [1, 0])
        head = gl.arange(0, HEAD_ROWS, layout=gl.SliceLayout(1, head_layout))
        lane = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, head_layout))
        channel = gl.expand_dims(head, 1) * HEAD_DIM + gl.expand_dims(lane, 0)
        mask = channel < ATTENDED
        x = gl.load(x_ptr + channel, mask=mask, other=0.0).to(gl.float32)
        z = gl.load(z_ptr + channel, mask=mask, other=0.0).to(gl.float32)
        weight = gl.load(head_norm_ptr + lane).to(gl.float32)  # (not written by earlier kernels)
        normed = x * gl.expand_dims(gl.rsqrt(gl.sum(x * x, axis=1) / HEAD_DIM + eps), 1)
        normed = normed.to(dtype).to(gl.float32)
        product = gl.expand_dims(weight, 0) * normed
        if ROUND_PRODUCT:
            product = product.to(dtype).to(gl.float32)
        normed = product * (z / (1.0 + gl.exp(-z)))
        inputs.reshape([HEAD_ROWS, HEAD_DIM]).store(normed.to(dtype))
    else:
        mask = offsets < ATTENDED
        x = gl.load(x_ptr + offsets, mask=mask, other=0.0)
        if HAS_GATE:
            gate = gl.load(gate_ptr + offsets, mask=mask, other=0.0).to(gl.float32)
            x = (x.to(gl.float32) * _sigmoid(gate)).to(dtype)
        inputs.store(x)
    gl.thread_barrier()
    mbarrier.wait(arrivals.index(0), 0)
    acc = _phase_sums(out_tiles, inputs, OUT_PADDED, OUT_SLICES, out_layout)
    residual = (acc + residual.to(gl.float32)).to(dtype)
    gl.store(hidden_ptr + rows, residual, mask=row_mask)
    _grid_barrier(counter_ptr, counter_ptr + 3, programs, WARPS)
    mbarrier.arrive(arrivals.index(3))

    # phase 2: the MLP's RMSNorm of h into shared memory, then act[up rows] = swiglu(gate, up)
    h = gl.load(hidden_ptr + offsets, mask=offsets < HIDDEN, other=0.0, cache_modifier=".cg").to(gl.float32)
    rstd = gl.rsqrt(gl.sum(h * h, axis=0) / HIDDEN + eps)
    inputs.store((h * rstd * (1.0 + norm_weight)).to(dtype))
    gl.thread_barrier()
    mbarrier.wait(arrivals.index(1), 0)
    acc = _phase_sums(gate_tiles, inputs, UP_PADDED, UP_SLICES, up_layout)
    acc_up = _phase_sums(up_tiles, inputs, UP_PADDED, UP_SLICES, up_layout)
    up_rows, up_mask = _own_rows(up_row, INTERMEDIATE, UP_GROUPS, UP_PADDED, up_layout)
    gl.store(act_ptr + up_rows, (acc * _sigmoid(acc) * acc_up).to(dtype), mask=up_mask)
    _grid_barrier(counter_ptr + 1, counter_ptr + 3, programs, WARPS)
    _next_kernel_may_launch(USE_PDL)

    # phase 3: h[out rows] += act @ W_d[out rows]^T
    inputs.store(gl.load(act_ptr + offsets, mask=offsets < INTERMEDIATE, other=0.0, cache_modifier=".cg"))
    gl.thread_barrier()
    mbarrier.wait(arrivals.index(2), 0)
    acc = _phase_sums(down_tiles, inputs, OUT_PADDED, DOWN_SLICES, out_layout)
    gl.store(hidden_ptr + rows, (acc + residual.to(gl.float32)).to(dtype), mask=row_mask)

    # the last program out resets the counters for the next launch: every program has passed both barriers
    departed = gl.atomic_add(counter_ptr + 2, 1, sem="relaxed", scope="gpu")
    if departed == programs - 1:
        gl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")
        gl.atomic_xchg(counter_ptr + 2, 0, sem="relaxed", scope="gpu")


def padded_groups(groups: int) -> int:
    """A phase's row groups as the registers hold them: a power of two, at least 2 (test_plan)."""
    return max(2, triton.next_power_of_2(groups))


def plan(hidden: int, attended: int, intermediate: int, programs: int) -> dict | None:
    """The launch at these sizes on `programs` SMs: dict(grid, out_groups, up_groups (of TILE_ROWS rows a program),
    out_padded, up_padded (`padded_groups`), copies (TMA copies a program), shared_bytes), or None
    where the kernel does not apply (a size not a multiple of 256, an input longer than INPUT_SLICES x 256,
    or the weights not fitting in shared memory)."""
    if any(size % TILE_COLUMNS.value for size in (hidden, attended, intermediate)):
        return None
    if max(hidden, attended, intermediate) > INPUT_SLICES.value * TILE_COLUMNS.value:
        return None
    out_groups = triton.cdiv(triton.cdiv(hidden, programs), TILE_ROWS.value)
    up_groups = triton.cdiv(triton.cdiv(intermediate, programs), TILE_ROWS.value)
    grid = max(triton.cdiv(hidden, out_groups * TILE_ROWS.value),
               triton.cdiv(intermediate, up_groups * TILE_ROWS.value))
    out_padded, up_padded = padded_groups(out_groups), padded_groups(up_groups)
    tile_bytes = TILE_ROWS.value * TILE_COLUMNS.value * 2
    tiles = (out_padded * (attended + intermediate) + 2 * up_padded * hidden) // TILE_COLUMNS.value
    shared_bytes = tiles * tile_bytes + INPUT_SLICES.value * TILE_COLUMNS.value * 2 + 64
    if shared_bytes > SHARED_MEMORY_LIMIT - 2 * 1024:  # room for the compiler's scratch
        return None
    return dict(grid=grid, out_groups=out_groups, up_groups=up_groups, out_padded=out_padded, up_padded=up_padded,
                copies=(out_groups * (attended + intermediate) + 2 * up_groups * hidden) // TILE_COLUMNS.value,
                shared_bytes=shared_bytes)


def weight_descriptors(out_weight: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor):
    """The TMA descriptors of a layer's three weights (tiles of TILE_ROWS x TILE_COLUMNS, unswizzled): build
    them once per layer and pass them to every call."""
    # the weight as [1, N, K] and its tiles as [1, TILE_ROWS, TILE_COLUMNS], so a tile lands as one entry of the
    # kernel's [tiles, TILE_ROWS, TILE_COLUMNS] buffers, which its warps read in rank 3
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=3)
    return tuple(TensorDescriptor(weight, [1, *weight.shape], [weight.numel(), weight.shape[1], 1],
                                  [1, TILE_ROWS.value, TILE_COLUMNS.value], layout)
                 for weight in (out_weight, gate_up_weight, down_weight))


def new_counters(device, layers: int = 1) -> torch.Tensor:
    """Zeroed barrier counters, COUNTERS per layer ([layers, COUNTERS] int32): a layer's own row at every call
    (the kernel leaves them zeroed; element 3 is the error flag a poll that gave up sets)."""
    return torch.zeros(layers, COUNTERS, device=device, dtype=torch.int32)


def staged_out_projection_mlp(
    x: torch.Tensor,
    out_weight: torch.Tensor,
    hidden: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    eps: float,
    counters: torch.Tensor,
    gate: torch.Tensor | None = None,
    act: torch.Tensor | None = None,
    pdl: bool = False,
    head_norm: tuple[torch.Tensor, torch.Tensor] | None = None,
    descriptors: tuple | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """hidden += out-projection of x, then hidden += MLP(hidden), in place, for one token (out_projection_mlp's
    arguments and results, its roundings; x, hidden, gate, z, act [1, ...]). counters: a row of
    `new_counters` (COUNTERS int32, zero; left zero), used by no other launch in flight. descriptors: from
    `weight_descriptors` (built here when None). programs: SMs to use (default all). Raises ValueError where
    `plan` says the kernel does not apply."""
    check_tensor("x", x, shape=(1, None), dtype=(torch.bfloat16,), contiguous=True)
    attended = x.shape[1]
    check_tensor("out_weight", out_weight, shape=(None, attended), dtype=x.dtype, contiguous=True)
    size = out_weight.shape[0]
    check_tensor("hidden", hidden, shape=(1, size), dtype=x.dtype, contiguous=True)
    check_tensor("norm_weight", norm_weight, shape=(size,), dtype=x.dtype, contiguous=True)
    check_tensor("gate_up_weight", gate_up_weight, shape=(None, size), dtype=x.dtype, contiguous=True)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight has {gate_up_weight.shape[0]} rows, not gate and up rows of one width")
    intermediate = gate_up_weight.shape[0] // 2
    check_tensor("down_weight", down_weight, shape=(size, intermediate), dtype=x.dtype, contiguous=True)
    check_tensor("counters", counters, shape=(COUNTERS,), dtype=(torch.int32,), contiguous=True)
    if gate is not None:
        check_tensor("gate", gate, shape=(1, attended), dtype=x.dtype, contiguous=True)
    if act is None:
        act = torch.empty(1, intermediate, device=x.device, dtype=x.dtype)
    check_tensor("act", act, shape=(1, intermediate), dtype=x.dtype, contiguous=True)
    z, head_norm_weight, head_dim = x, norm_weight, TILE_COLUMNS.value  # stand-ins, unused without head_norm
    if head_norm is not None:
        if gate is not None:
            raise ValueError("head_norm and gate exclude each other: the gate belongs to attention layers")
        z, head_norm_weight = head_norm
        check_tensor("head_norm z", z, shape=(1, attended), dtype=x.dtype, contiguous=True)
        check_tensor("head_norm weight", head_norm_weight, shape=(None,), dtype=x.dtype, contiguous=True)
        head_dim = head_norm_weight.shape[0]
        if head_dim < 32 or head_dim & (head_dim - 1) or attended % head_dim:
            raise ValueError(f"head_norm weight has {head_dim} values: expected a power of two >= 32 dividing "
                             f"x's {attended} columns")
    check_same_device(x=x, out_weight=out_weight, hidden=hidden, norm_weight=norm_weight,
                      gate_up_weight=gate_up_weight, down_weight=down_weight, act=act, counters=counters, z=z,
                      head_norm_weight=head_norm_weight, **({"gate": gate} if gate is not None else {}))
    programs = sm_count(x.device) if programs is None else programs
    launch = plan(size, attended, intermediate, programs)
    if launch is None:
        raise ValueError(f"staged_out_projection_mlp does not apply to hidden {size}, attended {attended}, "
                         f"intermediate {intermediate} on {programs} programs (staged_out_projection_mlp.plan)")
    if descriptors is None:
        descriptors = weight_descriptors(out_weight, gate_up_weight, down_weight)
    _staged_kernel[(launch["grid"],)](
        *descriptors, x, x if gate is None else gate, z, head_norm_weight, hidden, norm_weight, act, counters, eps,
        HIDDEN=size, ATTENDED=attended, INTERMEDIATE=intermediate,
        OUT_GROUPS=launch["out_groups"], UP_GROUPS=launch["up_groups"],
        OUT_PADDED=launch["out_padded"], UP_PADDED=launch["up_padded"],
        HAS_GATE=gate is not None, HEAD_NORM=head_norm is not None, HEAD_DIM=head_dim, ROUND_PRODUCT=True,
        USE_PDL=pdl, WARPS=WARPS.value, num_warps=WARPS.value,
        **launch_options(pdl),
    )
    return hidden
