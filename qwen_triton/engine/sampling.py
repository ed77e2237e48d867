"""Choosing the next token from logits, in PyTorch (the reference backend's sampler and the oracle of
the Triton sampling kernels).

Penalties first, on the raw logits (vLLM's and OpenAI's semantics): repetition_penalty r (1.0 = off) divides a
positive logit (multiplies a negative one) by r for every token of the prompt or of the generated tokens; then
frequency_penalty f and presence_penalty p (0 = off) subtract f * count + p * (count > 0), count the times a
token was generated so far (the prompt not counted).

temperature 0 is then greedy (argmax of the penalised logits, lowest id on ties). Otherwise the logits are
divided by the temperature (s); min_p (0 = off) keeps the tokens whose probability is at least min_p times the
largest one, s >= max(s) + ln(min_p) (vLLM's order: before top-k and top-p; as a threshold relative to the row's
largest s it commutes with top-k); the top_k largest kept (0 = all), then the smallest set of tokens whose
probability mass, renormalised over what is left, reaches top_p (1.0 = all); one token is drawn from what
remains with a seeded generator.
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2] (0 disables it), got {value}")
        if not (0.0 < self.repetition_penalty < float("inf")):
            raise ValueError(f"repetition_penalty must be > 0 (1.0 disables it), got {self.repetition_penalty}")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the logits then depend on the prompt and the tokens generated so far)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def filtered(self) -> bool:
        """Whether a filter narrows the draw (top-k, top-p or min-p); only matters when sampling."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def token_counts(token_ids, vocab: int, device=None) -> torch.Tensor:
    """int32 [V]: how many times each token occurs in token_ids."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return torch.bincount(ids, minlength=vocab).to(device=device, dtype=torch.int32)


def penalize(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor,
             prompt_mask: torch.Tensor) -> torch.Tensor:
    """float32 logits [..., V] with the penalties applied. counts [..., V]: the times each token was generated so
    far; prompt_mask [..., V] (bool): the tokens of the prompt. Unchanged (a float32 copy) with penalties off."""
    logits = logits.float().clone()
    if not params.penalized:
        return logits
    counts = counts.to(logits.device)
    if params.repetition_penalty != 1.0:
        seen = prompt_mask.to(logits.device).bool() | (counts > 0)
        r = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    counted = counts > 0
    if params.frequency_penalty != 0.0:
        logits = torch.where(counted, logits - params.frequency_penalty * counts.float(), logits)
    if params.presence_penalty != 0.0:
        logits = torch.where(counted, logits - params.presence_penalty, logits)
    return logits


def filtered_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampled from: float32 probabilities [..., V] after temperature, min-p, top-k and top-p
    (the logits already penalised)."""
    scaled = logits.float() / params.temperature
    if params.min_p > 0.0:
        floor = scaled.max(-1, keepdim=True).values + torch.log(torch.tensor(params.min_p, dtype=torch.float32))
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
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
    """Token ids [...] drawn from logits [..., V] (already penalised: `penalize`)."""
    if params.temperature == 0.0:
        return logits.argmax(-1)
    probabilities = filtered_probabilities(logits, params)
    flat = probabilities.reshape(-1, probabilities.shape[-1])
    drawn = torch.multinomial(flat.cpu(), 1, generator=generator).to(logits.device)
    return drawn.reshape(probabilities.shape[:-1])
