"""Counter-based Gumbel noise: the randomness of every sampler in the engine.

A draw from softmax(s) is argmax(s + G) with G_i iid Gumbel(0, 1) (the Gumbel-max trick), so sampling
needs no prefix sums, only a maximum, and it fuses into anything that produces the scores.
G = -log(-log(u)), u uniform from Philox-4x32-10 keyed by the 64-bit seed, with the counter
(token id, step low 32 bits, step high 32 bits, stream): a pure function of device values, so a draw is
reproducible and capturable in a CUDA graph (the seed and the step are read from device tensors, and the
step advances on the device). The rounds are written out here rather than calling triton.language.random
(the same Philox-4x32 constants) to keep the interpreter, which pays per nested call, fast for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_tensor


def check_noise_keys(seed: torch.Tensor, step: torch.Tensor, rows: int) -> None:
    """The keys of the noise of `rows` rows: seed int64 [1] (shared) or [rows], step int64 [rows]."""
    check_tensor("seed", seed, shape=(None,), dtype=torch.int64)
    if seed.shape[0] not in (1, rows):
        raise ValueError(f"seed has shape {list(seed.shape)}, expected [1] or [{rows}]")
    check_tensor("step", step, shape=(rows,), dtype=torch.int64)


@triton.jit
def gumbel_noise(seed, step, stream, token):
    """Gumbel(0, 1) noise, one value per element of the broadcast of seed, step, stream and token (ints)."""
    zero = token.to(tl.int64) * 0 + step.to(tl.int64) * 0 + stream.to(tl.int64) * 0 + seed.to(tl.int64) * 0
    step = zero + step.to(tl.int64)
    seed = zero + seed.to(tl.int64)
    c0 = (zero + token.to(tl.int64)).to(tl.uint32)
    c1 = (step & 0xFFFFFFFF).to(tl.uint32)
    c2 = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c3 = (zero + stream.to(tl.int64)).to(tl.uint32)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = tl.mul(a2, 0xCD9E8D57, sanitize_overflow=False)
        c3 = tl.mul(a0, 0xD2511F53, sanitize_overflow=False)
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    # the top 24 bits as a float in (0, 1): never 0 or 1, so the noise is finite
    uniform = ((c0 >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(uniform))


# ---- the same noise in PyTorch: the tests' oracle ------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _multiply_high_low(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32 bits of a * b for a in [0, 2^32) (int64 tensor) and a 32-bit constant b."""
    low_part, high_part = a * (b & 0xFFFF), a * (b >> 16)  # a*b = high_part * 2^16 + low_part, each < 2^48
    high = ((high_part + (low_part >> 16)) >> 16) & _MASK32
    low = (low_part + ((high_part & 0xFFFF) << 16)) & _MASK32
    return high, low


def gumbel_noise_reference(seed, step, stream, token) -> torch.Tensor:
    """gumbel_noise in PyTorch (int64 arithmetic for the uint32 Philox rounds), float32, broadcast shapes."""
    seed, step, stream, token = (torch.as_tensor(v, dtype=torch.int64) for v in (seed, step, stream, token))
    seed, step, stream, token = torch.broadcast_tensors(seed, step, stream, token)
    c0, c1, c2, c3 = token & _MASK32, step & _MASK32, (step >> 32) & _MASK32, stream & _MASK32
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        high_b, low_b = _multiply_high_low(c2, 0xCD9E8D57)
        high_a, low_a = _multiply_high_low(c0, 0xD2511F53)
        c0, c1, c2, c3 = high_b ^ c1 ^ k0, low_b, high_a ^ c3 ^ k1, low_a
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    uniform = ((c0 >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(uniform))
