"""The public API: LLM(...).score and .generate on the reference backend, and its errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qwen_triton import LLM
from qwen_triton.engine.sampling import SamplingParams, penalize, token_counts
from tests.support import small_config, write_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    directory = write_checkpoint(tmp_path_factory.mktemp("model"), small_config(), seed=7)
    return LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=48)


def test_score_shape_and_dtype(llm):
    logits = llm.score([1, 2, 3, 4, 5], prefill=2)
    assert logits.shape == (5, llm.config.vocab_size) and logits.dtype == torch.float32


def test_greedy_generate_follows_the_argmax_of_score(llm):
    prompt = [5, 17, 42, 9]
    result = llm.generate(prompt, max_new_tokens=6)
    assert result.prompt_token_ids == prompt
    assert 1 <= len(result.token_ids) <= 6
    sequence = prompt + result.token_ids
    logits = llm.score(sequence, prefill=len(prompt))
    expected = logits[len(prompt) - 1:-1].argmax(-1).tolist() if result.finish_reason == "length" else None
    if expected is not None:
        assert result.token_ids == expected
    else:  # stopped at an end-of-turn id: every kept token was still the argmax
        assert result.token_ids == logits[len(prompt) - 1:len(sequence) - 1].argmax(-1).tolist()


def test_list_of_prompts_gives_list_of_results_in_order(llm):
    results = llm.generate([[1, 2, 3], [7, 8]], max_new_tokens=3)
    assert [r.prompt_token_ids for r in results] == [[1, 2, 3], [7, 8]]
    assert results[1].token_ids == llm.generate([7, 8], max_new_tokens=3).token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm):
    runs = [llm.generate([3, 4], max_new_tokens=8, temperature=1.5, seed=s).token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_top_k_one_is_greedy(llm):
    greedy = llm.generate([3, 4], max_new_tokens=5).token_ids
    assert llm.generate([3, 4], max_new_tokens=5, temperature=0.8, top_k=1, seed=4).token_ids == greedy


def test_greedy_generate_with_penalties_follows_the_argmax_of_the_penalised_score(llm):
    prompt = [5, 17, 42, 9, 42]
    params = SamplingParams(repetition_penalty=1.8, presence_penalty=0.6, frequency_penalty=0.4)
    result = llm.generate(prompt, max_new_tokens=6, sampling_params=params)
    assert result.token_ids == llm.generate(prompt, max_new_tokens=6, repetition_penalty=1.8, presence_penalty=0.6,
                                            frequency_penalty=0.4).token_ids
    sequence = prompt + result.token_ids
    logits = llm.score(sequence, prefill=len(prompt))
    vocab = logits.shape[-1]
    prompt_mask = token_counts(prompt, vocab) > 0
    for index, token in enumerate(result.token_ids):
        counts = token_counts(result.token_ids[:index], vocab)
        assert token == int(penalize(logits[len(prompt) - 1 + index], params, counts, prompt_mask).argmax())


def test_sampling_params_per_prompt(llm):
    prompts = [[3, 4], [7, 8, 9]]
    rows = [SamplingParams(temperature=1.5, seed=1, min_p=0.05), SamplingParams(repetition_penalty=1.3)]
    results = llm.generate(prompts, max_new_tokens=4, sampling_params=rows)
    assert [r.token_ids for r in results] == [llm.generate(p, max_new_tokens=4, sampling_params=s).token_ids
                                              for p, s in zip(prompts, rows)]


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda m: m.generate([], max_new_tokens=2), "empty"),
        (lambda m: m.generate("", max_new_tokens=2), "empty"),
        (lambda m: m.generate([1, 99999], max_new_tokens=2), "99999.*outside the vocabulary"),
        (lambda m: m.generate([-1], max_new_tokens=2), "outside the vocabulary"),
        (lambda m: m.generate(list(range(49)), max_new_tokens=2), "49 tokens.*maximum length 48"),
        (lambda m: m.generate([1], max_new_tokens=0), "max_new_tokens"),
        (lambda m: m.generate([1], temperature=-1.0), "temperature"),
        (lambda m: m.generate([1], top_p=0.0), "top_p"),
        (lambda m: m.generate([1], min_p=1.5), "min_p"),
        (lambda m: m.generate([1], presence_penalty=3.0), "presence_penalty"),
        (lambda m: m.generate([1], frequency_penalty=-2.5), "frequency_penalty"),
        (lambda m: m.generate([1], repetition_penalty=0.0), "repetition_penalty"),
        (lambda m: list(m.stream([1], repetition_penalty=-1.0)), "repetition_penalty"),
        (lambda m: m.generate([[1], [2]], sampling_params=[SamplingParams()]), "sampling_params"),
        (lambda m: m.generate([1], top_k=3, sampling_params=SamplingParams()), "leave top_k"),
        (lambda m: m.score([1, 2], prefill=3), "prefill"),
    ],
)
def test_bad_input_raises_value_error_naming_it(llm, call, message):
    with pytest.raises(ValueError, match=message):
        call(llm)


def test_bad_constructor_arguments(tmp_path):
    directory = write_checkpoint(tmp_path, small_config())
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        LLM(directory, backend="jax")
    with pytest.raises(ValueError, match="unsupported dtype"):
        LLM(directory, dtype="int8")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA GPU"):
            LLM(directory, device="cuda")


def test_nan_logits_are_reported_not_sampled(llm):
    weights = llm.model.w
    saved = weights["norm.weight"].clone()
    weights["norm.weight"].fill_(float("nan"))
    try:
        with pytest.raises(RuntimeError, match="NaN"):
            llm.generate([1, 2], max_new_tokens=2)
    finally:
        weights["norm.weight"].copy_(saved)


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory):
    """The tiny preset: the real vocabulary, so chat templates tokenise inside it."""
    from qwen_triton.checkpoint import make_preset_checkpoint

    directory = make_preset_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), seed=2)
    return LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=64)


def test_chat_renders_the_template_and_generates(chat_llm):
    llm = chat_llm
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = llm.chat(messages, max_new_tokens=4)
    assert reply.prompt_token_ids == llm.tokenizer.encode(prompt)
    assert reply.token_ids == llm.generate(prompt, max_new_tokens=4).token_ids
    replies = llm.chat([messages, messages[1:]], max_new_tokens=3, chat_template_kwargs={"enable_thinking": False})
    assert isinstance(replies, list) and len(replies) == 2
    unthinking = llm.tokenizer.apply_chat_template(messages[1:], add_generation_prompt=True, enable_thinking=False)
    assert unthinking.endswith("<think>\n\n</think>\n\n")
    assert replies[1].prompt_token_ids == llm.tokenizer.encode(unthinking)


@pytest.mark.parametrize("messages, message", [
    ([], "no messages"),
    ([[]], "conversation is empty"),
    ([{"role": "user"}], "must be a dict with 'role' and 'content'"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
])
def test_chat_refuses_bad_messages(chat_llm, messages, message):
    with pytest.raises(ValueError, match=message):
        chat_llm.chat(messages)


def test_defaults_match_the_command_line(tmp_path):
    """LLM(path) picks what `qwen-triton generate` picks: triton in bf16 on a GPU, the reference in float32
    on a CPU."""
    directory = write_checkpoint(tmp_path, small_config())
    llm = LLM(directory, max_length=16)
    if torch.cuda.is_available():
        assert (llm.backend_name, llm.device.type, llm.dtype) == ("triton", "cuda", torch.bfloat16)
    else:
        assert (llm.backend_name, llm.device.type, llm.dtype) == ("reference", "cpu", torch.float32)


TRITON_ON_THE_CPU = """
import json, os, sys, warnings
{prelude}
from qwen_triton import LLM
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        llm = LLM({path!r}, backend="triton", device="cpu", max_length=32)
    except RuntimeError as error:
        print(json.dumps({{"error": str(error)}}))
        sys.exit(0)
ids = llm.generate([5, 17, 42], max_new_tokens=3).token_ids
print(json.dumps({{"interpret": os.environ.get("TRITON_INTERPRET"), "ids": ids,
                   "warnings": [str(w.message) for w in caught]}}))
"""


@pytest.mark.slow
def test_the_triton_backend_on_a_cpu_sets_up_the_interpreter(tmp_path):
    """Without TRITON_INTERPRET, backend="triton" on a CPU turns the interpreter on (saying so) when the kernels
    are not imported yet, and otherwise says in one line how to."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's interpreter path")
    directory = write_checkpoint(tmp_path, small_config(), seed=7)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)

    def run(prelude):
        script = TRITON_ON_THE_CPU.format(prelude=prelude, path=str(directory))
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                                timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    fresh = run("")
    assert fresh["interpret"] == "1"
    assert any("under Triton's interpreter" in w for w in fresh["warnings"])
    reference = LLM(directory, backend="reference", device="cpu", dtype=torch.float32, max_length=32)
    assert fresh["ids"] == reference.generate([5, 17, 42], max_new_tokens=3).token_ids
    late = run("import qwen_triton.operators.embedding")
    assert "set TRITON_INTERPRET=1 before importing qwen_triton" in late["error"]


def test_chat_passes_the_penalties_and_min_p_on(chat_llm):
    messages = [{"role": "user", "content": "Hi"}]
    prompt = chat_llm.chat_prompt(messages)
    sampling = dict(min_p=0.1, temperature=0.7, seed=5, repetition_penalty=1.5, presence_penalty=0.5)
    assert (chat_llm.chat(messages, max_new_tokens=3, **sampling).token_ids
            == chat_llm.generate(prompt, max_new_tokens=3, **sampling).token_ids)
    with pytest.raises(ValueError, match="frequency_penalty"):
        chat_llm.chat(messages, frequency_penalty=9.0)


def test_a_stop_string_across_tokens_ends_the_text_and_the_stream_before_it(llm):
    """A stop string made of the end of one token's text and the start of the next: neither generate's text nor
    the streamed pieces keep its first part (streaming holds back what could begin a stop string)."""
    prompt = [5, 17, 42, 9]
    plain = llm.generate(prompt, max_new_tokens=12)
    pieces = [llm.tokenizer.decode([token]) for token in plain.token_ids]
    # the first boundary between two tokens whose texts are plain characters on both sides
    boundary = next((i for i in range(1, len(pieces)) if len(pieces[i - 1].strip()) >= 1 and len(pieces[i].strip()) >= 1
                     and "\ufffd" not in pieces[i - 1] + pieces[i]), None)
    if boundary is None:
        pytest.skip("the random model's text has no boundary between two plain tokens")
    before = "".join(pieces[:boundary])
    stop = pieces[boundary - 1][-1] + pieces[boundary][0]
    expected = (before + pieces[boundary])[:(before + pieces[boundary]).index(stop)]
    result = llm.generate(prompt, max_new_tokens=12, stop=[stop])
    assert result.text == expected and result.finish_reason == "stop"
    streamed = "".join(llm.stream(prompt, max_new_tokens=12, stop=[stop]))
    assert streamed == expected == llm.last_generation.text


def test_held_back_is_the_longest_ending_that_begins_a_stop_string():
    from qwen_triton.engine.llm import held_back

    assert held_back("abc de", ["def"]) == 2 and held_back("abc d", ["def", "xd"]) == 1
    assert held_back("abc", ["def"]) == 0 and held_back("", ["def"]) == 0 and held_back("abc", []) == 0
    assert held_back("abcde", ["cdef", "de!"]) == 3  # the longest of the candidates


def test_stop_in_ending_searches_only_what_new_text_can_complete():
    from qwen_triton.engine.llm import stop_in_ending

    # "cde" completed by the new "de" (checked: the first 3 characters, "abc", were searched before)
    assert stop_in_ending("abcdef", 3, ["cde"]) == 2
    assert stop_in_ending("abcdef", 3, ["xyz", "ef", "cd"]) == 2  # the earliest of several
    assert stop_in_ending("abcdef", 6, ["cde"]) is None  # nothing new: nothing to find
    # an occurrence wholly inside the part already searched is not looked for again (it cannot be there)
    assert stop_in_ending("abcdef", 4, ["ab"]) is None and stop_in_ending("abcdef", 0, ["ab"]) == 0
    # a stop string longer than the text so far, or one reaching back to the very start
    assert stop_in_ending("ab", 1, ["abc"]) is None and stop_in_ending("abc", 1, ["abc"]) == 0
