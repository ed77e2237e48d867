"""DecodePipeline's bookkeeping on the CPU, with a stand-in for the model: the ids a step chooses and where
they land are the model's business (tests/engine/test_triton_engine.py runs the real one); here only the
order of launches, reads and the continuity check."""

from types import SimpleNamespace

import torch

from qwen_triton.engine.decode_pipeline import DecodePipeline


class CountingModel:
    """Chooses id = 10 * (its input id) + 1 a step, feeding it back like the feedback kernel: the id lands in host
    row (the draw counter) % 2 and becomes the next step's input."""

    device = torch.device("cpu")
    max_length = 64

    def __init__(self):
        self.host = torch.zeros(2, 1, dtype=torch.int64)
        self.token = self.step = None

    def chosen_on_host(self, rows):
        return self.host

    def decode_tokens(self, token_ids, positions, sampling, step, feedback):
        assert feedback
        if token_ids is not None:
            self.token, self.step = int(token_ids[0]), int(step[0])
        chosen = (10 * self.token + 1) % 1000
        self.host[self.step % 2, 0] = chosen
        self.token, self.step = chosen, self.step + 1


def test_the_host_may_reuse_its_lists_between_steps():
    """A caller that advances its position and step lists in place (rather than passing new lists) continues
    the step launched ahead: the pipeline compares against copies of the lists it was given."""
    pipeline = DecodePipeline(CountingModel(), SimpleNamespace(temperature=torch.zeros(1)), ahead=True)
    inputs, positions, steps = [3], [5], [0]
    chosen = []
    for _ in range(4):
        ids = pipeline.step(inputs, positions, steps, [True])
        chosen.append(ids[0])
        inputs[0] = ids[0]
        positions[0] += 1
        steps[0] += 1
    assert chosen == [31, 311, 111, 111]
