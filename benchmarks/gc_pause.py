"""What a full collection of Python's garbage collector costs in a process that serves, with and without the heap of
the start frozen (server/heap.py; docs/decisions.md, D183).

Loads what a server's process holds (the LLM of the device's default backend, the server's modules, an app made
over it), then times `gc.collect()` (every generation: the pause a full collection puts on the process) --repeats
times, freezes the heap as the server does once started (`heap.freeze_startup_heap`), and times it again. Prints
the objects tracked before and after and the pauses' median and max, in JSON.

    python3 benchmarks/gc_pause.py [--preset 0.8b|tiny] [--repeats 5]
On a CPU the tiny preset's triton backend needs TRITON_INTERPRET=1 (set here when there is no GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pauses(repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=None, help="the model shape (default: 0.8b on a GPU, tiny on a CPU)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from qwen_triton.benchmark.models import random_llm
    from qwen_triton.server import heap
    from qwen_triton.server.app import create_app
    from qwen_triton.tokenizer import Tokenizer

    cuda = torch.cuda.is_available()
    preset = args.preset or ("0.8b" if cuda else "tiny")
    llm = random_llm(preset, device="cuda" if cuda else "cpu", dtype=torch.bfloat16 if cuda else torch.float32,
                     max_length=512, max_batch=4, warm_up=cuda, tokenizer=Tokenizer.default())
    create_app(llm, model_name="m")
    tracked = len(gc.get_objects())
    unfrozen = pauses(args.repeats)
    frozen_objects = heap.freeze_startup_heap()
    frozen = pauses(args.repeats)
    report = dict(device=torch.cuda.get_device_name() if cuda else "cpu", preset=preset, cpus=os.cpu_count(),
                  tracked_objects=tracked, frozen_objects=frozen_objects, tracked_after=len(gc.get_objects()),
                  full_collection_ms=dict(unfrozen_median=statistics.median(unfrozen), unfrozen_max=max(unfrozen),
                                          frozen_median=statistics.median(frozen), frozen_max=max(frozen)))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
