"""Zero-centred RMSNorm (the final norm; the input norms are fused into the projections)."""

from .rms_norm import benchmark_cases, rms_norm, row_squares

__all__ = ["rms_norm", "row_squares", "benchmark_cases"]
