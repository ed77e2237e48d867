"""A server of 2 slots and 1 place in the queue: a request that does not fit gets 429, a client that goes away
mid-stream (or mid-wait) has its sequences aborted and their slots freed, a stopping server answers 503; after
each the server serves the next request."""

import json

import httpx
import openai
import pytest

from tests.server.conftest import start_server

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
SHORT = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def small(checkpoint):
    server = start_server(checkpoint, max_num_seqs=2, max_queue=1)
    yield server
    server.stop()


def events(response):
    """The JSON payloads of a stream's server-sent events, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def requests_total(url: str, outcome: str) -> int:
    prefix = f'qwen_triton_requests_total{{outcome="{outcome}"}}'
    line = next((l for l in httpx.get(url + "/metrics").text.splitlines() if l.startswith(prefix)), "x 0")
    return int(float(line.split()[-1]))


def assert_serves(url: str):
    response = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def test_a_full_queue_is_429_and_the_server_serves_again_after(small):
    scheduler = small.app.state.scheduler
    with httpx.Client(base_url=small.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 3, "stream": True}) as stream:
            received = events(stream)  # (kept: a generator dropped mid-stream closes the response)
            next(received)  # 3 sequences in flight: both slots and the queue's one place
            response = http.post("/v1/completions", json=SHORT)
            assert response.status_code == 429
            error = response.json()["error"]
            assert (error["type"], error["code"]) == ("rate_limit_error", "queue_full")
            assert "retry later" in error["message"]
            client = openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
        assert scheduler.wait_until_idle(10)  # leaving the stream aborted its three sequences
    assert requests_total(small.url, "rejected") == 2
    assert_serves(small.url)


def test_a_client_gone_mid_stream_frees_its_slot(small):
    scheduler = small.app.state.scheduler
    aborted_before = scheduler.statistics.aborted
    with httpx.Client(base_url=small.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            received = events(stream)
            next(received), next(received)
            assert scheduler.running == 1
            (running,) = scheduler.decoding
    assert scheduler.wait_until_idle(10)
    assert scheduler.statistics.aborted == aborted_before + 1
    assert len(running.generated) < 200 and running.slot is None
    assert sorted(scheduler.free_slots) == [0, 1]
    assert requests_total(small.url, "aborted") >= 1
    assert_serves(small.url)


def test_a_client_gone_while_waiting_for_a_whole_response_frees_its_slot(small):
    scheduler = small.app.state.scheduler
    aborted_before = scheduler.statistics.aborted
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(small.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=0.5))
    assert scheduler.wait_until_idle(10)
    assert scheduler.statistics.aborted == aborted_before + 1
    assert sorted(scheduler.free_slots) == [0, 1]
    assert_serves(small.url)


def test_a_stopping_server_is_503(checkpoint):
    server = start_server(checkpoint, max_num_seqs=1, max_queue=0)
    try:
        assert_serves(server.url)
        server.app.state.scheduler.stop_admitting()
        response = httpx.post(server.url + "/v1/completions", json=SHORT)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "shutting_down"
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        server.stop()
