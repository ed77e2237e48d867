"""The math of every Qwen3.5 operator in plain PyTorch: the oracle of every kernel test.

Each function follows Hugging Face transformers' `modeling_qwen3_5.py` (the authority on the math),
including where it rounds to the activation dtype, so that in float32 the reference model matches
transformers to rounding. Shapes are token-major and unbatched for prefill ([T, ...], one sequence),
batch-major for decode ([B, ...], one token of each of B sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x / rms(x) * (1 + weight), in float32, rounded to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: (x / rms(x)) * weight * silu(gate); plain weight, not 1 + weight."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    out = out * F.silu(gate.float())
    return out.to(dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the flash-linear-attention convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def rotary_inverse_frequencies(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rotary_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [len(positions), rotary_dim] in float32, the two halves repeated (rotate-half layout).

    Text-only inputs give the three mrope position components (time, height, width) the same value,
    so mrope's interleaving of frequency sections selects identical angles: plain RoPE.
    """
    inverse_frequencies = rotary_inverse_frequencies(rotary_dim, theta, positions.device)
    angles = positions.float()[:, None] * inverse_frequencies[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head of x [..., T, H, D]; cos/sin [T, rotary_dim]."""
    rotary_dim = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    first, second = rotated[..., : rotary_dim // 2], rotated[..., rotary_dim // 2 :]
    rotate_half = torch.cat([-second, first], dim=-1)
    return torch.cat([rotated * cos + rotate_half * sin, passed], dim=-1)


def attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_positions: torch.Tensor,
    key_length: int | None = None,
) -> torch.Tensor:
    """Causal grouped-query attention of T queries against a cache.

    query [T, Hq, D]; key_cache, value_cache [Hkv, S, D]; query_positions [T] (key j is visible to the
    query at position p when j <= p). Softmax in float32, as transformers' eager attention does.
    Returns [T, Hq, D] in query's dtype.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[0]
    if key_length is not None:
        key_cache, value_cache = key_cache[:, :key_length], value_cache[:, :key_length]
    group = num_heads // num_kv_heads
    keys = key_cache.repeat_interleave(group, dim=0)  # [Hq, S, D]
    values = value_cache.repeat_interleave(group, dim=0)
    q = query.transpose(0, 1)  # [Hq, T, D]
    scores = (q @ keys.transpose(1, 2)) * head_dim**-0.5  # [Hq, T, S]
    key_index = torch.arange(keys.shape[1], device=query.device)
    visible = key_index[None, :] <= query_positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probabilities = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (probabilities @ values).transpose(0, 1)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv over the sequence, then SiLU.

    x [T, C]; weight [C, W]; conv_state [C, W-1]: the last W-1 inputs before x (zeros at the start).
    Returns (silu(conv(x)) [T, C] in x's dtype, the new conv_state [C, W-1]).
    """
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(x.shape[1], width - 1)
    padded = torch.cat([conv_state.to(x.dtype), x.transpose(0, 1)], dim=1)  # [C, W-1+T]
    out = F.conv1d(padded[None].to(weight.dtype), weight[:, None, :], groups=x.shape[1])[0]  # [C, T]
    out = F.silu(out).to(x.dtype).transpose(0, 1)
    return out, padded[:, -(width - 1):].clone()


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the conv for a batch: x [B, C]; conv_state [B, C, W-1]; weight [C, W].

    Returns (silu(out) [B, C], new conv_state [B, C, W-1]). Written without data-dependent control flow.
    """
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, W]
    out = (window.to(weight.dtype) * weight[None]).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]


def gating(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (the log of the per-step decay), fp32 g."""
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta


def _prepare_delta_rule_inputs(query, key, value, g, beta, group):
    query, key = l2_norm(query.float()), l2_norm(key.float())
    query = query * query.shape[-1] ** -0.5
    if group > 1:
        query = query.repeat_interleave(group, dim=-2)
        key = key.repeat_interleave(group, dim=-2)
    return query, key, value.float(), g.float(), beta.float()


def gated_delta_rule_recurrent(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule for a batch of sequences (decode).

    query, key [B, Hk, Dk] (raw: L2-normalised here); value [B, Hv, Dv]; g, beta [B, Hv];
    state [B, Hv, Dk, Dv] float32. Value head h reads key head h // (Hv / Hk).
        S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q / sqrt(Dk)
    Returns (o [B, Hv, Dv] in value's dtype, the new state).
    """
    group = value.shape[1] // key.shape[1]
    q, k, v, g, beta = _prepare_delta_rule_inputs(query, key, value, g, beta, group)
    state = state * g.exp()[..., None, None]
    predicted = (state * k[..., :, None]).sum(-2)  # [B, Hv, Dv]
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    out = (state * q[..., :, None]).sum(-2)
    return out.to(value.dtype), state


def gated_delta_rule_chunked(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk (prefill).

    query, key [T, Hk, Dk]; value [T, Hv, Dv]; g, beta [T, Hv]; state [Hv, Dk, Dv] float32 or None.
    Within a chunk of C tokens the C rank-one updates are folded into matrix products (the UT / WY form):
    with A = strictly-lower(diag(beta) K K^T * decay), (I + A)^-1 turns the keys and values into
    W = (I + A)^-1 diag(beta) decay K and U = (I + A)^-1 diag(beta) V; then for each chunk
        V' = U - W S;   O = decay Q S + (Q K^T * decay, causal) V';   S = decay_C S + (decayed K)^T V'.
    Returns (o [T, Hv, Dv] in value's dtype, the final state [Hv, Dk, Dv] float32).
    """
    length, num_v_heads, v_dim = value.shape
    k_dim = key.shape[-1]
    group = num_v_heads // key.shape[1]
    q, k, v, g, beta = _prepare_delta_rule_inputs(query, key, value, g, beta, group)
    # heads first: [H, T, D]
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)
    pad = (-length) % chunk_size
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = (length + pad) // chunk_size
    q, k, v = (x.reshape(num_v_heads, chunks, chunk_size, -1) for x in (q, k, v))
    g, beta = g.reshape(num_v_heads, chunks, chunk_size), beta.reshape(num_v_heads, chunks, chunk_size)

    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strictly_causal = causal.tril(-1)
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * pair_decay).masked_fill(~strictly_causal, 0.0)
    identity = torch.eye(chunk_size, device=q.device)
    u = torch.linalg.solve_triangular(identity + system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        identity + system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )
    intra = ((q @ k.transpose(-1, -2)) * pair_decay).masked_fill(~causal, 0.0)
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()

    state = (
        torch.zeros(num_v_heads, k_dim, v_dim, device=q.device, dtype=torch.float32)
        if state is None
        else state.float()
    )
    out = torch.empty_like(v)
    for c in range(chunks):
        new_values = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + intra[:, c] @ new_values
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ new_values
    out = out.reshape(num_v_heads, chunks * chunk_size, v_dim)[:, :length].transpose(0, 1)
    return out.to(value.dtype), state


def silu_and_multiply(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up
