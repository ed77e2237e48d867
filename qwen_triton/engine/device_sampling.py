"""Sampling glue of the Triton backend: a batch's sampling parameters as device tensors, and the first token's
choice from a prefill's logits (the decode step chooses the others inside its CUDA graph)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..operators.sampling import sample


@dataclass
class DeviceSampling:
    """The sampling parameters of a batch's rows as device tensors, and the decode mode they need."""

    mode: str  # "greedy" | "temperature" (Gumbel-max in the LM head) | "sample" (top-k / top-p filtering)
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def build(cls, rows, device) -> "DeviceSampling":
        """rows: one SamplingParams per batch row."""
        if all(p.temperature == 0 for p in rows):
            mode = "greedy"
        elif all(p.top_k == 0 and p.top_p >= 1.0 for p in rows):
            mode = "temperature"
        else:
            mode = "sample"
        return cls(
            mode=mode,
            temperature=torch.tensor([p.temperature for p in rows], device=device, dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in rows], device=device, dtype=torch.int32),
            top_p=torch.tensor([p.top_p for p in rows], device=device, dtype=torch.float32),
            seed=torch.tensor([p.seed for p in rows], device=device, dtype=torch.int64),
        )


def lm_argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice from materialised logits: the sampler at temperature 0 (argmax, lowest id on ties)."""
    rows = logits.shape[0]
    zeros = torch.zeros(rows, device=logits.device)
    return sample(logits, zeros, torch.zeros(rows, device=logits.device, dtype=torch.int32),
                  torch.ones(rows, device=logits.device), torch.zeros(1, device=logits.device, dtype=torch.int64),
                  torch.zeros(rows, device=logits.device, dtype=torch.int64), filtering=False)


def choose_first(logits: torch.Tensor, sampling: DeviceSampling, row: int) -> torch.Tensor:
    """The first generated id of row `row` from its prefill logits [1, V], drawn as decode draws (same noise
    stream at step 0)."""
    if sampling.mode == "greedy":
        return lm_argmax_rows(logits)
    pick = slice(row, row + 1)
    step = torch.zeros(1, device=logits.device, dtype=torch.int64)
    return sample(logits, sampling.temperature[pick], sampling.top_k[pick], sampling.top_p[pick],
                  sampling.seed[pick], step, filtering=sampling.mode == "sample")
