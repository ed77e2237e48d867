"""The engine loop over the triton backend, its ids chosen on the device (server/sampler.py's DeviceSampler): greedy,
seeded and penalized sequences served together give what each gives served alone; a step takes its inputs from
the host only when the batch changes, else from the step before on the device, and may be launched before the host
reads the one before; a row asking for log-probabilities runs the step through the logits and changes no one's
ids. CPU: the kernels under Triton's interpreter, float32, a two-layer config (GPU: tests/server/test_server_gpu.py)."""

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
    """The triton backend, recording each decode_tokens call ("host" where it took its inputs from the host, else
    "device", with its rows) and each read of the ids it leaves on the host ("read")."""

    def __init__(self, backend):
        self.backend = backend
        self.calls: list[str] = []

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def decode_tokens(self, token_ids, positions, sampling, step, feedback=False, slots=None):
        self.calls.append(f"{'host' if token_ids is not None else 'device'} {sampling.temperature.shape[0]}")
        return self.backend.decode_tokens(token_ids, positions, sampling, step, feedback=feedback, slots=slots)

    def chosen_on_host(self, batch):
        self.calls.append("read")
        return self.backend.chosen_on_host(batch)


def run(llm, groups, logprobs=None, new_tokens=NEW_TOKENS, ahead=False):
    """Each group of sequences submitted after the one before has finished: the ids of each, the outputs, the
    sequences, and the backend's calls (CountingBackend). ahead: the sampler launches a step before reading the
    one before, as on a GPU."""
    collector = Collector()
    backend = CountingBackend(llm.model)
    scheduler = Scheduler(backend, max_num_seqs=4, emit=collector, sampler=DeviceSampler(backend, ahead=ahead))
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
    return [collector.tokens(s) for s in sequences], collector, sequences, backend.calls


@pytest.fixture(scope="module")
def alone(llm):
    """Each sequence served alone, one after the other, a step read before the next is launched."""
    ids, _, _, calls = run(llm, [[0], [1]])
    # inputs from the host when the batch changes only
    assert calls == ["host 1", "read", "device 1", "read"] * 2
    return ids


def test_served_together_equals_served_alone(llm, alone):
    """Together, and each step after the first launched before the host reads the one before (run ahead)."""
    together, collector, sequences, calls = run(llm, [[0, 1]], ahead=True)
    assert together == alone
    assert calls == ["host 2", "device 2", "read", "read"]
    assert all(len(ids) == NEW_TOKENS for ids in together) and together[0] != together[1]
    assert all(collector.outputs[s.identity][-1].finish_reason == "length" for s in sequences)


def test_a_row_asking_for_logprobs_changes_no_ids_and_reports_the_models(llm, alone):
    """The steps of a batch with such a row run through the logits (no decode_tokens call) and choose what the
    device's decode step chooses; that row gets log-probabilities (their values: the function the reference
    backend's server tests check, server/sampler.py's logprob_outputs), the other none."""
    together, collector, sequences, calls = run(llm, [[0, 1]], logprobs={0: 2}, new_tokens=2, ahead=True)
    assert together == [ids[:2] for ids in alone] and calls == []
    for output in collector.outputs[sequences[0].identity]:  # greedy: the chosen id is the likeliest
        (best, best_logprob), (_, second_logprob) = output.top_logprobs
        assert best == output.token_id and output.logprob == best_logprob and 0 >= best_logprob >= second_logprob
    assert all(output.logprob is None for output in collector.outputs[sequences[1].identity])


def test_seeds_past_int64_keep_their_bits_on_the_device():
    assert device_params(SamplingParams(seed=2**64 - 1)).seed == -1
    assert device_params(SamplingParams(seed=2**63)).seed == -(2**63)
    assert device_params(SamplingParams(seed=7)).seed == 7
