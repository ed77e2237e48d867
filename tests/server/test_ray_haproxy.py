"""`qwen-triton serve --replicas 2 --proxy haproxy` on the CPU: Ray Serve's HAProxy in front of the two replicas'
own HTTP servers (server/ray_app.py, haproxy_environment). Both replicas answer the official `openai` client with
what LLM gives, a stream comes through whole, the app's errors come through, a killed replica's requests go to
the other while Ray brings it back, and SIGTERM stops HAProxy with the rest and exits 0.

Opt-in (QWEN_TRITON_TEST_HAPROXY=1): Ray's HAProxy binds its metrics and stats ports on every interface (its
template gives no host), and the suite's servers listen on 127.0.0.1 only. Run where that is allowed:
`QWEN_TRITON_TEST_HAPROXY=1 python -m pytest -q tests/server/test_ray_haproxy.py` (docs/decisions.md, D175)."""

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")

from qwen_triton.server.ray_app import REPLICA_HEADER  # noqa: E402
from tests.server.test_ray_serve import PROMPT, Command, in_replica, wait_for_two_replicas_without  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("QWEN_TRITON_TEST_HAPROXY") != "1",
    reason="HAProxy binds its metrics and stats ports on every interface: set QWEN_TRITON_TEST_HAPROXY=1")]


def haproxy_processes() -> set[int]:
    found = subprocess.run(["pgrep", "-x", "haproxy"], capture_output=True, text=True).stdout.split()
    return {int(pid) for pid in found}


@pytest.fixture(scope="module")
def command(checkpoint, tmp_path_factory):
    before = haproxy_processes()
    command = Command(checkpoint, tmp_path_factory.mktemp("haproxy") / "serve.log", "--proxy", "haproxy")
    command.haproxy = haproxy_processes() - before
    try:
        ray.init(address=command.ray_address, log_to_driver=False, logging_level="error")
        yield command
    finally:
        ray.shutdown()
        command.stop()


@pytest.fixture(scope="module")
def client(command):
    return openai.OpenAI(base_url=command.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_haproxy_fronts_both_replicas_with_what_llm_gives(command, client, oracle):
    assert command.haproxy, "no HAProxy process started"
    assert "through HAProxy" in command.log.read_text()
    answered = {}
    for i in range(40):  # least connections between two idle replicas: both answer within a few requests
        prompt = f"{PROMPT} {i}"
        raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        replica = raw.headers[REPLICA_HEADER]
        answered[replica] = answered.get(replica, 0) + 1
        assert raw.parse().choices[0].text == oracle.generate(prompt, max_new_tokens=6).text
        if len(answered) == 2 and i >= 5:
            break
    assert len(answered) == 2, answered


def test_a_stream_and_the_apps_errors_come_through_haproxy(command, client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert len(chunks) > 2
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    missing = httpx.get(command.url + "/v1/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_killed_replicas_requests_go_to_the_other_and_ray_brings_it_back(command, client):
    victim = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                                         temperature=0).headers[REPLICA_HEADER]
    os.kill(in_replica(victim, os.getpid), signal.SIGKILL)
    answered, failed = set(), 0
    deadline = time.monotonic() + 60
    while len(answered) < 4:  # HAProxy's checks mark the dead replica down; until then a request may fail
        assert time.monotonic() < deadline, f"no replica answered after the kill ({failed} failures)"
        try:
            raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0)
            answered.add((raw.headers[REPLICA_HEADER], len(answered)))
        except openai.APIError:
            failed += 1
            time.sleep(0.5)
    print(f"\nafter the kill: {failed} requests failed before HAProxy sent them to the other replica")
    assert victim not in {name for name, _ in answered}
    assert failed <= 3, failed
    wait_for_two_replicas_without(victim)


def test_sigterm_stops_haproxy_and_exits_0(command):
    command.process.terminate()
    assert command.process.wait(timeout=90) == 0
    deadline = time.monotonic() + 30
    while command.haproxy & haproxy_processes():
        assert time.monotonic() < deadline, f"HAProxy {command.haproxy} outlived the command"
        time.sleep(0.5)
