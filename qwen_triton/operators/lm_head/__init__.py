"""The LM head: float32 logits, or the argmax (greedy or Gumbel-sampled) without writing the logits; the greedy
argmax also through an int8 screen of the head (screened.py: exact, reading half the bytes)."""

from __future__ import annotations

import torch

from ..common import built_on_first_call
from .argmax import lm_head_argmax
from .logits import lm_head_logits
from .screened import build_screen, lm_head_argmax_screened, screened_lm_head_bytes

__all__ = ["lm_head_logits", "lm_head_argmax", "lm_head_argmax_screened", "build_screen", "benchmark_cases"]


def benchmark_cases(device="cuda", dtype=torch.bfloat16, vocab=248320, hidden=1024) -> list[dict]:
    """Qwen3.5-0.8B's head at decode (M = 1), the final norm fused: greedy argmax, Gumbel-sampled argmax,
    and float32 logits. Dicts of name, fn, bytes (weights + x + what is written), flops (2*M*V*H)."""
    weight = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.05
    norm_weight = torch.randn(hidden, device=device, dtype=dtype) * 0.1
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    ids = torch.empty(1, dtype=torch.int64, device=device)
    logits = torch.empty(1, vocab, dtype=torch.float32, device=device)
    sampling = dict(temperature=torch.full((1,), 0.8, device=device),
                    seed=torch.zeros(1, dtype=torch.int64, device=device),
                    step=torch.zeros(1, dtype=torch.int64, device=device))
    weight_bytes = vocab * hidden * weight.element_size()
    flops = 2 * vocab * hidden

    def screened():
        screen = build_screen(weight)
        return lambda: lm_head_argmax_screened(x, weight, screen, ids, norm_weight=norm_weight)

    return [
        dict(name=f"lm_head_argmax_screened+norm M=1 V={vocab} H={hidden}", fn=built_on_first_call(screened),
             bytes=screened_lm_head_bytes(vocab, hidden), flops=flops),
        dict(name=f"lm_head_argmax+norm M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_argmax(x, weight, ids, norm_weight=norm_weight), bytes=weight_bytes, flops=flops),
        dict(name=f"lm_head_argmax+norm+gumbel M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_argmax(x, weight, ids, norm_weight=norm_weight, **sampling),
             bytes=weight_bytes, flops=flops),
        dict(name=f"lm_head_logits+norm M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_logits(x, weight, logits, norm_weight=norm_weight),
             bytes=weight_bytes + 4 * vocab, flops=flops),
    ]
