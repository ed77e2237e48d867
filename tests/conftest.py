"""Shared test setup.

Without a GPU, Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
kernel module is imported, which is why it is set here, first.
"""

import os

import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# no model of a test warms up every bucket at load unless the test asks (LLM(warm_up=True), tests/engine/test_warmup.py)
os.environ.setdefault("QWEN_TRITON_WARM_UP", "0")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if HAS_GPU else "cpu"
