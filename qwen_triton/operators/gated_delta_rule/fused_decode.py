"""A whole Gated DeltaNet decode step, from the fused projection row to out_proj's input, in one kernel.

It computes exactly what this chain of launchers computes, with the same roundings:
    mixed = causal_conv1d_step(x, conv_weight, conv_state)          x: the q | k | v columns [B, C]
    o = gated_delta_rule_recurrent(q, k, v, a, b, A_log, dt_bias, state)   (q, k, v split from mixed)
    y = gated_rms_norm(o, z, norm_weight, eps)
but launches one kernel instead of three and never writes `mixed`. Row b's conv and recurrent states are
those of slot slots[b] (operators/common.py: without slots row b is slot b; a padding row, slot negative,
reads and writes no state). With normalize=False it stops at o (the engine's decode step:
out_projection_mlp's first launch norms the row in its prologue, `head_norm`, 5 us a step faster on the
H200; docs/decisions.md, D14).

`_fused_step_kernel`, grid (B x Hv, Dv / BLOCK_V), the recurrent kernel's blocking: a program runs the conv
step of the channels it needs (its key head's q and k, recomputed by each of the head's programs from cached
bytes, and its BLOCK_V channels of v), rounds them to the activation dtype as the unfused chain stores them,
then gates, normalises and updates its [Dk, BLOCK_V] state slab (recurrent.py), writing its slice of o. Before
its PDL wait it loads everything that no kernel of the step writes: its row's slot, the state slab (the
largest read), the conv state (as the conv's window and, shifted by one place, as the next state's first
places) and the conv weights; after it, x, z, a and b, so the state updates at the end are stores only. It
shifts the conv state of its v channels, which no other program reads. Two things need a whole key head: the
gated RMSNorm (over each value head's Dv outputs) and the shift of the q and k channels' conv state (read by
every program of the key head). So each program then arrives at an int32 counter of its (row, key head); the
last of the head's programs to arrive (its count is acquired after every other program's stores and reads were
released) applies the gated RMSNorm to the key head's value heads, shifts their q and k conv state and resets
the counter, so a CUDA graph can replay the launch. Whichever program is last, it computes the same values:
the results are deterministic. (One program per whole head, which needs no counter, is slower on the H200: 6.5
against 4.5 us a step back to back, 16 programs for 2 MiB of state; docs/decisions.md, D28.)

Floor at the real shapes (Hk = Hv = 16, Dk = Dv = 128, C = 6144, W = 4, bf16), per sequence: the 1 MiB
float32 state read and written (2 MiB), x, z and y (~16 KiB), the conv state read and written (72 KiB)
and the conv weight (48 KiB): ~2.2 MB, ~2 MFLOP; one launch latency at B = 1.
CUDA-graph capturable: no host reads, `out=` and `delta_out=` (o's buffer) accepted, states updated in
place, no allocation once autotuned (autotuning restores the states it benchmarks on; run it before
capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import (
    allow_next_kernel,
    autotune_configs,
    check_same_device,
    check_slots,
    check_tensor,
    launch_options,
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
from .gated_rms_norm import gated_rms_norm_heads
from .gating import ACTIVATION_DTYPES, check_gate_parameters
from .recurrent import delta_rule_update, state_slab


# BLOCK_V 16 with 2 warps (256 programs at B = 1) was the fastest back to back in a CUDA graph on the
# H200 (benchmarks/decode_sweep.py --parts step, 2026-11-29: 4.52 us; BLOCK_V 32: 4.84, 128: 6.53)
STEP_CONFIGS = [
    triton.Config({"BLOCK_V": 16}, num_warps=2),
    triton.Config({"BLOCK_V": 16}, num_warps=4),
    triton.Config({"BLOCK_V": 8}, num_warps=2),
    triton.Config({"BLOCK_V": 32}, num_warps=4),
]


@triton.autotune(configs=autotune_configs(STEP_CONFIGS),
                 key=["tuning_batch", "K_HEADS", "V_HEADS", "K_DIM", "V_DIM", "WIDTH"],
                 restore_value=["conv_state_ptr", "state_ptr"], cache_results=True)
@triton.jit
def _fused_step_kernel(
    x_ptr, conv_weight_ptr, conv_state_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, o_ptr,
    z_ptr, norm_weight_ptr, out_ptr, counter_ptr, slots_ptr,
    batch, tuning_batch, scale, eps,
    stride_xb, stride_wc, stride_cb, stride_cc, stride_ab, stride_bb, stride_ob, stride_oh, stride_zb, stride_yb,
    K_HEADS: tl.constexpr, V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr,
    V_DIM: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_SLOTS: tl.constexpr, USE_PDL: tl.constexpr, NORM: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    sequence_head = tl.program_id(0)
    sequence = sequence_head // V_HEADS  # the row
    head = sequence_head % V_HEADS
    key_head = head // GROUP
    slot = sequence_slot(slots_ptr, sequence, HAS_SLOTS)
    live = slot >= 0  # a padding row: every state access masked off
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask = (keys < K_DIM) & live
    value_mask = (values < V_DIM) & live
    conv_row = conv_state_ptr + slot.to(tl.int64) * stride_cb
    q_channels = key_head * K_DIM + keys
    k_channels = K_HEADS * K_DIM + q_channels
    v_channels = 2 * K_HEADS * K_DIM + head * V_DIM + values
    # Before the wait, everything no kernel since the last launch without PDL writes (see
    # gated_delta_rule_decode_fused's pdl): the state slab, the largest read, the conv state and weights
    slab, slab_mask = state_slab(state_ptr + (slot.to(tl.int64) * V_HEADS + head) * (K_DIM * V_DIM), keys, values,
                                 K_DIM, V_DIM)
    slab_mask = slab_mask & live
    old = tl.load(slab, mask=slab_mask, other=0.0)
    q_window, q_weight = conv_step_operands(conv_weight_ptr, conv_row, q_channels, key_mask, stride_wc, stride_cc,
                                            WIDTH, BLOCK_W)
    k_window, k_weight = conv_step_operands(conv_weight_ptr, conv_row, k_channels, key_mask, stride_wc, stride_cc,
                                            WIDTH, BLOCK_W)
    v_window, v_weight = conv_step_operands(conv_weight_ptr, conv_row, v_channels, value_mask, stride_wc,
                                            stride_cc, WIDTH, BLOCK_W)
    v_shifted = conv_state_shifted(conv_row, v_channels, value_mask, stride_cc, WIDTH, BLOCK_W)
    q_shifted = conv_state_shifted(conv_row, q_channels, key_mask, stride_cc, WIDTH, BLOCK_W)
    k_shifted = conv_state_shifted(conv_row, k_channels, key_mask, stride_cc, WIDTH, BLOCK_W)
    wait_for_previous_kernel(USE_PDL)
    dtype = o_ptr.dtype.element_ty
    x_row = x_ptr + sequence * stride_xb
    x_q = tl.load(x_row + q_channels, mask=key_mask, other=0.0)
    x_k = tl.load(x_row + k_channels, mask=key_mask, other=0.0)
    x_v = tl.load(x_row + v_channels, mask=value_mask, other=0.0)
    a = tl.load(a_ptr + sequence * stride_ab + head)
    b = tl.load(b_ptr + sequence * stride_bb + head)
    q = conv_step_output(x_q, q_window, q_weight, WIDTH, BLOCK_W)
    k = conv_step_output(x_k, k_window, k_weight, WIDTH, BLOCK_W)
    v = conv_step_output(x_v, v_window, v_weight, WIDTH, BLOCK_W)
    out = delta_rule_update(
        q.to(dtype).to(tl.float32), k.to(dtype).to(tl.float32), v.to(dtype).to(tl.float32), a, b,
        a_log_ptr + head, dt_bias_ptr + head, old, slab, slab_mask, scale,
    )
    tl.store(o_ptr + sequence * stride_ob + head * stride_oh + values, out.to(dtype), mask=value_mask)
    # every thread's o stores and conv state reads precede the v state's overwrite and the release of the
    # arrival count
    tl.debug_barrier()
    store_conv_state(x_v, v_shifted, conv_row, v_channels, value_mask, stride_cc, WIDTH, BLOCK_W)
    counter = counter_ptr + sequence * K_HEADS + key_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == GROUP * tl.num_programs(1) - 1:  # the key head's last program
        if NORM:
            member = tl.arange(0, BLOCK_G)
            heads = tl.where(member < GROUP, key_head * GROUP + member, V_HEADS)  # V_HEADS: masked off
            gated_rms_norm_heads(o_ptr + sequence * stride_ob, stride_oh, z_ptr + sequence * stride_zb,
                                 norm_weight_ptr, out_ptr + sequence * stride_yb, heads, eps,
                                 V_HEADS, V_DIM, ROUND_PRODUCT, BLOCK_D, True)
        store_conv_state(x_q, q_shifted, conv_row, q_channels, key_mask, stride_cc, WIDTH, BLOCK_W)
        store_conv_state(x_k, k_shifted, conv_row, k_channels, key_mask, stride_cc, WIDTH, BLOCK_W)
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


_counters: dict[tuple, torch.Tensor] = {}


def _arrival_counters(device: torch.device, batch: int, key_heads: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, key head); each launch leaves them zero."""
    key = (device, batch, key_heads)
    if key not in _counters:
        _counters[key] = torch.zeros(batch * key_heads, dtype=torch.int32, device=device)
    return _counters[key]


def gated_delta_rule_decode_fused(
    x: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    state: torch.Tensor,
    out: torch.Tensor | None = None,
    delta_out: torch.Tensor | None = None,
    pdl: bool = False,
    normalize: bool = True,
    slots: torch.Tensor | None = None,
    tuning_batch: int | None = None,
) -> torch.Tensor:
    """One decode step of a Gated DeltaNet layer for B sequences: y [B, Hv*Dv], out_proj's input.

    x [B, C] the pre-conv q | k | v columns (C = 2 Hk Dk + Hv Dv); z [B, Hv*Dv]; a, b [B, Hv] (all strided
    row views of the fused projection); conv_weight [C, W]; conv_state [S, C, W-1] and state
    [S, Hv, Dk, Dv] float32 of S >= B slots, both updated in place at row b's slot slots[b] (int32 [B] on the
    device, distinct; None: row b is slot b; negative: a padding row, no state touched); norm_weight [Dv].
    delta_out [B, Hv, Dv]: o's buffer.
    pdl: launch with programmatic dependent launch (Hopper; operators/common.py). The kernel then reads
    `state` before waiting for the previous kernel, so no kernel launched since the last
    launch without PDL may write `state` (the engine's decode step starts with the embedding, launched
    without PDL, and writes each layer's state once).
    normalize=False: no gated RMSNorm; returns o (delta_out) for a consumer that norms it itself
    (out_projection_mlp's head_norm), `out` untouched.
    tuning_batch: the batch the autotuner keys this launch's config on (None: B). Its configs reduce over the key
    dimension in different orders, so a caller whose rows must not depend on the batch passes one value for every
    B: one config, the same bits (the engine's batch_invariant).
    """
    check_tensor("state", state, shape=(None, None, None, None), dtype=torch.float32, contiguous=True)
    slot_count, value_heads, key_dim, value_dim = state.shape
    check_tensor("x", x, shape=(None, None), dtype=ACTIVATION_DTYPES)
    batch, channels = x.shape
    if batch > slot_count:
        raise ValueError(f"x has {batch} rows, more than state's {slot_count} slots")
    slots, has_slots = check_slots(slots, batch, state)
    key_channels = channels - value_heads * value_dim
    if key_channels <= 0 or key_channels % (2 * key_dim):
        raise ValueError(f"x has {channels} channels, not 2 Hk x {key_dim} + {value_heads} x {value_dim}")
    key_heads = key_channels // (2 * key_dim)
    if value_heads % key_heads:
        raise ValueError(f"state has {value_heads} heads, not a multiple of the {key_heads} key heads in x")
    check_tensor("z", z, shape=(batch, value_heads * value_dim), dtype=x.dtype)
    check_gate_parameters(a, b, A_log, dt_bias, rows=batch, heads=value_heads)
    check_tensor("conv_weight", conv_weight, shape=(channels, None), dtype=ACTIVATION_DTYPES)
    width = conv_weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"conv_weight has width {width}, expected 2 to {MAX_WIDTH}")
    check_tensor("conv_state", conv_state, shape=(slot_count, channels, width - 1), dtype=ACTIVATION_DTYPES)
    check_tensor("norm_weight", norm_weight, shape=(value_dim,), dtype=ACTIVATION_DTYPES, contiguous=True)
    if delta_out is None:
        delta_out = torch.empty(batch, value_heads, value_dim, device=x.device, dtype=x.dtype)
    check_tensor("delta_out", delta_out, shape=(batch, value_heads, value_dim), dtype=x.dtype)
    if out is None:
        out = torch.empty(batch, value_heads * value_dim, device=x.device, dtype=x.dtype)
    check_tensor("out", out, shape=(batch, value_heads * value_dim), dtype=x.dtype)
    check_same_device(x=x, z=z, a=a, b=b, conv_weight=conv_weight, conv_state=conv_state, A_log=A_log,
                      dt_bias=dt_bias, norm_weight=norm_weight, state=state, delta_out=delta_out, out=out,
                      slots=slots)
    if batch == 0:
        return out if normalize else delta_out

    block_w = triton.next_power_of_2(width)
    group = value_heads // key_heads
    grid = lambda meta: (batch * value_heads, triton.cdiv(value_dim, meta["BLOCK_V"]))  # noqa: E731
    _fused_step_kernel[grid](
        x, conv_weight, conv_state, a, b, A_log, dt_bias, state, delta_out,
        z, norm_weight, out, _arrival_counters(x.device, batch, key_heads), slots,
        batch, batch if tuning_batch is None else tuning_batch, key_dim**-0.5, eps,
        x.stride(0), conv_weight.stride(0), conv_state.stride(0), conv_state.stride(1), a.stride(0), b.stride(0),
        delta_out.stride(0), delta_out.stride(1), z.stride(0), out.stride(0),
        K_HEADS=key_heads, V_HEADS=value_heads, GROUP=group, K_DIM=key_dim, V_DIM=value_dim,
        WIDTH=width, BLOCK_W=block_w, BLOCK_K=triton.next_power_of_2(key_dim),
        ROUND_PRODUCT=norm_weight.dtype == x.dtype and x.dtype != torch.float32,
        BLOCK_D=triton.next_power_of_2(value_dim), BLOCK_G=triton.next_power_of_2(group),
        HAS_SLOTS=has_slots, USE_PDL=pdl, NORM=normalize, **launch_options(pdl),
    )
    return out if normalize else delta_out


def gated_delta_rule_decode_fused_cost(batch, key_heads, value_heads, key_dim, value_dim, width=4,
                                       element_size=2):
    """(bytes, FLOPs) of the floor: the state in and out, x, z, y, the conv state in and out, the weight."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    data = 2 * 4 * batch * value_heads * key_dim * value_dim
    data += element_size * (batch * (channels + 2 * value_heads * value_dim + 2 * value_heads)
                            + 2 * batch * channels * (width - 1) + channels * width)
    flops = 7 * batch * value_heads * key_dim * value_dim + batch * channels * (2 * width + 4)
    return data, flops + 10 * batch * value_heads * value_dim
