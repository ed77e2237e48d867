"""The gated delta rule over a whole sequence (prefill), 64 tokens at a time in the UT / WY form.

Per value head h (reading key head h // (Hv / Hk)), with the gates and L2 norms fused in:
    g, beta = gating(a, b);  q = l2norm(q) / sqrt(Dk);  k = l2norm(k)        (gating.py; float32)
and, for a chunk of C = 64 tokens with G_i = g_1 + ... + g_i (the log-decay from the chunk's start) and
the state S [Dk, Dv] at its start, the C rank-one updates of the recurrent form fold into matrices:
    A   = strictly-lower(diag(beta) K K^T * exp(G_i - G_j))                  [C, C]
    W   = (I + A)^-1 diag(beta exp(G)) K,  U = (I + A)^-1 diag(beta) V       [C, Dk], [C, Dv]
    V'  = U - W S                                                            the corrected values
    O   = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), causal) V'             [C, Dv]
    S   = exp(G_C) S + (diag(exp(G_C - G)) K)^T V'
(functional.gated_delta_rule_chunked is the same math in torch). Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]
(strided views of the conv output, unit last stride); a, b [T, Hv] (raw, strided); A_log, dt_bias
float32 [Hv]; state [Hv, Dk, Dv] float32: the initial state in, the final state out, in place.
o [T, Hv, Dv] in v's dtype.

Two kernels:
1. `_chunk_prepare_kernel`, grid (chunks, Hv), fully parallel: gates and their cumulative sum, the L2
   norms, A and the intra-chunk attention Q K^T (stored, causal-masked and decayed), and (I + A)^-1,
   built from four 16 x 16 diagonal blocks inverted by forward substitution and merged by block
   back-substitution (X_ij = -D_i sum_{j<=m<i} A_im X_mj), then W and U. These only depend on the chunk.
2. `_chunk_recurrence_kernel`, grid (Hv, Dv / BLOCK_V): the sequential part. A program carries the
   [Dk, BLOCK_V] slab of one head's state through the chunks in registers (float32), re-reading and
   re-normalising the chunk's raw q and k (cheaper than storing decayed copies), and writes O as it goes.
   Its critical path is two dependent matmuls per chunk (W S, then K^T V').

Precision. The state, the gates, the norms and every accumulation are float32. The inverse (I + A)^-1
is formed with float32 ("ieee") 16 x 16 products: it is reused by all 64 rows and errors there are
systematic. For 16-bit activations the other chunk-local products of kernel 1 (K K^T, Q K^T, W, U) use
tf32 operands, and the recurrence's products take 16-bit operands (the state and V' rounded to the
activation dtype, float32 accumulation), the choice of flash-linear-attention; U stays float32 because
V' = U - W S can cancel. `dot_precision="tf32"` or `"ieee"` makes every product take float32 operands
at that precision. float32 activations use "ieee" throughout.

Floor at the real shapes (Hk = Hv = 16, Dk = Dv = 128, bf16), per token: q, k, v in (12 KiB), a, b in,
o out (4 KiB), plus the 1 MiB state in and out once: ~67 MB for T = 4096, 4 MB for T = 128. The
scratch (W bf16, U fp32, Q K^T bf16: ~14 KiB per token) is written once and re-read from L2.
~10 MFLOP per 64-token chunk and head (K K^T and Q K^T 1.3M, W and U 1.3M, the recurrence's
W S, Q S, K^T V' 6.3M and (Q K^T) V' 1M): ~10.7 GFLOP for T = 4096.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_tensor
from .gating import ACTIVATION_DTYPES, check_gate_parameters, gate_and_beta, l2_normalize_rows

CHUNK = 64
SUB = 16  # the inverse is built from CHUNK / SUB = 4 diagonal blocks

TORCH_TO_TRITON = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _load_rows(base, rows, length, stride_row, cols, width):
    mask = (rows[:, None] < length) & (cols[None, :] < width)
    return tl.load(base + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with operands rounded to DOT_DTYPE (float32 operands at PRECISION), float32 accumulation."""
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)


@triton.jit
def _gates(a_base, b_base, rows, length, stride_a, stride_b, a_log, dt_bias, BETA_DTYPE: tl.constexpr):
    """g, beta of SUB rows; zero past the sequence's end (no decay, no write: the reference's padding)."""
    mask = rows < length
    a = tl.load(a_base + rows * stride_a, mask=mask, other=0.0)
    b = tl.load(b_base + rows * stride_b, mask=mask, other=0.0)
    g, beta = gate_and_beta(a, b, a_log, dt_bias, BETA_DTYPE)
    return tl.where(mask, g, 0.0), tl.where(mask, beta, 0.0)


@triton.jit
def _decayed_block(left, right, decay_left, decay_right, DIAGONAL: tl.constexpr, STRICT: tl.constexpr,
                   PRECISION: tl.constexpr):
    """(left right^T) * exp(G_i - G_j) for one [SUB, SUB] block; causal-masked when on the diagonal."""
    scores = tl.dot(left, tl.trans(right), input_precision=PRECISION)
    exponent = decay_left[:, None] - decay_right[None, :]
    if DIAGONAL:
        i = tl.arange(0, left.shape[0])[:, None]
        j = tl.arange(0, right.shape[0])[None, :]
        if STRICT:
            keep = i > j
        else:
            keep = i >= j
        # masked entries would take exp of a positive exponent: zero the exponent first
        return tl.where(keep, scores * tl.exp(tl.where(keep, exponent, 0.0)), 0.0)
    return scores * tl.exp(exponent)


@triton.jit
def _invert_unit_lower(a0, a1, a2, a3):
    """(I + a)^-1 of four [SUB, SUB] strictly lower triangular blocks at once, by forward substitution.

    Row i of an inverse X is e_i - sum_{m<i} a[i, m] X[m, :], and rows m < i are final when it is formed.
    The blocks are stacked as one [SUB, SUB, 2, 2] tile so that each step is one set of tile operations.
    """
    size: tl.constexpr = a0.shape[0]
    a = tl.join(tl.join(a0, a1), tl.join(a2, a3))
    rows = tl.arange(0, size)[:, None, None, None]
    cols = tl.arange(0, size)[None, :, None, None]
    inverse = tl.where(rows == cols, 1.0, tl.zeros_like(a))
    for i in tl.static_range(1, size):
        a_row = tl.sum(tl.where(rows == i, a, 0.0), axis=0)  # [m, 2, 2]: a[i, m] of each block
        correction = tl.sum(a_row[:, None, :, :] * inverse, axis=0)
        inverse = tl.where(rows == i, inverse - correction[None, :, :, :], inverse)
    x01, x23 = tl.split(inverse)
    x0, x1 = tl.split(x01)
    x2, x3 = tl.split(x23)
    return x0, x1, x2, x3


@triton.jit
def _store_rows(base, rows, length, stride_row, cols, width, value):
    mask = (rows[:, None] < length) & (cols[None, :] < width)
    tl.store(base + rows[:, None] * stride_row + cols[None, :], value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _store_block(base, block_row: tl.constexpr, block_col: tl.constexpr, value):
    """One [SUB, SUB] block of a chunk's [CHUNK, CHUNK] row-major matrix."""
    size: tl.constexpr = value.shape[0]
    i = block_row * size + tl.arange(0, size)[:, None]
    j = block_col * size + tl.arange(0, size)[None, :]
    tl.store(base + i * (4 * size) + j, value.to(base.dtype.element_ty))


def _prepare_configs():
    return autotune_configs([
        triton.Config({}, num_warps=4),
        triton.Config({}, num_warps=8),
        triton.Config({}, num_warps=2),
    ])


@triton.autotune(configs=_prepare_configs(), key=["K_DIM", "V_DIM", "PRECISION"], cache_results=True)
@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qk_ptr, decay_ptr,
    length, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SUB_ROWS: tl.constexpr, PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP
    rows0 = chunk * (4 * SUB_ROWS) + tl.arange(0, SUB_ROWS)
    rows1 = rows0 + SUB_ROWS
    rows2 = rows1 + SUB_ROWS
    rows3 = rows2 + SUB_ROWS
    keys = tl.arange(0, BLOCK_K)
    values = tl.arange(0, BLOCK_V)

    # gates, and their cumulative sum over the chunk: G, the log-decay from the chunk's start
    a_log = tl.load(a_log_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    beta_dtype = b_ptr.dtype.element_ty
    g0, beta0 = _gates(a_ptr + head, b_ptr + head, rows0, length, stride_at, stride_bt, a_log, dt_bias, beta_dtype)
    g1, beta1 = _gates(a_ptr + head, b_ptr + head, rows1, length, stride_at, stride_bt, a_log, dt_bias, beta_dtype)
    g2, beta2 = _gates(a_ptr + head, b_ptr + head, rows2, length, stride_at, stride_bt, a_log, dt_bias, beta_dtype)
    g3, beta3 = _gates(a_ptr + head, b_ptr + head, rows3, length, stride_at, stride_bt, a_log, dt_bias, beta_dtype)
    decay0 = tl.cumsum(g0, 0)
    total = tl.sum(g0, 0)
    decay1 = tl.cumsum(g1, 0) + total
    total += tl.sum(g1, 0)
    decay2 = tl.cumsum(g2, 0) + total
    total += tl.sum(g2, 0)
    decay3 = tl.cumsum(g3, 0) + total
    decay_base = decay_ptr + head * length
    tl.store(decay_base + rows0, decay0, mask=rows0 < length)
    tl.store(decay_base + rows1, decay1, mask=rows1 < length)
    tl.store(decay_base + rows2, decay2, mask=rows2 < length)
    tl.store(decay_base + rows3, decay3, mask=rows3 < length)

    k_base = k_ptr + key_head * stride_kh
    k0 = l2_normalize_rows(_load_rows(k_base, rows0, length, stride_kt, keys, K_DIM), 1.0)
    k1 = l2_normalize_rows(_load_rows(k_base, rows1, length, stride_kt, keys, K_DIM), 1.0)
    k2 = l2_normalize_rows(_load_rows(k_base, rows2, length, stride_kt, keys, K_DIM), 1.0)
    k3 = l2_normalize_rows(_load_rows(k_base, rows3, length, stride_kt, keys, K_DIM), 1.0)

    # the intra-chunk attention Q K^T * exp(G_i - G_j), causal: the lower blocks (the rest is never read)
    qk_base = qk_ptr + (chunk * V_HEADS + head) * (16 * SUB_ROWS * SUB_ROWS)
    q_base = q_ptr + key_head * stride_qh
    q = l2_normalize_rows(_load_rows(q_base, rows0, length, stride_qt, keys, K_DIM), scale)
    _store_block(qk_base, 0, 0, _decayed_block(q, k0, decay0, decay0, True, False, PRECISION))
    q = l2_normalize_rows(_load_rows(q_base, rows1, length, stride_qt, keys, K_DIM), scale)
    _store_block(qk_base, 1, 0, _decayed_block(q, k0, decay1, decay0, False, False, PRECISION))
    _store_block(qk_base, 1, 1, _decayed_block(q, k1, decay1, decay1, True, False, PRECISION))
    q = l2_normalize_rows(_load_rows(q_base, rows2, length, stride_qt, keys, K_DIM), scale)
    _store_block(qk_base, 2, 0, _decayed_block(q, k0, decay2, decay0, False, False, PRECISION))
    _store_block(qk_base, 2, 1, _decayed_block(q, k1, decay2, decay1, False, False, PRECISION))
    _store_block(qk_base, 2, 2, _decayed_block(q, k2, decay2, decay2, True, False, PRECISION))
    q = l2_normalize_rows(_load_rows(q_base, rows3, length, stride_qt, keys, K_DIM), scale)
    _store_block(qk_base, 3, 0, _decayed_block(q, k0, decay3, decay0, False, False, PRECISION))
    _store_block(qk_base, 3, 1, _decayed_block(q, k1, decay3, decay1, False, False, PRECISION))
    _store_block(qk_base, 3, 2, _decayed_block(q, k2, decay3, decay2, False, False, PRECISION))
    _store_block(qk_base, 3, 3, _decayed_block(q, k3, decay3, decay3, True, False, PRECISION))

    # A = strictly-lower(diag(beta) K K^T * decay), block by block
    a00 = _decayed_block(k0 * beta0[:, None], k0, decay0, decay0, True, True, PRECISION)
    a10 = _decayed_block(k1 * beta1[:, None], k0, decay1, decay0, False, True, PRECISION)
    a11 = _decayed_block(k1 * beta1[:, None], k1, decay1, decay1, True, True, PRECISION)
    a20 = _decayed_block(k2 * beta2[:, None], k0, decay2, decay0, False, True, PRECISION)
    a21 = _decayed_block(k2 * beta2[:, None], k1, decay2, decay1, False, True, PRECISION)
    a22 = _decayed_block(k2 * beta2[:, None], k2, decay2, decay2, True, True, PRECISION)
    a30 = _decayed_block(k3 * beta3[:, None], k0, decay3, decay0, False, True, PRECISION)
    a31 = _decayed_block(k3 * beta3[:, None], k1, decay3, decay1, False, True, PRECISION)
    a32 = _decayed_block(k3 * beta3[:, None], k2, decay3, decay2, False, True, PRECISION)
    a33 = _decayed_block(k3 * beta3[:, None], k3, decay3, decay3, True, True, PRECISION)

    # X = (I + A)^-1: diagonal blocks by substitution, then X_ij = -D_i sum_{j<=m<i} A_im X_mj
    x00, x11, x22, x33 = _invert_unit_lower(a00, a11, a22, a33)
    # (float32 "ieee" products: the inverse is reused by every row of the chunk)
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision="ieee"), input_precision="ieee")
    x21 = -tl.dot(x22, tl.dot(a21, x11, input_precision="ieee"), input_precision="ieee")
    x32 = -tl.dot(x33, tl.dot(a32, x22, input_precision="ieee"), input_precision="ieee")
    x20 = tl.dot(a20, x00, input_precision="ieee")
    x20 = -tl.dot(x22, tl.dot(a21, x10, acc=x20, input_precision="ieee"), input_precision="ieee")
    x31 = tl.dot(a31, x11, input_precision="ieee")
    x31 = -tl.dot(x33, tl.dot(a32, x21, acc=x31, input_precision="ieee"), input_precision="ieee")
    x30 = tl.dot(a30, x00, input_precision="ieee")
    x30 = tl.dot(a31, x10, acc=x30, input_precision="ieee")
    x30 = -tl.dot(x33, tl.dot(a32, x20, acc=x30, input_precision="ieee"), input_precision="ieee")

    # W = X diag(beta exp(G)) K
    k0 = k0 * (beta0 * tl.exp(decay0))[:, None]
    k1 = k1 * (beta1 * tl.exp(decay1))[:, None]
    k2 = k2 * (beta2 * tl.exp(decay2))[:, None]
    k3 = k3 * (beta3 * tl.exp(decay3))[:, None]
    w_base = w_ptr + head * length * K_DIM
    _store_rows(w_base, rows0, length, K_DIM, keys, K_DIM, tl.dot(x00, k0, input_precision=PRECISION))
    _store_rows(w_base, rows1, length, K_DIM, keys, K_DIM,
                tl.dot(x10, k0, input_precision=PRECISION) + tl.dot(x11, k1, input_precision=PRECISION))
    _store_rows(w_base, rows2, length, K_DIM, keys, K_DIM,
                tl.dot(x20, k0, input_precision=PRECISION) + tl.dot(x21, k1, input_precision=PRECISION)
                + tl.dot(x22, k2, input_precision=PRECISION))
    _store_rows(w_base, rows3, length, K_DIM, keys, K_DIM,
                tl.dot(x30, k0, input_precision=PRECISION) + tl.dot(x31, k1, input_precision=PRECISION)
                + tl.dot(x32, k2, input_precision=PRECISION) + tl.dot(x33, k3, input_precision=PRECISION))

    # U = X diag(beta) V
    v_base = v_ptr + head * stride_vh
    v0 = _load_rows(v_base, rows0, length, stride_vt, values, V_DIM) * beta0[:, None]
    v1 = _load_rows(v_base, rows1, length, stride_vt, values, V_DIM) * beta1[:, None]
    v2 = _load_rows(v_base, rows2, length, stride_vt, values, V_DIM) * beta2[:, None]
    v3 = _load_rows(v_base, rows3, length, stride_vt, values, V_DIM) * beta3[:, None]
    u_base = u_ptr + head * length * V_DIM
    _store_rows(u_base, rows0, length, V_DIM, values, V_DIM, tl.dot(x00, v0, input_precision=PRECISION))
    _store_rows(u_base, rows1, length, V_DIM, values, V_DIM,
                tl.dot(x10, v0, input_precision=PRECISION) + tl.dot(x11, v1, input_precision=PRECISION))
    _store_rows(u_base, rows2, length, V_DIM, values, V_DIM,
                tl.dot(x20, v0, input_precision=PRECISION) + tl.dot(x21, v1, input_precision=PRECISION)
                + tl.dot(x22, v2, input_precision=PRECISION))
    _store_rows(u_base, rows3, length, V_DIM, values, V_DIM,
                tl.dot(x30, v0, input_precision=PRECISION) + tl.dot(x31, v1, input_precision=PRECISION)
                + tl.dot(x32, v2, input_precision=PRECISION) + tl.dot(x33, v3, input_precision=PRECISION))


def _recurrence_configs():
    return autotune_configs([
        triton.Config({"BLOCK_V": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_V": 16}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_V": 16}, num_warps=4, num_stages=1),
        triton.Config({"BLOCK_V": 32}, num_warps=4, num_stages=1),
        triton.Config({"BLOCK_V": 32}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_V": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_V": 64}, num_warps=4, num_stages=1),
    ])


@triton.autotune(
    configs=_recurrence_configs(),
    key=["chunk_bucket", "V_HEADS", "K_DIM", "V_DIM", "PRECISION"],  # DOT_DTYPE: qk's dtype, in the key
    restore_value=["state_ptr"], cache_results=True,
)
@triton.jit
def _chunk_recurrence_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, qk_ptr, decay_ptr, state_ptr, out_ptr,
    length, chunks, chunk_bucket, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    key_head = head // GROUP
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offsets = tl.arange(0, CHUNK_ROWS)
    causal = offsets[:, None] >= offsets[None, :]
    slab = state_ptr + head * (K_DIM * V_DIM) + keys[:, None] * V_DIM + values[None, :]
    slab_mask = (keys[:, None] < K_DIM) & (values[None, :] < V_DIM)
    state = tl.load(slab, mask=slab_mask, other=0.0)

    q_base = q_ptr + key_head * stride_qh
    k_base = k_ptr + key_head * stride_kh
    decay_base = decay_ptr + head * length
    w_base = w_ptr + head * length * K_DIM
    u_base = u_ptr + head * length * V_DIM
    out_base = out_ptr + head * stride_oh
    for chunk in range(chunks):
        rows = chunk * CHUNK_ROWS + offsets
        row_mask = rows < length
        decay = tl.load(decay_base + rows, mask=row_mask, other=0.0)
        decay_last = tl.load(decay_base + tl.minimum(chunk * CHUNK_ROWS + CHUNK_ROWS, length) - 1)
        q = l2_normalize_rows(_load_rows(q_base, rows, length, stride_qt, keys, K_DIM), scale)
        q = q * tl.exp(decay)[:, None]
        k = l2_normalize_rows(_load_rows(k_base, rows, length, stride_kt, keys, K_DIM), 1.0)
        k = k * tl.exp(decay_last - decay)[:, None]
        w = tl.load(w_base + rows[:, None] * K_DIM + keys[None, :],
                    mask=row_mask[:, None] & (keys[None, :] < K_DIM), other=0.0)
        u = tl.load(u_base + rows[:, None] * V_DIM + values[None, :],
                    mask=row_mask[:, None] & (values[None, :] < V_DIM), other=0.0)
        qk = tl.load(qk_ptr + (chunk * V_HEADS + head) * (CHUNK_ROWS * CHUNK_ROWS)
                     + offsets[:, None] * CHUNK_ROWS + offsets[None, :], mask=causal, other=0.0)

        new_values = u - _mm(w, state, DOT_DTYPE, PRECISION)
        out = _mm(q, state, DOT_DTYPE, PRECISION) + _mm(qk, new_values, DOT_DTYPE, PRECISION)
        tl.store(out_base + rows[:, None] * stride_ot + values[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (values[None, :] < V_DIM))
        state = state * tl.exp(decay_last) + _mm(tl.trans(k), new_values, DOT_DTYPE, PRECISION)
    tl.store(slab, state, mask=slab_mask)


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK,
    out: torch.Tensor | None = None,
    dot_precision: str | None = None,
) -> torch.Tensor:
    """Prefill of one sequence: o [T, Hv, Dv]; state [Hv, Dk, Dv] float32 carried in place.

    dot_precision: None (the default mix, see the module docstring), "tf32" or "ieee" (float32 operands).
    """
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK}, got {chunk_size}")
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    length, key_heads, key_dim = q.shape
    check_tensor("k", k, shape=(length, key_heads, key_dim), dtype=q.dtype)
    check_tensor("v", v, shape=(length, None, None), dtype=q.dtype)
    value_heads, value_dim = v.shape[1], v.shape[2]
    if key_heads == 0 or value_heads % key_heads:
        raise ValueError(f"v has {value_heads} heads, not a multiple of the {key_heads} heads of q and k")
    check_gate_parameters(a, b, A_log, dt_bias, rows=length, heads=value_heads)
    check_tensor("state", state, shape=(value_heads, key_dim, value_dim), dtype=torch.float32, contiguous=True)
    if out is None:
        out = torch.empty(length, value_heads, value_dim, device=v.device, dtype=v.dtype)
    check_tensor("out", out, shape=(length, value_heads, value_dim), dtype=v.dtype)
    check_same_device(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, out=out)
    if dot_precision not in (None, "tf32", "ieee"):
        raise ValueError(f"dot_precision must be None, 'tf32' or 'ieee', got {dot_precision!r}")
    if length == 0:
        return out

    if v.dtype == torch.float32 or dot_precision == "ieee":
        prepare_precision, dot_dtype, recurrence_precision = "ieee", torch.float32, "ieee"
    elif dot_precision == "tf32":
        prepare_precision, dot_dtype, recurrence_precision = "tf32", torch.float32, "tf32"
    else:
        prepare_precision, dot_dtype, recurrence_precision = "tf32", v.dtype, "tf32"

    chunks = triton.cdiv(length, CHUNK)
    device = v.device
    w = torch.empty(value_heads, length, key_dim, device=device, dtype=dot_dtype)
    u = torch.empty(value_heads, length, value_dim, device=device, dtype=torch.float32)
    qk = torch.empty(chunks, value_heads, CHUNK, CHUNK, device=device, dtype=dot_dtype)
    decay = torch.empty(value_heads, length, device=device, dtype=torch.float32)
    block_k = max(16, triton.next_power_of_2(key_dim))
    group = value_heads // key_heads
    scale = key_dim**-0.5

    _chunk_prepare_kernel[(chunks, value_heads)](
        q, k, v, a, b, A_log, dt_bias, w, u, qk, decay,
        length, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        V_HEADS=value_heads, GROUP=group, K_DIM=key_dim, V_DIM=value_dim,
        BLOCK_K=block_k, BLOCK_V=max(16, triton.next_power_of_2(value_dim)), SUB_ROWS=SUB,
        PRECISION=prepare_precision,
    )
    grid = lambda meta: (value_heads, triton.cdiv(value_dim, meta["BLOCK_V"]))  # noqa: E731
    _chunk_recurrence_kernel[grid](
        q, k, w, u, qk, decay, state, out,
        length, chunks, triton.next_power_of_2(chunks), scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        V_HEADS=value_heads, GROUP=group, K_DIM=key_dim, V_DIM=value_dim,
        CHUNK_ROWS=CHUNK, BLOCK_K=block_k, DOT_DTYPE=TORCH_TO_TRITON[dot_dtype], PRECISION=recurrence_precision,
    )
    return out


def gated_delta_rule_chunked_cost(length, key_heads, value_heads, key_dim, value_dim, element_size=2):
    """(bytes, FLOPs) of the floor: q, k, v, a, b in, o out, the float32 state in and out once; the
    chunk's matmuls (A and Q K^T lower halves, the inverse, W, U, W S, Q S, (Q K^T) V', K^T V')."""
    data = element_size * length * (2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads)
    data += 2 * 4 * value_heads * key_dim * value_dim
    n = CHUNK
    per_chunk = n * n * (3 * key_dim + 2 * value_dim) + n**3 // 3 + 6 * n * key_dim * value_dim
    return data, triton.cdiv(length, n) * value_heads * per_chunk
