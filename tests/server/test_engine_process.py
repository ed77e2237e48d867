"""The engine in a process of its own (server/engine_process.py), where it differs from the engine on a thread:
the HTTP side counts what is in flight (a full queue is 429, a client gone leaves the count at once and the engine
frees its slot), the engine's metrics and statistics are fetched from its process, an engine that fails to start
says why, and an engine process that dies ends every request in flight with an error and the server answers 503
until it is restarted. (The API's and the errors' tests run against both engines: conftest.py.)"""

import json
import time

import httpx
import pytest

from qwen_triton.server.engine_process import EngineProcess
from tests.server.conftest import start_server

LONG = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
SHORT = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}


def events(response):
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def serves(url: str) -> bool:
    response = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
    return response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2


def eventually(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture(scope="module")
def small(checkpoint):
    server = start_server(checkpoint, max_num_seqs=2, engine="process", max_queue=1)
    yield server
    server.stop()


def test_a_full_queue_is_429_and_a_client_gone_frees_its_slots(small):
    engine = small.app.state.scheduler
    aborted_before = engine.statistics.aborted
    with httpx.Client(base_url=small.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json={**LONG, "n": 3, "stream": True}) as stream:
            received = events(stream)
            next(received)  # 3 sequences in flight: both slots and the queue's one place
            # (its outputs leave before the step is counted: the counts below, not the steps)
            assert engine.statistics.prefill_chunks >= 2 and engine.running == 2 and engine.waiting_count == 1
            response = http.post("/v1/completions", json=SHORT)
            assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"
    assert engine.wait_until_idle(10)  # the HTTP side's count: at once
    # the engine's: the three aborted and their slots freed by its next step
    assert eventually(lambda: engine.statistics.aborted == aborted_before + 3 and engine.running == 0)
    assert serves(small.url)
    assert engine.statistics.aborted == aborted_before + 3


def test_the_metrics_are_the_engines(small):
    assert serves(small.url)
    engine_steps = small.app.state.scheduler.statistics.steps
    text = httpx.get(small.url + "/metrics").text
    steps = int(next(line for line in text.splitlines() if line.startswith("qwen_triton_steps_total")).split()[-1])
    assert steps >= engine_steps > 0
    first = next(line for line in text.splitlines() if line.startswith("qwen_triton_time_to_first_token_seconds_count"))
    assert int(first.split()[-1]) >= 1


def fail_to_build():
    raise ValueError("no such weights here")


def test_an_engine_that_fails_to_start_says_why():
    engine = EngineProcess(fail_to_build, max_num_seqs=1)
    with pytest.raises(RuntimeError, match="the engine failed to start: ValueError: no such weights here"):
        engine.start(timeout=60)
    assert not engine.alive


def test_an_engine_process_that_dies_ends_the_requests_in_flight_with_an_error(checkpoint):
    server = start_server(checkpoint, max_num_seqs=2, engine="process")
    engine = server.app.state.scheduler
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
                lines = (line for line in stream.iter_lines() if line)
                assert json.loads(next(lines)[6:])["choices"]
                engine.process.kill()
                rest = list(lines)
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][6:])["error"]
            assert error["code"] == "engine_error" and "engine process stopped unexpectedly" in error["message"]
            assert http.get("/health").status_code == 503
            response = http.post("/v1/completions", json=SHORT)
            assert response.status_code == 503 and "engine process stopped" in response.json()["error"]["message"]
            assert http.get("/metrics").status_code == 200
    finally:
        server.stop()
