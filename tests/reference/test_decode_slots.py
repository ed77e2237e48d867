"""The reference decode over any set of slots (`slots=`): row r continues the sequence in slot slots[r], exactly as
decoding that sequence alone in its slot does, and the slots left out are untouched."""

import torch

from qwen_triton import LLM
from tests.support import small_config, write_checkpoint

PROMPTS = {0: [5, 17, 42, 9], 1: [8, 8, 1], 2: [100, 3, 7, 7, 2, 9], 3: [44]}


def prefilled(llm):
    """Every prompt in the slot of its key; the first decode inputs (each prompt's greedy next id)."""
    model = llm.model
    model.reset()
    return {slot: int(model.prefill(torch.tensor(ids), slot=slot, all_logits=False)[-1].argmax())
            for slot, ids in PROMPTS.items()}


def test_decode_over_given_slots_equals_each_sequence_alone(tmp_path):
    llm = LLM(write_checkpoint(tmp_path, small_config(), seed=5), backend="reference", device="cpu",
              dtype=torch.float32, max_length=32, max_batch=4)
    model = llm.model
    alone = {}
    for slot, token in prefilled(llm).items():
        logits = model.decode(torch.tensor([token]), torch.tensor([len(PROMPTS[slot])]), slots=torch.tensor([slot]))
        alone[slot] = logits[0]
    first = prefilled(llm)
    untouched = model.cache.recurrent[0][1].clone()
    slots = [3, 0, 2]  # out of order, slot 1 left out
    logits = model.decode(torch.tensor([first[s] for s in slots]), torch.tensor([len(PROMPTS[s]) for s in slots]),
                          slots=torch.tensor(slots, dtype=torch.int32))
    for row, slot in enumerate(slots):
        assert torch.allclose(logits[row], alone[slot], rtol=1e-5, atol=1e-5), slot
    assert torch.equal(model.cache.recurrent[0][1], untouched)
    # without slots, rows are slots 0..B-1
    prefilled(llm)
    default = model.decode(torch.tensor([first[0], first[1]]), torch.tensor([4, 3]))
    assert torch.allclose(default[0], alone[0], rtol=1e-5, atol=1e-5)
