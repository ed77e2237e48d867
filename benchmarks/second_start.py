"""Proof that a second process reuses the autotune choices on disk: run after a process that tuned, with
the same TRITON_CACHE_DIR and TRITON_PRINT_AUTOTUNING=1; it must print no 'best config' line."""

import time

import torch

from qwen_triton.benchmark.models import random_llm

start = time.perf_counter()
llm = random_llm("0.8b", "triton", dtype=torch.bfloat16, max_length=4097)
llm.generate([1, 2, 3], max_new_tokens=8)
llm.generate([1, 2, 3], max_new_tokens=8, temperature=0.7)
print(f"second start: model built, warmed up and generating in {time.perf_counter() - start:.1f} s")
