"""The server's processes and Python's garbage collector: the heap of the start frozen, every collection's pause
counted.

CPython's collection of its oldest generation walks every object the process tracks, and the process stands still
while it does: in the HTTP process every stream's next chunk waits, in the engine process the next step's launch.
After the start a process tracks a few hundred thousand objects (torch, triton and the engine's modules, the model,
FastAPI): 215,000 with the tiny model's triton backend, whose full collection took 99 ms on the 2-core development
machine (`python3 benchmarks/gc_pause.py`). Such a collection comes whenever the objects that outlived two young
collections (a request's, which lives for many steps) reach a quarter of the oldest generation: rarely (none in 820
requests of the load generator there), but then every stream waits. `freeze_startup_heap` (`gc.freeze`, once the
server is up) moves everything alive into the permanent generation, which collections never walk, so they walk only
what came after the start: 0.0003 ms there (docs/decisions.md, D183). vLLM and SGLang freeze their heaps after
their warm-ups too.

`Pauses` records every collection's duration from a gc callback. The callback takes no lock: it runs inside
whichever allocation triggers the collection, possibly one made while a metric's lock is held, so it only appends to a
list, which `flush` hands to a histogram when the metrics are read.
"""

from __future__ import annotations

import gc
import os
import time


def freeze_startup_heap() -> int:
    """Collect what is garbage, then move every object alive into the permanent generation (gc.freeze): the number
    of objects frozen. Cyclic garbage among them is not reclaimed until `gc.unfreeze()`. QWEN_TRITON_GC_FREEZE=0
    leaves the heap as it is (the comparison), and 0 objects are frozen."""
    if os.environ.get("QWEN_TRITON_GC_FREEZE", "1") == "0":
        return 0
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Pauses:
    """The collector's pauses in this process (seconds, every generation), for `histogram` (metrics.Histogram):
    recorded from `start()` to `close()`, moved into the histogram by `flush()`."""

    def __init__(self, histogram):
        self.histogram = histogram
        self._recorded: list[float] = []
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._recorded.append(time.perf_counter() - self._started)
            self._started = None

    def start(self) -> "Pauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        self.flush()

    def flush(self) -> None:
        recorded, self._recorded = self._recorded, []  # a pause recorded in between lands in `recorded`
        if recorded:
            self.histogram.observe_many(recorded)
