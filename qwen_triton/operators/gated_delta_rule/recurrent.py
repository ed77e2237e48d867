"""One decode step of the gated delta rule for B sequences, gates and L2 norms fused in.

For every row b, the sequence in state slot s = slots[b], and value head h (reading key head h // (Hv / Hk)):
    g, beta = gating(a, b)                                   (gating.py; float32)
    q = l2norm(q) / sqrt(Dk),  k = l2norm(k)                 (x * rsqrt(sum x^2 + 1e-6), float32)
    S = exp(g) S                                             S: [Dk, Dv] float32 state of slot s, head h
    S = S + k (beta (v - S^T k))^T                           the delta rule's rank-one correction
    o = S^T q                                                [Dv]
Shapes: q, k [B, Hk, Dk]; v [B, Hv, Dv]; a, b [B, Hv] (all strided row views of the conv output and
the fused projection, unit last stride); state [S, Hv, Dk, Dv] float32 of S >= B slots, updated in place
(slots int32 [B], distinct; without them row b is slot b; a negative slot is a padding row, which reads and
writes no state and leaves its o unwritten: operators/common.py); o [B, Hv, Dv] in v's dtype. All arithmetic
is float32.

Blocking: a program owns the [Dk, BLOCK_V] slab of one (sequence, head) state: it reads it once, applies
the decay, the correction and the output product in registers and writes it back once. The slab's
prediction S^T k needs the whole Dk column, so the split is over Dv only; with BLOCK_V = 16 the real
shapes give B x 16 x 8 programs, each streaming 8 KiB in and out. The q and k rows (256 B each) are
re-read and re-normalised by the Dv / BLOCK_V programs of a head: cached, and cheaper than a second
launch.

Floor at the real shapes (Hv 16, Dk = Dv = 128), per sequence: the state, read and written once,
2 x 1 MiB; the rest (q, k, v, a, b in, o out) is ~12 KiB. ~8 FLOPs per state element (~2 MFLOP):
memory-bound, ~0.45 us per layer at 4.8 TB/s for B = 1.

CUDA-graph capturable: no host reads of device data, `out=` accepted, the state updated in place, no
allocation once autotuned (autotuning restores the state it benchmarks on; run it before capture).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_slots, check_tensor, sequence_slot
from .gating import ACTIVATION_DTYPES, check_gate_parameters, gate_and_beta


@triton.jit
def delta_rule_step(q, k, v, a, b, a_log_ptr, dt_bias_ptr, state, keys, values, live, scale,
                    K_DIM: tl.constexpr, V_DIM: tl.constexpr):
    """One head's step on the [Dk, BLOCK_V] slab (columns `values`) of its state [Dk, Dv] at `state`.

    q, k [BLOCK_K] and v [BLOCK_V] raw, in float32 (masked lanes zero); a, b the raw gate inputs (b in
    the activation dtype, which beta is rounded to); live: False leaves the slab unread and unwritten (a
    padding row). Updates the slab in place and returns o [BLOCK_V].
    """
    slab, slab_mask = state_slab(state, keys, values, K_DIM, V_DIM)
    slab_mask = slab_mask & live
    old = tl.load(slab, mask=slab_mask, other=0.0)
    return delta_rule_update(q, k, v, a, b, a_log_ptr, dt_bias_ptr, old, slab, slab_mask, scale)


@triton.jit
def state_slab(state, keys, values, K_DIM: tl.constexpr, V_DIM: tl.constexpr):
    """Pointers to and mask of the [Dk, BLOCK_V] slab (columns `values`) of a head's state [Dk, Dv]."""
    return state + keys[:, None] * V_DIM + values[None, :], (keys[:, None] < K_DIM) & (values[None, :] < V_DIM)


@triton.jit
def delta_rule_update(q, k, v, a, b, a_log_ptr, dt_bias_ptr, old, slab, slab_mask, scale):
    """delta_rule_step on the slab's values `old`, already loaded (so a caller can load them early)."""
    g, beta = gate_and_beta(a, b, tl.load(a_log_ptr), tl.load(dt_bias_ptr), b.dtype)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    state = old * tl.exp(g)
    predicted = tl.sum(state * k[:, None], axis=0)
    delta = (v - predicted) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(slab, state, mask=slab_mask)
    return tl.sum(state * q[:, None], axis=0)


def _configs():
    return autotune_configs([
        triton.Config({"BLOCK_V": 16}, num_warps=4),
        triton.Config({"BLOCK_V": 8}, num_warps=2),
        triton.Config({"BLOCK_V": 8}, num_warps=4),
        triton.Config({"BLOCK_V": 16}, num_warps=2),
        triton.Config({"BLOCK_V": 16}, num_warps=8),
        triton.Config({"BLOCK_V": 32}, num_warps=4),
        triton.Config({"BLOCK_V": 32}, num_warps=8),
        triton.Config({"BLOCK_V": 64}, num_warps=8),
    ])


@triton.autotune(configs=_configs(), key=["batch", "V_HEADS", "K_DIM", "V_DIM"], restore_value=["state_ptr"], cache_results=True)
@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, slots_ptr,
    batch, scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ab, stride_bb,
    stride_ob, stride_oh,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, HAS_SLOTS: tl.constexpr,
):
    sequence_head = tl.program_id(0)
    sequence = sequence_head // V_HEADS  # the row
    head = sequence_head % V_HEADS
    key_head = head // GROUP
    slot = sequence_slot(slots_ptr, sequence, HAS_SLOTS)
    live = slot >= 0  # a padding row: no state read or written
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    key_mask = keys < K_DIM
    value_mask = (values < V_DIM) & live

    q = tl.load(q_ptr + sequence * stride_qb + key_head * stride_qh + keys, mask=key_mask, other=0.0)
    k = tl.load(k_ptr + sequence * stride_kb + key_head * stride_kh + keys, mask=key_mask, other=0.0)
    v = tl.load(v_ptr + sequence * stride_vb + head * stride_vh + values, mask=value_mask, other=0.0)
    a = tl.load(a_ptr + sequence * stride_ab + head)
    b = tl.load(b_ptr + sequence * stride_bb + head)
    out = delta_rule_step(
        q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), a, b, a_log_ptr + head, dt_bias_ptr + head,
        state_ptr + (slot.to(tl.int64) * V_HEADS + head) * (K_DIM * V_DIM), keys, values, live, scale, K_DIM, V_DIM,
    )
    tl.store(out_ptr + sequence * stride_ob + head * stride_oh + values, out.to(out_ptr.dtype.element_ty),
             mask=value_mask)


def gated_delta_rule_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step for B sequences, row b's in state slot slots[b] (int32 [B] on the device; None: slot b;
    negative: a padding row, see the module); state [S, Hv, Dk, Dv] float32 (S >= B) is updated in place.
    Returns o."""
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    batch, key_heads, key_dim = q.shape
    check_tensor("k", k, shape=(batch, key_heads, key_dim), dtype=q.dtype)
    check_tensor("v", v, shape=(batch, None, None), dtype=q.dtype)
    value_heads, value_dim = v.shape[1], v.shape[2]
    if key_heads == 0 or value_heads % key_heads:
        raise ValueError(f"v has {value_heads} heads, not a multiple of the {key_heads} heads of q and k")
    check_gate_parameters(a, b, A_log, dt_bias, rows=batch, heads=value_heads)
    check_tensor("state", state, shape=(None, value_heads, key_dim, value_dim), dtype=torch.float32,
                 contiguous=True)
    if state.shape[0] < batch:
        raise ValueError(f"state has {state.shape[0]} slots, fewer than q's {batch} rows")
    slots, has_slots = check_slots(slots, batch, state)
    if out is None:
        out = torch.empty(batch, value_heads, value_dim, device=v.device, dtype=v.dtype)
    check_tensor("out", out, shape=(batch, value_heads, value_dim), dtype=v.dtype)
    check_same_device(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, out=out, slots=slots)
    if batch == 0:
        return out
    grid = lambda meta: (batch * value_heads, triton.cdiv(value_dim, meta["BLOCK_V"]))  # noqa: E731
    _recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, out, slots,
        batch, key_dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        out.stride(0), out.stride(1),
        V_HEADS=value_heads, GROUP=value_heads // key_heads, K_DIM=key_dim, V_DIM=value_dim,
        BLOCK_K=triton.next_power_of_2(key_dim), HAS_SLOTS=has_slots,
    )
    return out


def gated_delta_rule_recurrent_cost(batch, key_heads, value_heads, key_dim, value_dim, element_size=2):
    """(bytes, FLOPs) of the floor: the float32 state read and written once, q, k, v, a, b in, o out;
    7 FLOPs per state element (decay, S^T k, the rank-one update, S^T q)."""
    data = 2 * 4 * batch * value_heads * key_dim * value_dim
    data += element_size * batch * (2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads)
    return data, 7 * batch * value_heads * key_dim * value_dim
