"""The OpenAI API through the official `openai` client, sync and async, against the tiny model: completions and
chat equal what LLM gives for the same request, streamed text concatenates to the unstreamed text, usage counts
are exact, stop strings and stop ids end a choice where they should, n > 1 and logprobs, concurrent requests
decode together and each equals its result when sent alone, and a long prompt is prefilled in chunks while
another stream keeps decoding."""

import asyncio
import gc
import json
import math

import httpx
import openai
import pytest
import torch

from tests.server.conftest import MAX_LENGTH

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ids_until(tokenizer, token_ids, stop):
    """How many ids it takes for the text to contain `stop`."""
    return next(k for k in range(1, len(token_ids) + 1) if stop in tokenizer.decode(token_ids[:k], True))


def test_models_health_and_metrics(server, client):
    assert [model.id for model in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_total", "prompt_tokens_total", "generation_tokens_total", "running_sequences",
                 "waiting_sequences", "step_seconds_bucket", "time_to_first_token_seconds_bucket",
                 "queue_time_seconds_bucket", "prefill_time_seconds_bucket",
                 "time_per_output_token_seconds_bucket", "decode_batch_size_bucket", "gc_pause_seconds_bucket",
                 "engine_gc_pause_seconds_bucket"):
        assert f"qwen_triton_{name}" in text, name


def test_the_heap_of_the_start_is_frozen_and_the_collectors_pauses_counted(server):
    """server/heap.py: while the server serves, its start's heap (and, in an engine process, that process's) is
    frozen; a collection in the HTTP process is a pause in /metrics."""
    assert server.app.state.frozen_objects > 1000 and gc.get_freeze_count() > 0
    engine = server.app.state.scheduler
    if hasattr(engine, "frozen_objects"):  # the engine process froze its own
        assert engine.frozen_objects > 1000

    def pauses():
        text = httpx.get(server.url + "/metrics").text
        return int(next(line for line in text.splitlines()
                        if line.startswith("qwen_triton_gc_pause_seconds_count")).split()[-1])
    before = pauses()
    gc.collect()
    assert pauses() >= before + 1


def test_greedy_completion_equals_generate_with_exact_usage(client, oracle):
    expected = oracle.generate(PROMPT, max_new_tokens=10)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    (choice,) = response.choices
    assert (choice.text, choice.finish_reason) == (expected.text, "length")
    prompt_tokens = len(oracle.tokenizer.encode(PROMPT))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (
        prompt_tokens, 10, prompt_tokens + 10)


def test_prompts_as_ids_and_lists_of_prompts(client, oracle):
    prompts = [[5, 17, 42, 9], "Hello there", [300, 301]]
    response = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [oracle.generate(p, max_new_tokens=4).text for p in prompts]
    prompt_tokens = 4 + len(oracle.tokenizer.encode("Hello there")) + 2
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 12)


def test_seeded_sampling_equals_generate_and_n_choices_draw_apart(client, oracle):
    settings = dict(temperature=0.9, top_p=0.95, seed=5)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3,
                                         extra_body={"top_k": 50, "min_p": 0.01}, **settings)
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    expected = [oracle.generate(PROMPT, max_new_tokens=8, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01,
                                seed=5 + i).text for i in range(3)]
    assert texts == expected  # choice i draws with seed + i
    assert len(set(texts)) == 3
    assert response.usage.completion_tokens == 24


def test_penalties_reach_the_sampler(client, oracle):
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.4)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                         extra_body={"repetition_penalty": 1.3}, **penalties)
    expected = oracle.generate(PROMPT, max_new_tokens=8, repetition_penalty=1.3, **penalties).text
    assert response.choices[0].text == expected != oracle.generate(PROMPT, max_new_tokens=8).text


def test_stop_strings_cut_the_text_and_count_the_ids_up_to_the_stop(client, oracle):
    full = oracle.generate(PROMPT, max_new_tokens=24, temperature=1.0, seed=2)
    stop = full.text[len(full.text) // 2:][:3]  # three characters from the middle
    assert stop.strip(), full.text
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=2,
                                         stop=["never in this text", stop])
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert choice.text == full.text[:full.text.index(stop)]
    assert response.usage.completion_tokens == ids_until(oracle.tokenizer, full.token_ids, stop)


def test_a_stop_id_ends_the_choice_without_its_text(client, oracle):
    full = oracle.generate(PROMPT, max_new_tokens=12, temperature=1.0, seed=3)
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=3,
                                         extra_body={"stop_token_ids": [stop_id]})
    (choice,) = response.choices
    assert choice.finish_reason == "stop"
    assert choice.text == oracle.tokenizer.decode(full.token_ids[:first], True)
    assert response.usage.completion_tokens == first + 1  # the stop id is generated, and counted


def test_streamed_text_concatenates_to_the_unstreamed_text(client):
    request = dict(model="tiny", prompt="世界 🎉 and more", max_tokens=30, temperature=1.0, seed=11,
                   stop=["te déc", "\n\n"])  # spans two ids of " more more これが ... découverte découverte"
    whole = client.completions.create(**request)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].text
    assert whole.choices[0].text.endswith("découver") and "これが" in whole.choices[0].text
    assert finish == whole.choices[0].finish_reason == "stop"
    assert usage.model_dump() == whole.usage.model_dump()
    assert len(pieces) > 1


def test_logprobs_are_the_models_and_count_every_id(client, oracle):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    generated = oracle.generate(PROMPT, max_new_tokens=5).token_ids
    prompt = oracle.tokenizer.encode(PROMPT)
    expected = torch.log_softmax(oracle.score(prompt + generated)[len(prompt) - 1:-1], dim=-1)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == response.usage.completion_tokens == 5
    for row, (token, logprob, top) in enumerate(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs)):
        assert token == oracle.tokenizer.decode([generated[row]])
        assert math.isclose(logprob, float(expected[row, generated[row]]), abs_tol=1e-4)
        likeliest = [oracle.tokenizer.decode([t]) for t in expected[row].topk(3).indices.tolist()]
        assert set(top) == set(likeliest) | {token}
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_follows_the_template_and_its_switch(client, oracle):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    for switch in (None, {"enable_thinking": False}):
        expected = oracle.chat(messages, max_new_tokens=6, chat_template_kwargs=switch)
        response = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=6,
                                                  temperature=0, extra_body={"chat_template_kwargs": switch})
        (choice,) = response.choices
        assert (choice.message.role, choice.message.content) == ("assistant", expected.text)
        prompt_tokens = len(oracle.tokenizer.encode(oracle.chat_prompt(messages, switch)))
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 6)


def test_chat_streams_and_reports_logprobs(client):
    request = dict(model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "Say something"}]}],
                   max_tokens=12, temperature=1.0, seed=4, n=2, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**request)
    texts, roles, counts = {0: "", 1: ""}, set(), {0: 0, 1: 0}
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add(choice.delta.role)
            counts[choice.index] += len(choice.logprobs.content) if choice.logprobs else 0
    by_index = {c.index: c for c in whole.choices}
    assert texts == {i: by_index[i].message.content for i in (0, 1)}
    assert "assistant" in roles
    assert counts == {0: 12, 1: 12}
    entry = by_index[0].logprobs.content[0]
    assert len(entry.top_logprobs) == 2 and entry.logprob <= 0 and entry.bytes is not None
    assert whole.usage.completion_tokens == 24


def test_concurrent_requests_decode_together_and_each_equals_its_result_alone(server, scheduler):
    """16 requests at once (async client), greedy and seeded, against each sent alone: the same text; the steps
    decoded more than one sequence together."""
    prompts = [f"{word} number {i}" for i, word in enumerate(["Alpha", "Beta", "Gamma", "Delta"] * 4)]
    settings = [dict(temperature=0) if i % 2 == 0 else dict(temperature=1.0, seed=i) for i in range(16)]

    async def run(concurrently: bool):
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            calls = [client.completions.create(model="tiny", prompt=p, max_tokens=8, **s)
                     for p, s in zip(prompts, settings)]
            if concurrently:
                return [r.choices[0].text for r in await asyncio.gather(*calls)]
            return [(await call).choices[0].text for call in calls]

    def decode_rows(run_concurrently: bool):
        """The texts, and how many sequences each step of the run decoded together."""
        steps = scheduler.statistics.steps
        texts = asyncio.run(run(run_concurrently))
        recent = list(scheduler.statistics.recent)
        return texts, [step.decode_rows for step in recent[len(recent) - (scheduler.statistics.steps - steps):]]

    alone, serial_rows = decode_rows(False)
    together, concurrent_rows = decode_rows(True)
    assert together == alone
    assert max(serial_rows) == 1 and max(concurrent_rows) == scheduler.max_num_seqs == 4
    metrics = httpx.get(server.url + "/metrics").text
    one = next(line for line in metrics.splitlines() if line.startswith('qwen_triton_decode_batch_size_bucket{le="1"}'))
    count = next(line for line in metrics.splitlines() if line.startswith("qwen_triton_decode_batch_size_count"))
    assert int(one.split()[-1]) < int(count.split()[-1])  # some step decoded more than one sequence


def test_a_long_prompt_is_prefilled_in_chunks_while_another_stream_decodes(server, scheduler, oracle):
    long_prompt = [(7 * i + 3) % 5000 + 100 for i in range(70)]  # 5 chunks of at most 16 tokens
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    pieces = [next(iter(stream)).choices[0].text]
    statistics = scheduler.statistics  # (an engine process's: a copy, taken again after)
    mixed_before, chunks_before, steps_before = statistics.mixed_steps, statistics.prefill_chunks, statistics.steps
    response = client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4, temperature=0)
    statistics = scheduler.statistics
    mixed_after, chunks_after, steps_after = statistics.mixed_steps, statistics.prefill_chunks, statistics.steps
    during = list(statistics.recent)[-(steps_after - steps_before) - 1:]  # (one more: a step may end meanwhile)
    pieces += [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert response.choices[0].text == oracle.generate(long_prompt, max_new_tokens=4).text
    assert "".join(pieces) == oracle.generate(PROMPT, max_new_tokens=60).text
    assert chunks_after - chunks_before == 5
    assert mixed_after - mixed_before == 5  # each chunk in a step that also decoded the stream
    # a prompt contributes at most one chunk (16 tokens) a step
    assert max(step.prefill_tokens for step in during) == 16


def test_a_prompt_at_the_context_limit_still_gets_its_tokens(client):
    response = client.completions.create(model="tiny", prompt=[7] * (MAX_LENGTH - 3), max_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"


def test_continuous_usage_counts_the_ids_each_chunk_holds(server, oracle):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far, so a load generator
    knows how many ids each chunk holds, also where one holds several (a character split across ids)."""
    body = {"model": "tiny", "prompt": "世界 🎉 and more", "max_tokens": 12, "temperature": 1.0, "seed": 11,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    counts = [event["usage"]["completion_tokens"] for event in events if event["choices"]]
    assert counts == sorted(counts) and counts[-1] == events[-1]["usage"]["completion_tokens"] == 12
    prompt_tokens = len(oracle.tokenizer.encode(body["prompt"]))
    assert all(event["usage"]["prompt_tokens"] == prompt_tokens for event in events)
    plain = dict(body, stream_options={"include_usage": True})
    with httpx.stream("POST", server.url + "/v1/completions", json=plain, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert all(event["usage"] is None for event in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 12


def test_outputs_waiting_together_go_out_as_one_update_per_choice(checkpoint):
    """An HTTP side behind the engine merges the outputs already queued (D145): each choice's text and ids once,
    in order, the same text as one output at a time."""
    from types import SimpleNamespace

    from qwen_triton.engine.sampling import SamplingParams
    from qwen_triton.server.app import Job
    from qwen_triton.server.sequence import Sequence, SequenceOutput
    from tests.server.conftest import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer(checkpoint)
    ids = tokenizer.encode(" the quick brown fox jumps")
    aborted = []
    service = SimpleNamespace(tokenizer=tokenizer, scheduler=SimpleNamespace(abort=aborted.extend))

    async def run():
        sequences = [Sequence([1], SamplingParams(), max_tokens=len(ids), index=i) for i in range(2)]
        job = Job(service, sequences, stop=[], prompt_tokens=1)
        for position, token in enumerate(ids):  # both choices' outputs queued before the job reads any
            for sequence in sequences:
                last = position == len(ids) - 1
                job.receiver.put_nowait((sequence, SequenceOutput(token, logprob=-1.0,
                                                                  finish_reason="length" if last else None)))
        return [(choice.index, piece, len(entries), choice.finish_reason) async for choice, piece, entries
                in job.updates()], job

    updates, job = asyncio.run(run())
    text = tokenizer.decode(ids)
    assert updates == [(0, text, len(ids), "length"), (1, text, len(ids), "length")]
    assert job.outcome == "success" and job.usage().completion_tokens == 2 * len(ids) and not aborted
