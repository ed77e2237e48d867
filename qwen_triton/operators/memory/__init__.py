"""Zeroing a fixed list of tensors in one launch (a sequence slot's conv and recurrent states, before a prompt)."""

from .zero import ZeroPlan, zero_cost

__all__ = ["ZeroPlan", "zero_cost"]
