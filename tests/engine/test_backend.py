"""Both backends serve the one interface LLM calls (engine/backend.py)."""

import pytest
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


def test_prefill_batch_gives_each_prompt_its_last_logits_in_its_slot(tmp_path):
    directory = write_checkpoint(tmp_path, small_config(), layout="causal", seed=3)
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([9, 10]), torch.tensor([3])]
    for backend in ("reference", "triton"):
        model = LLM(directory, backend=backend, device="cpu", dtype=torch.float32, max_length=8, max_batch=4).model
        together = model.prefill_batch(prompts, [2, 0, 3])
        assert together.shape == (3, model.config.vocab_size) and together.dtype == torch.float32
        steps = model.decode(torch.tensor([1, 2]), torch.tensor([3, 2]), slots=torch.tensor([2, 0]))
        model.reset()
        alone = [model.prefill(ids, slot, all_logits=False) for ids, slot in zip(prompts, [2, 0, 3])]
        assert torch.allclose(together, torch.cat(alone), atol=1e-5), backend
        assert torch.allclose(steps, model.decode(torch.tensor([1, 2]), torch.tensor([3, 2]),
                                                   slots=torch.tensor([2, 0])), atol=1e-5), backend


def test_prefill_batch_refuses_bad_arguments(tmp_path):
    directory = write_checkpoint(tmp_path, small_config(), layout="causal", seed=3)
    model = LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=8, max_batch=2).model
    ids = torch.tensor([1, 2])
    for arguments, message in [(([ids, ids], [1, 1]), "distinct"), (([ids], [2]), "distinct"),
                               (([ids], [0, 1]), "slots has 2"), (([], []), "at least one"),
                               (([torch.tensor([], dtype=torch.long)], [0]), "non-empty"),
                               (([ids], [0], [7]), "exceed the maximum length 8")]:
        with pytest.raises(ValueError, match=message):
            model.prefill_batch(*arguments)
