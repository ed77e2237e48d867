"""A prompt prefilled in chunks, each continuing the slot's caches and states after the tokens before it, gives
what one pass over the whole prompt gives: the logits of every chunk's positions and the decode steps after it
(the recurrent state, the conv state and the KV cache all carried). What a server needs to interleave a long
prompt's prefill with running decodes."""

import pytest
import torch

from qwen_triton import LLM
from tests.support import relative_error, small_config, write_checkpoint

PROMPT = [(7 * i + 3) % 301 for i in range(37)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("model"), small_config(), seed=11)


def chunked_logits(llm, chunks, decode_steps=3):
    """The prompt's logits prefilled in pieces of the given sizes, then greedy decode steps' logits."""
    model = llm.model
    model.reset(0)
    ids = torch.tensor(PROMPT, device=llm.device)
    rows, start = [], 0
    for size in chunks:
        rows.append(model.prefill(ids[start:start + size], slot=0, start=start))
        start += size
    assert start == len(PROMPT)
    token = int(rows[-1][-1].argmax())
    for step in range(decode_steps):
        logits = model.decode(torch.tensor([token], device=llm.device),
                              torch.tensor([len(PROMPT) + step], device=llm.device))
        rows.append(logits)
        token = int(logits[-1].argmax())
    return torch.cat(rows).float()


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("chunks", [(16, 21), (5, 1, 30, 1), (36, 1)])
def test_a_prompt_in_chunks_equals_one_pass(checkpoint, backend, chunks):
    llm = LLM(checkpoint, backend=backend, device="cpu", dtype=torch.float32, max_length=64)
    whole = chunked_logits(llm, (len(PROMPT),))
    pieces = chunked_logits(llm, chunks)
    assert pieces.shape == whole.shape
    assert relative_error(pieces, whole) <= 2e-4
    assert torch.equal(pieces.argmax(-1), whole.argmax(-1))
