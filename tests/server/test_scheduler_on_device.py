"""The engine loop over the triton backend, its ids chosen on the device (server/sampler.py's DeviceSampler): greedy,
seeded and penalized sequences served together give what each gives served alone;
a step takes its inputs from the host only when the batch changes, else from the step before on the device; a row
asking for log-probabilities runs the step through the logits and changes no one's ids. CPU: the kernels under
Triton's interpreter, float32, a two-layer config (GPU: tests/server/test_server_gpu.py)."""

import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.server.sampler import DeviceSampler, device_params
from qwen_triton.server.scheduler import Scheduler
from qwen_triton.server.sequence import Sequence
from tests.server.test_scheduler import Collector
from tests.support import small_config, write_checkpoint

PROMPTS = [[5, 6, 7], [100, 3, 44, 2]]
# greedy, and seeded (a seed past int64) with a penalty: alone, each runs its own mode (the greedy head; the logits,
# the penalties, sample's kernels and the counting); together, both run the penalized one
PARAMS = [SamplingParams(), SamplingParams(temperature=0.9, presence_penalty=1.0, seed=2**64 - 5)]
NEW_TOKENS = 3  # the first from the prefill, then a step with the host's inputs and one continuing on the device


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("the triton backend on the CPU runs interpreted, in CI; a GPU machine runs the gpu tests")
    config = small_config(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                          linear_key_head_dim=16, linear_value_head_dim=32)
    directory = write_checkpoint(tmp_path_factory.mktemp("device"), config, layout="causal", seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=16, max_batch=4)


class CountingBackend:
    """The triton backend, recording whether each decode_tokens call took its inputs from the host."""

    def __init__(self, backend):
        self.backend = backend
        self.steps: list[tuple[int, bool]] = []  # (rows, inputs from the host)

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def decode_tokens(self, token_ids, positions, sampling, step, feedback=False, slots=None):
        self.steps.append((sampling.temperature.shape[0], token_ids is not None))
        return self.backend.decode_tokens(token_ids, positions, sampling, step, feedback=feedback, slots=slots)


def run(llm, groups, logprobs=None, new_tokens=NEW_TOKENS):
    """Each group of sequences submitted after the one before has finished: the ids of each, the outputs, the
    sequences, and each decode_tokens call's (rows, inputs from the host)."""
    collector = Collector()
    backend = CountingBackend(llm.model)
    scheduler = Scheduler(backend, max_num_seqs=4, emit=collector)
    assert isinstance(scheduler.sampler, DeviceSampler)
    scheduler.start()
    sequences = []
    try:
        for group in groups:
            batch = [Sequence(PROMPTS[i], PARAMS[i], new_tokens, logprobs=(logprobs or {}).get(i)) for i in group]
            scheduler.submit(batch)
            assert scheduler.wait_until_idle(600)
            sequences += batch
    finally:
        scheduler.stop()
    return [collector.tokens(s) for s in sequences], collector, sequences, backend.steps


@pytest.fixture(scope="module")
def alone(llm):
    """Each sequence served alone, one after the other."""
    ids, _, _, steps = run(llm, [[0], [1]])
    assert steps == [(1, True), (1, False)] * 2  # inputs from the host when the batch changes only
    return ids


def test_served_together_equals_served_alone(llm, alone):
    together, collector, sequences, steps = run(llm, [[0, 1]])
    assert together == alone
    assert steps == [(2, True), (2, False)]
    assert all(len(ids) == NEW_TOKENS for ids in together) and together[0] != together[1]
    assert all(collector.outputs[s.identity][-1].finish_reason == "length" for s in sequences)


def test_a_row_asking_for_logprobs_changes_no_ids_and_reports_the_models(llm, alone):
    """The steps of a batch with such a row run through the logits (no decode_tokens call) and choose what the
    device's decode step chooses; that row gets log-probabilities (their values: the function the reference
    backend's server tests check, server/sampler.py's logprob_outputs), the other none."""
    together, collector, sequences, steps = run(llm, [[0, 1]], logprobs={0: 2}, new_tokens=2)
    assert together == [ids[:2] for ids in alone] and steps == []
    for output in collector.outputs[sequences[0].identity]:  # greedy: the chosen id is the likeliest
        (best, best_logprob), (_, second_logprob) = output.top_logprobs
        assert best == output.token_id and output.logprob == best_logprob and 0 >= best_logprob >= second_logprob
    assert all(output.logprob is None for output in collector.outputs[sequences[1].identity])


def test_seeds_past_int64_keep_their_bits_on_the_device():
    assert device_params(SamplingParams(seed=2**64 - 1)).seed == -1
    assert device_params(SamplingParams(seed=2**63)).seed == -(2**63)
    assert device_params(SamplingParams(seed=7)).seed == 7
