"""The LM head: float32 logits, or the argmax (greedy or Gumbel-sampled) without writing the logits; the greedy
argmax also through an int8 screen of the head (screened.py: exact, reading half the bytes), and so top-k sampling's
logits (screened_top_k.py: exact wherever the top k can be)."""

from __future__ import annotations

import torch

from ..common import built_on_first_call
from .argmax import lm_head_argmax
from .logits import lm_head_logits
from .screened import build_screen, lm_head_argmax_screened, screened_lm_head_bytes
from .screened_top_k import lm_head_screened_top_k, screened_top_k_bytes

__all__ = ["lm_head_logits", "lm_head_argmax", "lm_head_argmax_screened", "lm_head_screened_top_k", "build_screen",
           "benchmark_cases"]

# Qwen3.5's recommended sampling settings (temperature, top_k, top_p), each also with presence_penalty 1.5
QWEN_SETTINGS = ((0.7, 20, 0.8), (1.0, 20, 0.95))
PENALISED_HISTORY = 128  # generated ids a penalised case's rows have counted (its presence penalty's tokens)


def benchmark_cases(device="cuda", dtype=torch.bfloat16, vocab=248320, hidden=1024) -> list[dict]:
    """Qwen3.5-0.8B's head at decode, the final norm fused: greedy argmax (screened at 1 and 16 rows), Gumbel-sampled
    argmax, float32 logits; and a top-k sampling step's head and sampler at Qwen's settings, at 1 and 16 rows, each
    with and without presence_penalty 1.5 (rows with PENALISED_HISTORY counted ids), through the screened top-k head
    and through the logits head (+ the penalties kernel): the first against the screened greedy head of the same
    rows. Dicts of name, fn, bytes (weights + x + what is written; the screened heads' without the candidates'
    rows), flops (2*M*V*H)."""
    from ..sampling import K_MAX, apply_penalties, sample

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
    screens = {}

    def screen():
        if "screen" not in screens:
            screens["screen"] = build_screen(weight)
        return screens["screen"]

    def screened(rows):
        def build():
            batch = torch.randn(rows, hidden, device=device, dtype=dtype)
            out = torch.empty(rows, dtype=torch.int64, device=device)
            return lambda: lm_head_argmax_screened(batch, weight, screen(), out, norm_weight=norm_weight)
        return dict(name=f"lm_head_argmax_screened+norm M={rows} V={vocab} H={hidden}", fn=built_on_first_call(build),
                    bytes=screened_lm_head_bytes(vocab, hidden) + 8 * (rows - 1) * vocab, flops=rows * flops)

    def top_k_step(rows, setting, penalised, through_screen):
        temperature, top_k, top_p = setting

        def build():
            generator = torch.Generator(device=device).manual_seed(rows)
            batch = torch.randn(rows, hidden, device=device, dtype=dtype, generator=generator)
            rows_logits = torch.empty(rows, vocab, dtype=torch.float32, device=device)
            parameters = dict(temperature=torch.full((rows,), temperature, device=device),
                              top_k=torch.full((rows,), top_k, dtype=torch.int32, device=device),
                              top_p=torch.full((rows,), top_p, device=device),
                              seed=torch.zeros(1, dtype=torch.int64, device=device),
                              step=torch.arange(rows, device=device),
                              out=torch.empty(rows, dtype=torch.int64, device=device))
            penalties = {}
            if penalised:
                counts = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
                counts.scatter_(1, torch.randint(0, vocab, (rows, PENALISED_HISTORY), device=device,
                                                 generator=generator), 1)
                penalties = dict(counts=counts, prompt_mask=torch.zeros(rows, vocab, dtype=torch.bool, device=device),
                                 repetition=torch.ones(rows, device=device),
                                 frequency=torch.zeros(rows, device=device),
                                 presence=torch.full((rows,), 1.5, device=device))

            def step():
                if through_screen:
                    lm_head_screened_top_k(batch, weight, screen(), rows_logits, parameters["temperature"],
                                           parameters["top_k"], top_k_bound=K_MAX, norm_weight=norm_weight,
                                           **penalties)
                else:
                    lm_head_logits(batch, weight, rows_logits, norm_weight=norm_weight)
                    if penalised:
                        apply_penalties(rows_logits, *penalties.values())
                return sample(rows_logits, **parameters, top_k_bound=K_MAX)
            return step

        head = "lm_head_screened_top_k" if through_screen else "lm_head_logits"  # (+ the penalties kernel)
        moved = (screened_top_k_bytes(vocab, hidden, rows, penalised) if through_screen
                 else weight_bytes + rows * vocab * (4 + 13 * penalised)) + 4 * rows * vocab
        return dict(name=f"{head}+norm+sample T={temperature} top_k={top_k} top_p={top_p}"
                         + (" presence=1.5" if penalised else "") + f" M={rows} V={vocab} H={hidden}",
                    fn=built_on_first_call(build), bytes=moved, flops=rows * flops)

    cases = [
        screened(1),
        dict(name=f"lm_head_argmax+norm M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_argmax(x, weight, ids, norm_weight=norm_weight), bytes=weight_bytes, flops=flops),
        dict(name=f"lm_head_argmax+norm+gumbel M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_argmax(x, weight, ids, norm_weight=norm_weight, **sampling),
             bytes=weight_bytes, flops=flops),
        dict(name=f"lm_head_logits+norm M=1 V={vocab} H={hidden}",
             fn=lambda: lm_head_logits(x, weight, logits, norm_weight=norm_weight),
             bytes=weight_bytes + 4 * vocab, flops=flops),
        screened(16),
    ]
    for rows in (1, 16):
        for setting in QWEN_SETTINGS:
            for penalised in (False, True):
                cases += [top_k_step(rows, setting, penalised, through_screen) for through_screen in (True, False)]
    return cases
