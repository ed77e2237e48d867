"""Sampling on the Triton backend's device (engine/device_sampling.py): the decode mode a batch's parameters pick,
the kernels each mode launches, and generation with penalties and min-p against the reference backend (greedy:
the same ids) or against itself (sampled rows: a batch equals its rows one at a time). CPU: the interpreter,
float32, a tiny config."""

import dataclasses
import warnings

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine import triton_model
from qwen_triton.engine.device_sampling import DeviceSampling, choose_first
from qwen_triton.engine.sampling import SamplingParams
from tests.support import small_config, write_checkpoint

PROMPT = [5, 6, 7, 5, 5]


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    config = small_config(tie_word_embeddings=False)
    return write_checkpoint(tmp_path_factory.mktemp("causal"), config, layout="causal", seed=11)


@pytest.fixture(scope="module")
def reference(directory):
    return LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=32, max_batch=4)


@pytest.fixture(scope="module")
def triton(directory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(directory, backend="triton", device="cpu", dtype=torch.float32, max_length=32, max_batch=4)


@pytest.mark.parametrize("rows, mode", [
    ([SamplingParams()], "greedy"),
    ([SamplingParams(min_p=0.5, top_k=3)], "greedy"),  # greedy rows ignore the filters
    ([SamplingParams(temperature=0.8), SamplingParams()], "temperature"),
    ([SamplingParams(temperature=0.8, top_p=0.9)], "sample"),
    ([SamplingParams(temperature=0.8), SamplingParams(top_k=5)], "sample"),  # as before min-p and penalties
    ([SamplingParams(temperature=0.8, min_p=0.1), SamplingParams()], "min-p"),
    ([SamplingParams(temperature=0.8, min_p=0.1, top_k=4)], "top-k"),
    ([SamplingParams(temperature=0.7, top_p=0.8, top_k=20), SamplingParams(top_k=0)], "top-k"),  # greedy: any
    ([SamplingParams(temperature=0.7, top_k=64), SamplingParams(temperature=1.0, top_k=1)], "top-k"),
    ([SamplingParams(temperature=0.7, top_k=65)], "sample"),  # past K_MAX
    ([SamplingParams(temperature=0.7, top_k=20), SamplingParams(temperature=1.0, top_p=0.9)], "sample"),
    ([SamplingParams(repetition_penalty=1.2)], "penalized"),
    ([SamplingParams(presence_penalty=0.5, top_k=3), SamplingParams(temperature=1.0, min_p=0.2)], "penalized"),
    ([SamplingParams(frequency_penalty=0.5), SamplingParams(temperature=1.0, top_p=0.9)], "penalized-sample"),
    ([SamplingParams(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)], "penalized-top-k"),
])
def test_build_picks_the_mode(rows, mode):
    sampling = DeviceSampling.build(rows, torch.device("cpu"))
    assert sampling.mode == mode
    assert torch.equal(sampling.repetition_penalty, torch.tensor([p.repetition_penalty for p in rows]))
    assert sampling.min_p.dtype == torch.float32 and sampling.min_p.shape == (len(rows),)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 16])
def test_build_gives_each_column_as_its_own_tensor_would_be(count):
    """The columns travel in one buffer, each a contiguous row starting 16 bytes aligned, as a tensor of its own: a
    kernel reading one compiles the specialisation the warm-up compiled (test_warmup.py)."""
    rows = [SamplingParams(temperature=0.5 + i, top_p=0.9, top_k=i + 1, seed=2**63 - 1 - i, min_p=0.01 * i,
                           presence_penalty=-i / count) for i in range(count)]
    sampling = DeviceSampling.build(rows, torch.device("cpu"))
    for name, dtype in (("temperature", torch.float32), ("top_k", torch.int32), ("top_p", torch.float32),
                        ("seed", torch.int64), ("min_p", torch.float32), ("presence_penalty", torch.float32)):
        column = getattr(sampling, name)
        assert column.dtype == dtype and column.shape == (count,) and column.is_contiguous(), name
        assert column.data_ptr() % 16 == 0, name
        assert torch.equal(column, torch.tensor([getattr(p, name) for p in rows], dtype=dtype)), name


def launches(monkeypatch):
    """The decode step's calls of the sampling kernels' launchers, by name."""
    calls = []
    for name in ("apply_penalties", "count_tokens", "sample", "lm_head_argmax_screened", "lm_head_argmax",
                 "lm_head_logits"):
        original = getattr(triton_model, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, kwargs.get("filtering"), kwargs.get("min_p") is not None, kwargs.get("temperature")
                          is not None))
            return _original(*args, **kwargs)

        monkeypatch.setattr(triton_model, name, counted)
    return calls


def test_default_paths_launch_what_they_launched_before(triton, monkeypatch):
    """Greedy steps run the screened LM head alone, temperature steps the Gumbel-max LM head alone: no logits, no
    sampling kernel, no penalty kernel. min-p alone: the logits and sample without its search passes."""
    calls = launches(monkeypatch)
    triton.generate(PROMPT, max_new_tokens=3)
    decode = [call for call in calls if call[0] != "lm_head_logits"]  # the prefill's logits
    assert decode == [("lm_head_argmax_screened", None, False, False)] * 2
    calls.clear()
    triton.generate(PROMPT, max_new_tokens=3, temperature=0.9, seed=1)
    assert [call for call in calls if call[0] != "lm_head_logits"] == [("lm_head_argmax", None, False, True)] * 2
    calls.clear()
    triton.generate(PROMPT, max_new_tokens=2, temperature=0.9, min_p=0.2, seed=1)
    assert [call[0] for call in calls] == ["lm_head_logits", "lm_head_logits", "sample"]  # prefill, step, draw
    assert calls[-1][1:3] == (False, True)


def test_top_k_steps_sample_by_candidates(triton, monkeypatch):
    """Qwen's recommended settings: the decode step calls sample with the top-k candidates at the width K_MAX (one
    width: the mode names the CUDA graph), and so does the first token's choice."""
    from qwen_triton.engine import device_sampling
    from qwen_triton.operators.sampling.sample import K_MAX

    options = []
    for module in (triton_model, device_sampling):
        original = module.sample

        def recorded(*args, _original=original, **kwargs):
            options.append((kwargs.get("filtering"), kwargs.get("top_k_bound")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, "sample", recorded)
    triton.generate(PROMPT, max_new_tokens=2, temperature=0.7, top_p=0.8, top_k=20, seed=1)
    assert options == [(True, K_MAX)] * 2  # the first token, one decode step


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3),
                                    SamplingParams(temperature=1.0, top_p=0.95, top_k=20, min_p=0.01, seed=4),
                                    SamplingParams(temperature=1.3, top_k=2, seed=5)])
def test_choose_first_by_candidates_is_the_search(params):
    """choose_first in the top-k mode chooses what the search mode chooses, over random rows (the tiny config's
    301 tokens, rows with ties among them) and seeds."""
    sampling = DeviceSampling.build([params], torch.device("cpu"))
    assert sampling.mode == "top-k"
    searched = dataclasses.replace(sampling, mode="sample")
    generator = torch.Generator().manual_seed(params.seed)
    for scale, rounding in ((3.0, False), (2.0, True)):
        logits = torch.randn(1, 301, generator=generator) * scale
        logits = logits.round() if rounding else logits
        assert torch.equal(choose_first(logits, sampling, 0), choose_first(logits, searched, 0))


def test_choose_first_of_every_row_at_once_equals_one_row_at_a_time():
    """choose_first over a batch's rows at once (row None: what LLM.generate runs on a packed prefill's logits)
    draws each row's id as that row alone does: per-row seeds, mixed greedy and sampled rows."""
    rows = [SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=3), SamplingParams(),
            SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=9), SamplingParams(temperature=0.7, seed=1)]
    logits = torch.randn(len(rows), 301, generator=torch.Generator().manual_seed(5)) * 3
    for mode_rows in (rows[:3], rows):  # the top-k mode, then the search mode (a row without top_k)
        sampling = DeviceSampling.build(mode_rows, torch.device("cpu"))
        together = choose_first(logits[:len(mode_rows)], sampling).tolist()
        alone = [int(choose_first(logits[r:r + 1], sampling, r)[0]) for r in range(len(mode_rows))]
        assert together == alone
        assert together[1] == int(logits[1].argmax())


PENALTIES = [dict(repetition_penalty=2.0), dict(presence_penalty=-2.0, frequency_penalty=-1.5),
             dict(repetition_penalty=0.5, presence_penalty=1.0)]


@pytest.mark.parametrize("penalties", PENALTIES)
def test_greedy_with_penalties_equals_the_reference_backend(reference, triton, monkeypatch, penalties):
    plain = reference.generate(PROMPT, max_new_tokens=6).token_ids
    expected = reference.generate(PROMPT, max_new_tokens=6, **penalties).token_ids
    assert expected != plain  # the penalties change the ids of this prompt
    calls = launches(monkeypatch)
    assert triton.generate(PROMPT, max_new_tokens=6, **penalties).token_ids == expected
    steps = [call[0] for call in calls if call[0] != "lm_head_logits"]
    assert steps == ["apply_penalties", "sample", "count_tokens"] * 5  # 5 decode steps after the first token


def test_a_row_mix_equals_the_reference_backend(reference, triton):
    """Greedy rows with different penalties (one with none) in one batch: the reference's ids, row by row."""
    mix = [SamplingParams(repetition_penalty=0.5), SamplingParams(), SamplingParams(presence_penalty=-2.0,
                                                                                    frequency_penalty=0.5)]
    prompts = [PROMPT, [11, 200, 3, 47, 150], [9, 9, 9, 1]]
    expected = [r.token_ids for r in reference.generate(prompts, max_new_tokens=5, sampling_params=mix)]
    assert [r.token_ids for r in triton.generate(prompts, max_new_tokens=5, sampling_params=mix)] == expected
    assert expected[1] == reference.generate(prompts[1], max_new_tokens=5).token_ids


def test_sampled_rows_with_penalties_and_min_p_draw_as_one_at_a_time(triton):
    """Sampled rows (top-k with a repetition penalty, min-p, presence penalty) in one batch draw what each draws
    alone: the draws are a function of the seed and the row's step, reproducible."""
    mix = [SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.3, seed=3),
           SamplingParams(temperature=1.0, min_p=0.2, seed=4), SamplingParams(presence_penalty=1.0)]
    prompts = [PROMPT, [11, 200, 3, 47, 150], [9, 9, 9, 1]]
    together = [r.token_ids for r in triton.generate(prompts, max_new_tokens=3, sampling_params=mix)]
    alone = [triton.generate(p, max_new_tokens=3, sampling_params=s).token_ids for p, s in zip(prompts, mix)]
    assert together == alone


def test_choose_first_needs_the_prompt_when_penalized(triton):
    sampling = DeviceSampling.build([SamplingParams(repetition_penalty=1.5)], triton.device)
    with pytest.raises(ValueError, match="prompt_ids"):
        triton.model.choose_first_rows(torch.zeros(1, triton.config.vocab_size), sampling)
    with pytest.raises(ValueError, match="slots: 2 for 1 rows"):
        triton.model.choose_first_rows(torch.zeros(1, triton.config.vocab_size), sampling, [torch.tensor([1, 2])],
                                       slots=[0, 1])


# ---- GPU: the real shape, the penalized modes inside CUDA graphs ----------------------------------------------

def _real_model(**options):
    from qwen_triton.benchmark.models import random_llm

    return random_llm("0.8b", backend="triton", dtype=torch.bfloat16, max_length=512, **options)


GPU_MIX = [SamplingParams(repetition_penalty=1.3), SamplingParams(temperature=0.8, top_k=40, top_p=0.9,
                                                                   presence_penalty=0.5, seed=2),
           SamplingParams(temperature=1.0, min_p=0.05, frequency_penalty=0.3, seed=3)]


@pytest.mark.gpu
def test_gpu_penalized_steps_replay_from_cuda_graphs_as_eager_steps():
    """The counts advance inside the graph (and the warm-up before capture leaves them as they were): graph and
    eager steps, run ahead of the host or not, give the same ids; a batch gives what its rows give alone."""
    prompts = [[5, 6, 7, 8], list(range(100, 140)), [9] * 17]
    results = {}
    for cuda_graph in (True, False):
        llm = _real_model(cuda_graph=cuda_graph)
        for ahead in (True, False):
            llm.run_ahead = ahead
            results[cuda_graph, ahead] = [r.token_ids for r in llm.generate(prompts, max_new_tokens=32,
                                                                              sampling_params=GPU_MIX)]
        alone = [llm.generate(p, max_new_tokens=32, sampling_params=s).token_ids for p, s in zip(prompts, GPU_MIX)]
        assert alone == results[cuda_graph, True]
    assert len(set(map(str, results.values()))) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("penalties", PENALTIES)
def test_gpu_greedy_penalties_equal_the_reference_backend(directory, reference, penalties):
    """The CPU test's tiny config on the GPU in float32, through the CUDA graphs of the penalized mode."""
    llm = LLM(directory, backend="triton", device="cuda", dtype=torch.float32, max_length=32, max_batch=4)
    expected = reference.generate(PROMPT, max_new_tokens=6, **penalties).token_ids
    assert llm.generate(PROMPT, max_new_tokens=6, **penalties).token_ids == expected
