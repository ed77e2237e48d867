"""Both backends serve the one interface LLM calls (engine/backend.py)."""

import torch

from qwen_triton import LLM
from qwen_triton.engine.backend import Backend
from tests.support import small_config, write_checkpoint


def test_both_backends_serve_the_backend_protocol(tmp_path):
    directory = write_checkpoint(tmp_path, small_config(), layout="causal", seed=3)
    for backend in ("reference", "triton"):
        model = LLM(directory, backend=backend, device="cpu", dtype=torch.float32, max_length=8).model
        assert isinstance(model, Backend), backend
        assert (model.max_batch, model.max_length, model.device.type) == (8, 8, "cpu")
    assert not isinstance(object(), Backend)
