"""On a GPU: the server on the triton backend at the 0.8B shape (random weights), its ids chosen on the device.
Requests sent together (greedy, seeded with Qwen's sampling, one with a penalty, one asking for log-probabilities, one
prompt longer than a prefill chunk) give what each gives sent alone, one after the other; the greedy ones what
LLM.generate gives each prompt."""

import asyncio

import openai
import pytest

pytestmark = pytest.mark.gpu

QWEN_SAMPLING = dict(temperature=0.7, top_p=0.8, extra_body={"top_k": 20})


def requests() -> list[dict]:
    """12 completions: prompts of 64 to 700 ids (one past the 512-token chunk), greedy and sampled alternately."""
    out = []
    for row in range(12):
        length = 700 if row == 5 else 64 + 40 * row
        prompt = [(37 * i + 11 * row) % 200_000 + 1_000 for i in range(length)]
        settings = dict(temperature=0) if row % 2 == 0 else dict(QWEN_SAMPLING, seed=row)
        if row == 3:
            settings = dict(settings, presence_penalty=1.5)
        if row == 4:
            settings = dict(settings, logprobs=2)
        out.append(dict(model="random", prompt=prompt, max_tokens=32, **settings))
    return out


def test_requests_together_equal_requests_alone_at_the_real_shape():
    from qwen_triton.benchmark.models import random_llm
    from qwen_triton.server.app import create_app
    from qwen_triton.server.runner import BackgroundServer

    llm = random_llm("0.8b", max_length=1024, max_batch=16)
    bodies = requests()
    greedy_short = [i for i, b in enumerate(bodies) if b.get("temperature") == 0 and len(b["prompt"]) <= 512]
    expected = {i: llm.generate(bodies[i]["prompt"], max_new_tokens=32).text for i in greedy_short}

    async def send(url, together: bool):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            calls = [client.completions.create(**body) for body in bodies]
            responses = await asyncio.gather(*calls) if together else [await call for call in calls]
        return [(r.choices[0].text, r.choices[0].logprobs) for r in responses]

    with BackgroundServer(create_app(llm, model_name="random", prefill_chunk=512)) as server:
        alone = asyncio.run(send(server.url, together=False))
        together = asyncio.run(send(server.url, together=True))
        statistics = server.app.state.scheduler.statistics
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert {i: together[i][0] for i in greedy_short} == expected
    logprobs_together, logprobs_alone = together[4][1], alone[4][1]
    assert len(logprobs_together.tokens) == 32
    assert logprobs_together.token_logprobs == pytest.approx(logprobs_alone.token_logprobs, abs=1e-3)
    assert statistics.largest_decode_batch > 1 and statistics.failed == 0
