"""Choosing the next token from logits, in PyTorch (the reference backend's sampler and the oracle of
the Triton sampling kernel).

temperature 0 is greedy (argmax, lowest id on ties). Otherwise the logits are divided by the
temperature, the top_k largest kept (0 = all), then the smallest set of tokens whose probability mass
reaches top_p (1.0 = all), and one token drawn from what remains with a seeded generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from: float32 probabilities [..., V] after temperature, top-k and top-p."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probabilities = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probabilities, order = torch.sort(probabilities, dim=-1, descending=True)
        mass_before = sorted_probabilities.cumsum(-1) - sorted_probabilities
        drop_sorted = mass_before >= params.top_p  # keep a token while the mass before it is short of top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probabilities = probabilities.masked_fill(drop, 0.0)
        probabilities = probabilities / probabilities.sum(-1, keepdim=True)
    return probabilities


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Token ids [...] drawn from logits [..., V]."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    probabilities = filtered_probabilities(logits, params)
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    drawn = torch.multinomial(flat.cpu(), 1, generator=generator).to(logits.device)
    return drawn.reshape(probabilities.shape[:-1])
