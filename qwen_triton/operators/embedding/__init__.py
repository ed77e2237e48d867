"""Token embedding (a row gather)."""

from .embedding import benchmark_cases, embedding

__all__ = ["embedding", "benchmark_cases"]
