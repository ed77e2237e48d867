"""Zeroing a fixed list of tensors in one launch (a sequence slot's conv and recurrent states, before a prompt)."""

from .zero import ZeroPlan

__all__ = ["ZeroPlan"]
