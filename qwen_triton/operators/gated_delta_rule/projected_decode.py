"""A Gated DeltaNet layer's decode step from its input row: the in-projection and the step in one kernel.

One sequence (B = 1, the single-stream decode), the one in state slot slots[0] (slot 0 without slots). It
computes what this chain computes, with the same roundings:
    projection = linear(hidden, W, norm_weight=input_norm)            the GEMV (linear/gemv.py), N = C + Hv Dv + 2 Hv
    o = gated_delta_rule_decode_fused(projection's q|k|v, z, a, b, ..., normalize=False)     (fused_decode.py)
but without the kernel boundary between them, where the step waited for the whole projection grid to drain
(a PDL wait: ~2.5 us lost per boundary; docs/decisions.md).

Programs: one per tile of 16 weight rows, the GEMV's in-graph tile for K <= 1024 (tuning/h200.py), each
summed exactly as that GEMV sums it (`row_rstd`, `accumulate_row`, the same shapes and warps), so a row's
projection is the GEMV's bit for bit. The tiles run in this order of program ids:
  - q and k tiles (2 Hk Dk / 16): the conv step of their 16 channels (each channel's conv state belongs to
    one program), its output rounded to the activation dtype into `qk` (a scratch row), then an arrival
    (release) on their key head's counter;
  - b and a tiles: stored into the projection row; each arrives on every key head's counter;
  - v tiles (Hv Dv / 16), each the step of one value head's 16 value columns, the fused step's blocking
    (BLOCK_V = 16): it loads its [Dk, 16] float32 state slab and its conv operands before the PDL wait,
    computes its 16 v rows and their conv step itself, waits (an acquire spin) until its key head's q and k
    tiles and every b / a tile have arrived, reads q, k (from L2) and its a, b, and updates the slab
    (recurrent.py's `delta_rule_update`), writing its 16 values of o, un-normed (out_projection_mlp's
    head_norm applies the gated RMSNorm);
  - z tiles last: stored into the projection row for out_projection_mlp's head_norm; nothing here waits
    for them, so they stream while the steps run.
The last of a key head's step programs to pass the wait resets the head's counters, so a CUDA graph can
replay the launch. A step program waits only for programs of lower ids: the GPU dispatches a grid in id
order (and the interpreter runs it in that order), so every program a step waits for is running or done,
and the waits cannot deadlock. At the real shape the grid (514 programs) is one wave: four programs an SM
(MAX_REGISTERS) on 132 SMs. The counters are shared by every launch on a device: launches must be ordered
on one stream (each PDL launch waits for the previous kernel before its first arrival).

Floor at the real shapes (K 1024, N 8224, Hk = Hv = 16, Dk = Dv = 128, bf16): the 16.8 MB weight, the 2 MiB
state read and written, the conv state and weights (~120 KB): ~19 MB, 4.5 us at the 4.2 TB/s the H200 copies
at; ~19 MFLOP. Measured on the H200 (docs/decisions.md, D24): its share of the decode step 9.30 us
a layer, against 6.01 + 4.94 for the GEMV and the fused step; the whole step 12-21 us faster at context 128
(benchmarks/engine_options.py). The layer's out-projection folded in the same way (tiles waiting for every
step) is at most 8 us a step faster and is not kept: that wait is grid-wide (docs/decisions.md, D12).
CUDA-graph capturable: no host reads, every output buffer passed in, states updated in place, no tuning.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import (
    allow_next_kernel,
    check_same_device,
    check_slots,
    check_tensor,
    launch_options,
    preferred_entry,
    sequence_slot,
    wait_for_previous_kernel,
)
from ..conv.causal_conv1d import (
    MAX_WIDTH,
    conv_state_shifted,
    conv_step_operands,
    conv_step_output,
    store_conv_state,
)
from ..linear.fusion import accumulate_row, load_weight_tile, row_rstd
from ...tuning import H200
from .gating import ACTIVATION_DTYPES
from .recurrent import delta_rule_update, state_slab

# The GEMV's in-graph tile on the H200 for K <= 1024 (tuning/h200.py, the engine's in-projection: 16 rows x 256
# columns per step) and that config's 4 warps and 3 stages. The same shapes and warps give the same sums.
_, ROWS, TILE_K = preferred_entry(H200.gemv_by_k, 1024, ("SPLIT_K", "BLOCK_N", "BLOCK_K")).values()
WARPS = 4
STAGES = 3
# four programs an SM (4 x 4 warps x 128 registers fill its 64K registers): the 514 programs of the real shape,
# 132 x 4 = 528 slots, run as one wave (unbounded, ptxas takes 136 registers: three an SM, 396 slots). No spills
# at 128 (tests/operators/test_projected_decode.py compiles it).
MAX_REGISTERS = 128


@triton.jit
def _projected_step_kernel(
    hidden_ptr, input_norm_ptr, weight_ptr, conv_weight_ptr, conv_state_ptr, a_log_ptr, dt_bias_ptr, state_ptr,
    projection_ptr, qk_ptr, o_ptr, arrival_ptr, departure_ptr, slots_ptr,
    K, eps, scale, stride_wn, stride_wc, stride_cb, stride_cc,
    K_HEADS: tl.constexpr, V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr,
    V_DIM: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_DK: tl.constexpr,
    BLOCK_HK: tl.constexpr, ROWS: tl.constexpr, TILE_K: tl.constexpr, HAS_SLOTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    pid = tl.program_id(0)
    # the sequence's slot (no kernel of the step writes it: read before the wait) and its states
    slot = sequence_slot(slots_ptr, 0, HAS_SLOTS).to(tl.int64)
    conv_state_ptr += slot * stride_cb
    state_ptr += slot * (V_HEADS * K_DIM * V_DIM)
    KEY_ROWS: tl.constexpr = 2 * K_HEADS * K_DIM          # q | k
    CHANNELS: tl.constexpr = KEY_ROWS + V_HEADS * V_DIM   # q | k | v: the conv's channels
    GATE_ROWS: tl.constexpr = CHANNELS + V_HEADS * V_DIM  # where b | a start (after z)
    N: tl.constexpr = GATE_ROWS + 2 * V_HEADS              # the weight's rows
    QK_TILES: tl.constexpr = KEY_ROWS // ROWS
    GATE_TILES: tl.constexpr = (2 * V_HEADS + ROWS - 1) // ROWS
    V_TILES: tl.constexpr = V_HEADS * V_DIM // ROWS
    # the order of the tiles: q | k, b | a, then v (the step programs, after every tile they wait for), z last
    steps = QK_TILES + GATE_TILES
    is_step = (pid >= steps) & (pid < steps + V_TILES)
    first_row = tl.where(pid < QK_TILES, pid * ROWS,
                         tl.where(pid < steps, GATE_ROWS + (pid - QK_TILES) * ROWS,
                                  tl.where(is_step, KEY_ROWS + (pid - steps) * ROWS,
                                           CHANNELS + (pid - steps - V_TILES) * ROWS)))
    rows = first_row + tl.arange(0, ROWS)
    row_mask = rows < N
    w_rows = rows.to(tl.int64) * stride_wn
    # a step program's value head, its 16 columns and its key head; a q or k program's key head
    head = (first_row - KEY_ROWS) // V_DIM
    values = (first_row - KEY_ROWS) % V_DIM + tl.arange(0, ROWS)
    key_head = tl.where(is_step, head // GROUP, (first_row % (K_HEADS * K_DIM)) // K_DIM)
    keys = tl.arange(0, BLOCK_DK)
    key_mask = keys < K_DIM

    # before the wait, what no kernel since the last launch without PDL writes: the first weight tile, the
    # conv state and weights of this program's channels, a step program's state slab
    w, _ = load_weight_tile(weight_ptr, w_rows, 0, row_mask, tl.arange(0, TILE_K), K, False)
    conv_mask = row_mask & (rows < CHANNELS)
    window, conv_weight = conv_step_operands(conv_weight_ptr, conv_state_ptr, rows, conv_mask, stride_wc,
                                             stride_cc, WIDTH, BLOCK_W)
    shifted = conv_state_shifted(conv_state_ptr, rows, conv_mask, stride_cc, WIDTH, BLOCK_W)
    slab, slab_mask = state_slab(state_ptr + head * (K_DIM * V_DIM), keys, values, K_DIM, V_DIM)
    slab_mask = slab_mask & is_step
    old = tl.load(slab, mask=slab_mask, other=0.0)
    wait_for_previous_kernel(USE_PDL)

    # the GEMV's row: input RMSNorm in the prologue, 16 weight rows against it
    offs_m = tl.arange(0, 1)
    rstd = row_rstd(hidden_ptr, 0, offs_m, 1, K, eps, 1, TILE_K, "")
    acc, _ = accumulate_row(hidden_ptr, 0, weight_ptr, w_rows, 0, row_mask, hidden_ptr, 0, input_norm_ptr, rstd,
                            offs_m, K, 0, K, w, w, False, False, True, ROWS, TILE_K, "")
    dtype = projection_ptr.dtype.element_ty
    projected = tl.sum(acc, axis=0).to(dtype)  # [ROWS], rounded as the GEMV stores it
    mixed = conv_step_output(projected, window, conv_weight, WIDTH, BLOCK_W).to(dtype)
    if pid < QK_TILES:
        tl.store(qk_ptr + rows, mixed)
        # every thread's reads of the old conv state precede its overwrite; every store precedes the release
        tl.debug_barrier()
        store_conv_state(projected, shifted, conv_state_ptr, rows, conv_mask, stride_cc, WIDTH, BLOCK_W)
        tl.debug_barrier()
        tl.atomic_add(arrival_ptr + key_head, 1, sem="release", scope="gpu")
    elif pid < steps:  # a b | a tile: every key head's step waits for it
        tl.store(projection_ptr + rows, projected, mask=row_mask)
        tl.debug_barrier()
        every = tl.arange(0, BLOCK_HK)
        tl.atomic_add(arrival_ptr + every, tl.full([BLOCK_HK], 1, tl.int32), mask=every < K_HEADS, sem="release",
                      scope="gpu")
    elif pid >= steps + V_TILES:  # z: read by the next kernel
        tl.store(projection_ptr + rows, projected, mask=row_mask)
    else:
        tl.debug_barrier()
        store_conv_state(projected, shifted, conv_state_ptr, rows, conv_mask, stride_cc, WIDTH, BLOCK_W)
        # wait for the key head's q and k tiles and every b / a tile
        expected = 2 * (K_DIM // ROWS) + GATE_TILES
        arrived = tl.atomic_add(arrival_ptr + key_head, 0, sem="acquire", scope="gpu")
        while arrived < expected:
            arrived = tl.atomic_add(arrival_ptr + key_head, 0, sem="acquire", scope="gpu")
        # .cg: the other programs' stores from L2, never a stale L1 line
        q = tl.load(qk_ptr + key_head * K_DIM + keys, mask=key_mask, other=0.0, cache_modifier=".cg")
        k = tl.load(qk_ptr + K_HEADS * K_DIM + key_head * K_DIM + keys, mask=key_mask, other=0.0,
                    cache_modifier=".cg")
        b = tl.load(projection_ptr + GATE_ROWS + head, cache_modifier=".cg")
        a = tl.load(projection_ptr + GATE_ROWS + V_HEADS + head, cache_modifier=".cg")
        out = delta_rule_update(q.to(tl.float32), k.to(tl.float32), mixed.to(tl.float32), a, b, a_log_ptr + head,
                                dt_bias_ptr + head, old, slab, slab_mask, scale)
        tl.store(o_ptr + head * V_DIM + values, out.to(dtype))
        # the key head's last step program past the wait resets its counters for the next launch
        departed = tl.atomic_add(departure_ptr + key_head, 1, sem="relaxed", scope="gpu")
        if departed == GROUP * (V_DIM // ROWS) - 1:
            tl.atomic_xchg(arrival_ptr + key_head, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(departure_ptr + key_head, 0, sem="relaxed", scope="gpu")


_counters: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _head_counters(device: torch.device, key_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed int32 arrival and departure counters, one each per key head; each launch leaves them zero."""
    key = (device, key_heads)
    if key not in _counters:
        _counters[key] = (torch.zeros(key_heads, dtype=torch.int32, device=device),
                          torch.zeros(key_heads, dtype=torch.int32, device=device))
    return _counters[key]


def gated_delta_rule_decode_projected(
    hidden: torch.Tensor,
    input_norm: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    projection: torch.Tensor,
    qk: torch.Tensor,
    delta_out: torch.Tensor,
    pdl: bool = False,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's Gated DeltaNet decode step from the layer's input row: o [1, Hv, Dv] (delta_out), un-normed.

    hidden [1, K] (the residual stream) and input_norm [K] (the layer's zero-centred RMSNorm weight, eps);
    weight [N, K], the fused in-projection q | k | v | z | b | a (N = 2 Hk Dk + 2 Hv Dv + 2 Hv); conv_weight
    [C, W] (C = 2 Hk Dk + Hv Dv); conv_state [S, C, W-1] and state [S, Hv, Dk, Dv] float32 of S slots, both
    updated in place at slot slots[0] (slots int32 [1] on the device, a live slot below S; None: slot 0); A_log,
    dt_bias [Hv] float32. Buffers written: projection [1, N] (its z, b and a columns; the q | k | v columns are not
    written), qk [1, 2 Hk Dk] (the conv's q | k output), delta_out [1, Hv, Dv].
    Dk and Dv must be multiples of 16 (a tile of 16 rows never spans two heads).
    pdl: launch with programmatic dependent launch (Hopper; operators/common.py); the states are then read
    before the wait, as in gated_delta_rule_decode_fused.
    """
    check_tensor("state", state, shape=(None, None, None, None), dtype=torch.float32, contiguous=True)
    slot_count, value_heads, key_dim, value_dim = state.shape
    if key_dim % ROWS or value_dim % ROWS:
        raise ValueError(f"state has head dims {key_dim} and {value_dim}; both must be multiples of {ROWS}")
    check_tensor("hidden", hidden, shape=(1, None), dtype=ACTIVATION_DTYPES, contiguous=True)
    K = hidden.shape[1]
    check_tensor("input_norm", input_norm, shape=(K,), dtype=hidden.dtype, contiguous=True)
    check_tensor("weight", weight, shape=(None, K), dtype=hidden.dtype)
    N = weight.shape[0]
    key_rows = N - 2 * value_heads * value_dim - 2 * value_heads
    if key_rows <= 0 or key_rows % (2 * key_dim):
        raise ValueError(f"weight has {N} rows, not 2 Hk x {key_dim} + 2 x {value_heads} x {value_dim} + "
                         f"2 x {value_heads}")
    key_heads = key_rows // (2 * key_dim)
    if value_heads % key_heads:
        raise ValueError(f"state has {value_heads} heads, not a multiple of the weight's {key_heads} key heads")
    channels = key_rows + value_heads * value_dim
    check_tensor("conv_weight", conv_weight, shape=(channels, None), dtype=hidden.dtype)
    width = conv_weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"conv_weight has width {width}, expected 2 to {MAX_WIDTH}")
    check_tensor("conv_state", conv_state, shape=(slot_count, channels, width - 1), dtype=hidden.dtype)
    slots, has_slots = check_slots(slots, 1, state)
    for name, tensor in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_tensor(name, tensor, shape=(value_heads,), dtype=torch.float32, contiguous=True)
    check_tensor("projection", projection, shape=(1, N), dtype=hidden.dtype, contiguous=True)
    check_tensor("qk", qk, shape=(1, key_rows), dtype=hidden.dtype, contiguous=True)
    check_tensor("delta_out", delta_out, shape=(1, value_heads, value_dim), dtype=hidden.dtype, contiguous=True)
    check_same_device(hidden=hidden, input_norm=input_norm, weight=weight, conv_weight=conv_weight,
                      conv_state=conv_state, A_log=A_log, dt_bias=dt_bias, state=state, projection=projection,
                      qk=qk, delta_out=delta_out, slots=slots)

    arrivals, departures = _head_counters(hidden.device, key_heads)
    _projected_step_kernel[(triton.cdiv(N, ROWS),)](
        hidden, input_norm, weight, conv_weight, conv_state, A_log, dt_bias, state,
        projection, qk, delta_out, arrivals, departures, slots,
        K, eps, key_dim**-0.5, weight.stride(0), conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        K_HEADS=key_heads, V_HEADS=value_heads, GROUP=value_heads // key_heads, K_DIM=key_dim, V_DIM=value_dim,
        WIDTH=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_DK=triton.next_power_of_2(key_dim),
        BLOCK_HK=triton.next_power_of_2(key_heads), ROWS=ROWS, TILE_K=TILE_K, HAS_SLOTS=has_slots, USE_PDL=pdl,
        num_warps=WARPS, num_stages=STAGES, maxnreg=MAX_REGISTERS, **launch_options(pdl),
    )
    return delta_out


def gated_delta_rule_decode_projected_cost(hidden_size, key_heads, value_heads, key_dim, value_dim, width=4,
                                           element_size=2):
    """(bytes, FLOPs) of the floor: the weight, the recurrent state in and out, the conv state in and out and its
    weight, the row in and the outputs (z, b, a, q | k, o)."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    rows = channels + value_heads * value_dim + 2 * value_heads
    data = element_size * rows * hidden_size + 2 * 4 * value_heads * key_dim * value_dim
    data += element_size * (2 * channels * (width - 1) + channels * width + hidden_size
                            + rows - channels + 2 * key_heads * key_dim + value_heads * value_dim)
    flops = 2 * rows * hidden_size + 7 * value_heads * key_dim * value_dim + channels * (2 * width + 4)
    return data, flops
