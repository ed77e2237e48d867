"""Sampling on the device: penalties, temperature, min-p, top-k, top-p and a seeded Gumbel-max draw, without
sorting the vocabulary."""

from .feedback import feed_back
from .noise import gumbel_noise, gumbel_noise_reference
from .penalties import apply_penalties, count_tokens
from .sample import K_MAX, benchmark_cases, sample

__all__ = ["sample", "K_MAX", "apply_penalties", "count_tokens", "feed_back", "gumbel_noise", "gumbel_noise_reference",
           "benchmark_cases"]
