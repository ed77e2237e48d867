"""Which operator launched which kernel: the map `qwen-triton profile` puts its timings on.

The Triton model names each operator it runs (`TritonModel._operator`) with the bytes and FLOPs that
operator must move and compute (its floor). While a `KernelTrace` is active, a Triton launch hook records
every kernel launched with the operator current at its launch, so a timeline of kernels (from the CUDA
profiler) can be read as a timeline of operators: kernel i of a step is launch i of the trace.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Operator:
    kind: str  # e.g. "mlp gate_up", the same for every layer
    layer: int | None  # None for the embedding, the final norm and LM head
    bytes: int  # that the operator must move through device memory (its floor with `flops`)
    flops: int
    kernels: list[str] = field(default_factory=list)  # the kernel names it launched, in order
    host_us: float = 0.0  # host time inside the operator: its whole time where kernels run synchronously
    # (under the CPU interpreter, which calls no launch hooks); launch time only on a GPU


class KernelTrace:
    """Context manager: while active, every Triton kernel launch is appended to the current operator."""

    def __init__(self):
        self.operators: list[Operator] = []
        self._current: Operator | None = None
        self.unlabelled: list[str] = []
        self._launches: list[tuple[Operator, str]] = []

    def _hook(self, metadata) -> None:
        name = metadata.get()["name"]
        if self._current is None:
            self.unlabelled.append(name)
        else:
            self._current.kernels.append(name)
            self._launches.append((self._current, name))

    def __enter__(self) -> "KernelTrace":
        import triton

        triton.knobs.runtime.launch_enter_hook.add(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        import triton

        triton.knobs.runtime.launch_enter_hook.remove(self._hook)

    @contextmanager
    def operator(self, kind: str, layer: int | None, bytes: int = 0, flops: int = 0):
        outer = self._current
        self._current = operator = Operator(kind, layer, int(bytes), int(flops))
        self.operators.append(operator)
        start = time.perf_counter()
        try:
            yield
        finally:
            operator.host_us = (time.perf_counter() - start) * 1e6
            self._current = outer

    def launches(self) -> list[tuple[Operator, str]]:
        """(operator, kernel name) of every launch, in launch order."""
        return list(self._launches)
