"""`qwen-triton serve --replicas 2` on the CPU: two replicas of the tiny model under one local Ray instance (started
once, by the command, for the module), behind Ray Serve's HTTP proxy. The official `openai` client's requests are
answered by both replicas (their header and their metrics name them) with what LLM gives; streaming works through
the proxy; the app's errors come through unchanged; a replica whose process is killed mid-stream ends that stream
with an OpenAI-format error event (not a hang, not a broken connection), the other replica answers what follows,
and Ray brings the killed one back; a replica whose engine stops reports unhealthy and Ray replaces it;
SIGTERM lets a stream in flight finish and exits 0.

The test process joins the command's Ray instance (its address is in the command's log) only to look at the
replicas: their processes' ids and Serve's status."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from qwen_triton.server.ray_app import APPLICATION_NAME, DEPLOYMENT_NAME, REPLICA_HEADER  # noqa: E402
from tests.server.conftest import MAX_LENGTH  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Once upon a time"
pytestmark = pytest.mark.slow


class Command:
    """`qwen-triton serve --replicas 2` in a process of its own: its URL and Ray's address once it serves."""

    def __init__(self, checkpoint, log: Path, *extra: str):
        self.log = log
        self.process = subprocess.Popen(
            [sys.executable, "-m", "qwen_triton.cli", "serve", "--model", str(checkpoint), "--replicas", "2",
             "--port", "0", "--max-length", str(MAX_LENGTH), "--max-num-seqs", "4", "--max-queue", "32",
             "--prefill-chunk", "16", "--drain-timeout", "5", "--served-model-name", "tiny", *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                 # Ray's token (its default) would need this process to switch Ray's settings to a token before
                 # joining, which Ray offers only through private calls: the test's instance checks none
                 "RAY_AUTH_MODE": "disabled"})
        deadline = time.monotonic() + 240
        pattern = r"serving tiny at (http://127\.0\.0\.1:\d+)/v1 .*Ray at (\S+?)\)"
        while not (found := re.search(pattern, log.read_text())):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise AssertionError(f"the replicas did not start:\n{log.read_text()[-5000:]}")
            time.sleep(0.2)
        self.url, self.ray_address = found.groups()

    def stop(self) -> None:
        """SIGTERM (the command then shuts down the Ray instance it started), SIGKILL if that does not end it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="module")
def command(checkpoint, tmp_path_factory):
    started = time.monotonic()
    command = Command(checkpoint, tmp_path_factory.mktemp("ray") / "serve.log")
    print(f"\nthe command served after {time.monotonic() - started:.1f} s")
    try:
        ray.init(address=command.ray_address, log_to_driver=False, logging_level="error")
        yield command
    finally:  # whatever failed: the command (and the Ray instance it started) must not outlive the module
        ray.shutdown()
        command.stop()


@pytest.fixture(scope="module")
def client(command):
    return openai.OpenAI(base_url=command.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def replicas() -> dict[str, ray.actor.ActorHandle]:
    """The replicas alive now, by name (their REPLICA_HEADER)."""
    prefix = f"SERVE_REPLICA::{APPLICATION_NAME}#{DEPLOYMENT_NAME}#"
    return {entry["name"].removeprefix(prefix): ray.get_actor(entry["name"], namespace=entry["namespace"])
            for entry in ray.util.list_named_actors(all_namespaces=True) if entry["name"].startswith(prefix)}


def in_replica(name: str, function):
    """function(), run in the process of the replica `name`."""
    return ray.get(replicas()[name].__ray_call__.remote(lambda actor: function()), timeout=30)


def serving(name: str) -> bool:
    """Whether the replica `name` has loaded its model and built its app."""
    try:
        return in_replica(name, lambda: getattr(serve.get_replica_context().servable_object, "health", None)
                          is not None)
    except Exception:  # not yet started, or gone
        return False


def wait_for_two_replicas_without(gone: str, timeout: float = 120) -> set[str]:
    """Wait until 2 replicas serve, `gone` not among them, and Serve reports them healthy; their names. (Serve's
    status lags a death by seconds, so the replicas themselves are asked.)"""
    deadline = time.monotonic() + timeout
    while True:
        names = set(replicas())
        if gone not in names and len(names) == 2 and all(serving(name) for name in names):
            status = serve.status().applications[APPLICATION_NAME].deployments[DEPLOYMENT_NAME]
            if status.status == "HEALTHY" and status.replica_states == {"RUNNING": 2}:
                return names
        assert time.monotonic() < deadline, f"Ray did not bring 2 replicas back: {names}"
        time.sleep(0.5)


def complete(client, prompt=PROMPT, max_tokens=6):
    """A greedy completion and the replica that answered it."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                      temperature=0)
    return raw.parse(), raw.headers[REPLICA_HEADER]


def test_both_replicas_answer_with_what_llm_gives(command, client, oracle):
    answered = {}
    for i in range(40):  # the proxy picks between the two at random: both answer within a few requests
        prompt = f"{PROMPT} {i}"
        response, replica = complete(client, prompt)
        answered[replica] = answered.get(replica, 0) + 1
        assert response.choices[0].text == oracle.generate(prompt, max_new_tokens=6).text
        assert response.usage.completion_tokens == 6
        if len(answered) == 2 and i >= 5:
            break
    assert set(answered) == set(replicas()) and len(answered) == 2, answered


def test_streaming_through_the_proxy_concatenates_to_the_unstreamed_text(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # it came in pieces
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24


def test_the_apps_errors_metrics_and_routes_come_through_the_proxy(command, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=-1)
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    assert unknown.value.body["code"] == "model_not_found"
    missing = httpx.get(command.url + "/v1/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert REPLICA_HEADER in missing.headers
    assert [model.id for model in client.models.list().data] == ["tiny"]
    for _ in range(10):
        metrics = httpx.get(command.url + "/metrics")
        name = metrics.headers[REPLICA_HEADER]
        assert f'qwen_triton_replica_info{{replica="{name}",' in metrics.text
        assert "qwen_triton_requests_total" in metrics.text


def test_a_replica_killed_mid_stream_ends_it_with_an_error_and_ray_brings_it_back(command, client):
    stream = client.completions.with_streaming_response.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_LENGTH - 8, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    with stream as response:
        victim = response.headers[REPLICA_HEADER]
        chunks = iter(response.parse())
        first = [next(chunks) for _ in range(3)]
        assert all(chunk.choices[0].text is not None for chunk in first)
        os.kill(in_replica(victim, os.getpid), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as failed:  # the error event: not a hang, not a cut connection
            for _ in chunks:
                pass
    assert failed.value.body["code"] == "replica_failed"
    assert time.monotonic() - started < 30
    survivors = set()
    for i in range(4):  # while Ray replaces it, the other replica answers
        response, replica = complete(client, f"after the kill {i}")
        assert response.choices[0].finish_reason == "length"
        survivors.add(replica)
    assert victim not in survivors
    names = wait_for_two_replicas_without(victim)
    assert len(names - survivors) == 1  # a new replica


def test_a_replica_whose_engine_stops_is_unhealthy_and_replaced(command, client):
    (victim, *_) = sorted(replicas())

    def stop_the_engine():
        serve.get_replica_context().servable_object.health.scheduler.stop()

    in_replica(victim, stop_the_engine)
    with pytest.raises(RuntimeError, match="engine is not running"):
        in_replica(victim, lambda: serve.get_replica_context().servable_object.check_health())
    # Ray's next health check finds it unhealthy, stops it and starts another in its place (whose loading the
    # test above has already seen through to the end)
    deadline = time.monotonic() + 60
    while victim in (names := set(replicas())) or len(names) != 2:
        assert time.monotonic() < deadline, f"Ray did not replace the replica {victim}: {names}"
        time.sleep(0.2)
    for i in range(3):
        response, replica = complete(client, f"after the engine stopped {i}")
        assert response.choices[0].finish_reason == "length" and replica != victim


def test_sigterm_lets_a_stream_finish_and_exits_0(command, client):
    # (ids are counted by the usage: a lagging HTTP side sends several in one chunk, D145)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    ray.shutdown()  # the test's own connection, before the instance goes
    command.process.send_signal(signal.SIGTERM)
    rest = list(stream)
    assert rest[-1].usage.completion_tokens == 20 and rest[-2].choices[0].finish_reason == "length"
    assert command.process.wait(timeout=60) == 0, command.log.read_text()[-3000:]
    assert "qwen-triton: stopped" in command.log.read_text()
