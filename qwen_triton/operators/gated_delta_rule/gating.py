"""The Gated DeltaNet gates: per token and value head, the log-decay g and the write strength beta.

    beta = sigmoid(b)                                  rounded to b's dtype (as transformers' b.sigmoid())
    g    = -exp(A_log) * softplus(a + dt_bias)         float32, g <= 0 (exp(g) is the per-step decay)

a, b [M, Hv] in the activation dtype (strided row views of the fused input projection: unit last
stride); A_log, dt_bias float32 [Hv]. Returns float32 g, beta [M, Hv].

The delta-rule kernels (chunk.py, recurrent.py) fuse this math through `gate_and_beta`, so the engine
never launches this kernel on its hot paths; it stands alone for tests and the operator benchmark.

Floor at the real shapes (Hv 16, bf16): reads 2 x 16 x 2 B and writes 2 x 16 x 4 B per token, ~15
FLOPs per element (three transcendental functions): decode (M = 1) is one launch of latency, a
4096-token prefill moves ~0.8 MB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import autotune_configs, check_same_device, check_tensor

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def softplus(x):
    """torch's softplus (beta 1, threshold 20), as max(x, 0) + log1p(exp(-|x|)) so it never overflows."""
    tail = tl.exp(-tl.abs(x))
    # log1p(t) as log(u) t / (u - 1) with u = 1 + t (Goldberg): exact to rounding where 1 + t loses t's bits
    u = 1.0 + tail
    log1p_tail = tl.where(u == 1.0, tail, tl.log(u) * (tail / tl.where(u == 1.0, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_tail)


@triton.jit
def gate_and_beta(a, b, a_log, dt_bias, BETA_DTYPE: tl.constexpr):
    """float32 (g, beta) from raw a, b and the float32 per-head A_log, dt_bias (any broadcastable shapes)."""
    g = -tl.exp(a_log) * softplus(a.to(tl.float32) + dt_bias)
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    return g, beta.to(BETA_DTYPE).to(tl.float32)


@triton.jit
def l2_normalize_rows(x, scale):
    """x [R, D] float32 (masked lanes zero): each row times rsqrt(sum(x^2) + 1e-6) times scale."""
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6) * scale)[:, None]


def _configs():
    return autotune_configs([
        triton.Config({"BLOCK_M": 64}, num_warps=4),
        triton.Config({"BLOCK_M": 16}, num_warps=1),
        triton.Config({"BLOCK_M": 256}, num_warps=4),
    ])


@triton.autotune(configs=_configs(), key=["HEADS"], cache_results=True)
@triton.jit
def _gating_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr,
    rows, stride_a, stride_b, stride_g, stride_beta,
    HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    head = tl.arange(0, BLOCK_H)
    mask = (row[:, None] < rows) & (head[None, :] < HEADS)
    a = tl.load(a_ptr + row[:, None] * stride_a + head[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + row[:, None] * stride_b + head[None, :], mask=mask, other=0.0)
    a_log = tl.load(a_log_ptr + head, mask=head < HEADS, other=0.0)
    dt_bias = tl.load(dt_bias_ptr + head, mask=head < HEADS, other=0.0)
    g, beta = gate_and_beta(a, b, a_log[None, :], dt_bias[None, :], b_ptr.dtype.element_ty)
    tl.store(g_ptr + row[:, None] * stride_g + head[None, :], g, mask=mask)
    tl.store(beta_ptr + row[:, None] * stride_beta + head[None, :], beta, mask=mask)


def check_gate_parameters(a, b, A_log, dt_bias, rows: int | None = None, heads: int | None = None):
    """Shared launcher checks of the raw gate inputs; returns (rows, value heads)."""
    check_tensor("a", a, shape=(rows, heads), dtype=ACTIVATION_DTYPES)
    rows, heads = a.shape
    check_tensor("b", b, shape=(rows, heads), dtype=ACTIVATION_DTYPES)
    check_tensor("A_log", A_log, shape=(heads,), dtype=torch.float32, contiguous=True)
    check_tensor("dt_bias", dt_bias, shape=(heads,), dtype=torch.float32, contiguous=True)
    return rows, heads


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, out=None):
    """float32 (g, beta) [M, Hv] from a, b [M, Hv]; out: an optional (g, beta) pair to write into."""
    rows, heads = check_gate_parameters(a, b, A_log, dt_bias)
    check_same_device(a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    if out is None:
        g = torch.empty(rows, heads, device=a.device, dtype=torch.float32)
        beta = torch.empty(rows, heads, device=a.device, dtype=torch.float32)
    else:
        g, beta = out
        check_tensor("g", g, shape=(rows, heads), dtype=torch.float32, device=a.device)
        check_tensor("beta", beta, shape=(rows, heads), dtype=torch.float32, device=a.device)
    if rows == 0:
        return g, beta
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]),)  # noqa: E731
    _gating_kernel[grid](
        a, b, A_log, dt_bias, g, beta,
        rows, a.stride(0), b.stride(0), g.stride(0), beta.stride(0),
        HEADS=heads, BLOCK_H=triton.next_power_of_2(heads),
    )
    return g, beta


def gating_cost(rows, heads, element_size=2):
    """(bytes, FLOPs) of the floor: a, b in, float32 g, beta out; ~10 FLOPs per element."""
    return rows * heads * (2 * element_size + 2 * 4) + 2 * 4 * heads, 10 * rows * heads
