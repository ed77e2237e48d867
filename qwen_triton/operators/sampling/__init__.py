"""Sampling on the device: temperature, top-k, top-p and a seeded Gumbel-max draw, without sorting."""

from .feedback import feed_back
from .noise import gumbel_noise, gumbel_noise_reference
from .sample import benchmark_cases, sample

__all__ = ["sample", "feed_back", "gumbel_noise", "gumbel_noise_reference", "benchmark_cases"]
