"""On a GPU: the server on the triton backend at the 0.8B shape (random weights). Greedy requests sent together,
decoded in one batch over whichever slots they hold, give what LLM.generate gives each prompt alone."""

import asyncio

import openai
import pytest

pytestmark = pytest.mark.gpu


def test_concurrent_greedy_requests_equal_generate_at_the_real_shape():
    from qwen_triton.benchmark.models import random_llm
    from qwen_triton.server.app import create_app
    from qwen_triton.server.runner import BackgroundServer

    llm = random_llm("0.8b", max_length=1024, max_batch=8)
    # 64 to 288 tokens, each under one prefill chunk (512), so each prompt is prefilled as LLM.generate does it
    prompts = [[(37 * i + 11 * row) % 200_000 + 1_000 for i in range(64 + 32 * row)] for row in range(8)]
    expected = [llm.generate(prompt, max_new_tokens=32).text for prompt in prompts]

    async def together(url):
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            responses = await asyncio.gather(*[
                client.completions.create(model="random", prompt=prompt, max_tokens=32, temperature=0)
                for prompt in prompts])
        return [response.choices[0].text for response in responses]

    with BackgroundServer(create_app(llm, model_name="random", prefill_chunk=512)) as server:
        texts = asyncio.run(together(server.url))
        largest_batch = server.app.state.scheduler.statistics.largest_decode_batch
    assert texts == expected
    assert largest_batch > 1
