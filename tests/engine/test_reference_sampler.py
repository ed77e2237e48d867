"""The PyTorch sampler (engine/sampling.py): the penalties' and min-p's semantics on hand-made rows, and the
parameters' checks. It is the oracle of the device kernels (tests/operators/test_sampling.py; this file's name
differs, the test folders sharing one module namespace)."""

import math

import pytest
import torch

from qwen_triton.engine.sampling import SamplingParams, filtered_probabilities, penalize, sample, token_counts


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = torch.tensor([2.0, -2.0, 3.0, -1.0, 4.0])
    counts = token_counts([2, 2], 5)  # token 2 generated twice
    prompt = token_counts([0, 1], 5) > 0  # tokens 0 and 1 in the prompt
    penalised = penalize(logits, SamplingParams(repetition_penalty=2.0), counts, prompt)
    assert penalised.tolist() == [1.0, -4.0, 1.5, -1.0, 4.0]


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    counts = torch.tensor([0, 1, 3, 0], dtype=torch.int32)
    prompt = torch.tensor([True, False, False, True])  # the prompt is not counted
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    assert penalize(logits, params, counts, prompt).tolist() == [1.0, 0.25, -0.75, 1.0]
    both = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5)  # repetition first, then frequency
    assert penalize(logits, both, counts, prompt).tolist() == [0.5, 0.0, -1.0, 0.5]


def test_penalties_off_leave_the_logits():
    logits = torch.randn(3, 7)
    counts = torch.ones(3, 7, dtype=torch.int32)
    assert torch.equal(penalize(logits, SamplingParams(), counts, counts > 0), logits)


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely():
    probabilities = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    kept = filtered_probabilities(probabilities.log(), SamplingParams(temperature=1.0, min_p=0.15)) > 0
    assert kept.tolist() == [True, True, True, False, False]  # 0.1 >= 0.075 > 0.06
    # before top-p: top-p renormalises over what min-p kept (0.5 / 0.9 < 0.6 <= 0.8 / 0.9)
    both = filtered_probabilities(probabilities.log(), SamplingParams(temperature=1.0, min_p=0.15, top_p=0.6))
    assert (both > 0).tolist() == [True, True, False, False, False]
    torch.testing.assert_close(both[:2], torch.tensor([0.625, 0.375]))
    # with the temperature: min-p on softmax(logits / T)
    hot = filtered_probabilities(probabilities.log(), SamplingParams(temperature=2.0, min_p=0.5)) > 0
    assert hot.tolist() == [True, True, False, False, False]  # sqrt(0.3 / 0.5) >= 0.5 > sqrt(0.1 / 0.5)


def test_greedy_ignores_min_p_and_takes_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[1.0, 3.0, 2.5]])
    params = SamplingParams(min_p=0.9, presence_penalty=1.0)
    penalised = penalize(logits, params, torch.tensor([[0, 1, 0]], dtype=torch.int32), torch.zeros(1, 3) > 0)
    assert int(sample(penalised, params)[0]) == 2


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan),
    ("presence_penalty", 2.5), ("presence_penalty", -3.0), ("frequency_penalty", 2.01),
    ("frequency_penalty", math.nan), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
])
def test_bad_values_raise_value_error_naming_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_edges_are_accepted():
    SamplingParams(min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1e-3)
    assert not SamplingParams(min_p=0.5).penalized and SamplingParams(repetition_penalty=1.1).penalized
