"""What every kernel launcher shares: argument checks that name the tensor, and interpreter awareness.

The kernels run on an NVIDIA GPU, or on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`),
which is how CI tests them. Under the interpreter, autotuning is reduced to the first config
(each config would otherwise be interpreted in turn); `QWEN_TRITON_AUTOTUNE=first` does the same on a
GPU, for correctness runs.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def autotune_configs(configs: list) -> list:
    """The autotune search space: all configs on a GPU, the first alone under the interpreter or when
    QWEN_TRITON_AUTOTUNE=first (correctness runs on a GPU, which need no tuning)."""
    if interpreting() or os.environ.get("QWEN_TRITON_AUTOTUNE", "") == "first":
        return configs[:1]
    return configs


def check_tensor(
    name: str,
    tensor,
    *,
    shape: tuple | None = None,
    dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = True,
) -> None:
    """Raise ValueError naming `name` when the tensor is not what a kernel needs.

    shape: expected sizes, None entries match anything. contiguous: fully contiguous.
    last_dim_contiguous: unit stride in the last dim (rows may be strided views of a fused buffer).
    """
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if shape is not None:
        if tensor.dim() != len(shape) or any(e is not None and e != s for e, s in zip(shape, tensor.shape)):
            expected = "[" + ", ".join("*" if e is None else str(e) for e in shape) + "]"
            raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {expected}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if tensor.dtype not in allowed:
            raise ValueError(f"{name} has dtype {tensor.dtype}, expected {' or '.join(map(str, allowed))}")
    if device is not None and tensor.device != torch.device(device):
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()})")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension (strides {tensor.stride()})")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device: {listing}")
