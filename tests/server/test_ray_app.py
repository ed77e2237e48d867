"""The pieces of the Ray Serve replicas that run without Ray: the proxy's middleware that turns what the proxy
answers itself (no response, a cut stream, plain text) into OpenAI's error format and passes a replica's responses
unchanged; the replica's header; the engine health check (a stopped engine thread, an engine stuck in a step with
sequences in flight); and the serve command's --replicas flags, checked before anything starts."""

import asyncio
import json
import threading

import pytest

pytest.importorskip("ray")

from qwen_triton.cli import main  # noqa: E402
from qwen_triton.engine.sampling import SamplingParams  # noqa: E402
from qwen_triton.server.ray_app import REPLICA_HEADER, EngineHealth, OpenAIProxyErrors, ReplicaHeader  # noqa: E402
from qwen_triton.server.scheduler import Scheduler  # noqa: E402
from qwen_triton.server.sequence import Sequence  # noqa: E402
from tests.server.conftest import load  # noqa: E402

NAMED = [(REPLICA_HEADER.encode(), b"replica-a")]


def run_asgi(app, scope=None) -> list[dict]:
    """The messages `app` sends for one GET request."""
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope or {"type": "http", "method": "GET", "path": "/"}, receive, send))
    return sent


def body_of(messages) -> bytes:
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")


def start(status, media, headers=()):
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", media), *headers]}


def proxy_app(*messages):
    """A stand-in for Ray's proxy that sends these messages and returns."""
    async def app(scope, receive, send):
        for message in messages:
            await send(message)
    return OpenAIProxyErrors(app)


def test_a_replica_that_never_answered_gives_an_openai_500():
    messages = run_asgi(proxy_app())
    assert messages[0]["status"] == 500
    error = json.loads(body_of(messages))["error"]
    assert error["code"] == "replica_failed" and error["type"] == "server_error" and "retry" in error["message"]


def test_a_stream_cut_short_ends_with_an_error_event_then_done():
    messages = run_asgi(proxy_app(start(200, b"text/event-stream", NAMED),
                                  {"type": "http.response.body", "body": b'data: {"x": 1}\n\n', "more_body": True}))
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body", "http.response.body"]
    assert messages[-1]["more_body"] is False
    events = body_of(messages).decode().split("\n\n")
    assert events[0] == 'data: {"x": 1}' and events[2] == "data: [DONE]"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "replica_failed"


@pytest.mark.parametrize("status, text, code, expected_status", [
    (503, b"Service unavailable: no replica is ready", "proxy_error", 503),
    (408, b"Request timed out after 5s.", "proxy_error", 408),
    (404, b"Path '/v1/models' not found.", "not_deployed", 503),
])
def test_the_proxys_plain_text_errors_become_openai_errors(status, text, code, expected_status):
    messages = run_asgi(proxy_app(start(status, b"text/plain; charset=utf-8"),
                                  {"type": "http.response.body", "body": text[:10], "more_body": True},
                                  {"type": "http.response.body", "body": text[10:], "more_body": False}))
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]
    assert messages[0]["status"] == expected_status
    assert dict(messages[0]["headers"])[b"content-type"] == b"application/json"
    error = json.loads(body_of(messages))["error"]
    assert error["code"] == code
    if code == "proxy_error":
        assert error["message"] == text.decode()


@pytest.mark.parametrize("status, media, body", [
    (200, b"application/json", b'{"ok": true}'),
    (400, b"application/json", b'{"error": {"message": "bad"}}'),
    (500, b"text/plain", b"a replica's own text"),
    (200, b"text/event-stream", b"data: [DONE]\n\n"),
])
def test_a_replicas_responses_pass_unchanged(status, media, body):
    original = [start(status, media, NAMED), {"type": "http.response.body", "body": body, "more_body": False}]
    assert run_asgi(proxy_app(*original)) == original


def test_the_replica_header_names_the_replica_on_every_response():
    async def app(scope, receive, send):
        await send(start(429, b"application/json"))
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    messages = run_asgi(ReplicaHeader(app, "abc123"))
    assert (REPLICA_HEADER.encode(), b"abc123") in messages[0]["headers"]
    assert (b"content-type", b"application/json") in messages[0]["headers"]


class BlockingBackend:
    """The reference backend, whose prefills wait for `release` while `block` is set: an engine stuck in a step."""

    def __init__(self, backend):
        self.backend, self.block, self.release = backend, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def prefill(self, *args, **kwargs):
        if self.block.is_set():
            self.release.wait(30)
        return self.backend.prefill(*args, **kwargs)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_health_fails_when_the_engine_thread_is_not_running(checkpoint):
    scheduler = Scheduler(load(checkpoint, max_batch=1).model, max_num_seqs=1)
    health = EngineHealth(scheduler)
    with pytest.raises(RuntimeError, match="engine is not running"):
        health.check()  # never started
    scheduler.start()
    health.check()
    scheduler.stop()
    with pytest.raises(RuntimeError, match="engine is not running"):
        health.check()


def test_health_fails_when_the_engine_is_stuck_in_a_step_with_sequences_in_flight(checkpoint):
    backend = BlockingBackend(load(checkpoint, max_batch=1).model)
    scheduler = Scheduler(backend, max_num_seqs=1)
    scheduler.start()
    clock = Clock()
    health = EngineHealth(scheduler, stall_s=60, clock=clock)
    try:
        clock.now = 1000.0
        health.check()  # idle for long: healthy
        backend.block.set()
        scheduler.submit([Sequence([5, 6, 7], SamplingParams(), 4)])
        health.check()
        clock.now += 59
        health.check()  # stuck, but not yet for stall_s
        clock.now += 2
        with pytest.raises(RuntimeError, match="has not finished a step in 61 s, with 1 sequences in flight"):
            health.check()
        backend.release.set()
        assert scheduler.wait_until_idle(30)
        health.check()  # stepping again
    finally:
        backend.release.set()
        scheduler.stop()


@pytest.mark.parametrize("arguments, message", [
    (["--gpus-per-replica", "0.5"], "--gpus-per-replica needs --replicas N"),
    (["--ray-address", "auto"], "--ray-address needs --replicas N"),
    (["--max-replicas", "3"], "--max-replicas needs --replicas N"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--gpus-per-replica", "1.5"], "--gpus-per-replica must be in [0, 1]"),
    (["--replicas", "2", "--gpus-per-replica", "nan"], "--gpus-per-replica must be in [0, 1]"),
    (["--replicas", "2", "--gpus-per-replica", "0.5", "--device", "cpu"], "with --device cpu"),
    (["--replicas", "2", "--gpus-per-replica", "0", "--device", "cuda"], "contradicts"),
    (["--replicas", "2", "--min-replicas", "1"], "--min-replicas needs --max-replicas"),
    (["--replicas", "2", "--max-replicas", "1"], "1 <= --min-replicas <= --replicas <= --max-replicas"),
    (["--replicas", "2", "--min-replicas", "3", "--max-replicas", "4"], "got 3 <= 2 <= 4"),
    (["--replicas", "2", "--ray-address", " "], "--ray-address must not be empty"),
    (["--replicas", "2", "--engine", "process"], "--engine is for the server without --replicas"),
    (["--proxy", "haproxy"], "--proxy needs --replicas N"),
    (["--replicas", "2", "--proxy", "haproxy", "--ray-address", "auto"], "export RAY_SERVE_ENABLE_HA_PROXY=1 there"),
])
def test_bad_replica_flags_are_one_line_before_anything_starts(checkpoint, arguments, message, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started before the arguments were checked")
    monkeypatch.setattr("ray.init", refuse)
    assert main(["serve", "--model", str(checkpoint), *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qwen-triton: error:") and message in err[0], err


def test_the_config_file_builder_makes_the_commands_deployment():
    from qwen_triton.server.ray_app import application

    built = application({"model": "Qwen/Qwen3.5-0.8B", "replicas": 4, "gpus_per_replica": 0.5, "max_num_seqs": 32,
                         "max_queue": 64})
    deployment = built._bound_deployment  # Ray offers no public view of a bound application's options
    assert deployment.num_replicas == 4 and deployment.max_ongoing_requests == 32 + 64
    assert deployment.ray_actor_options == {"num_cpus": 1, "num_gpus": 0.5}
    (options,) = deployment.init_args
    assert options.engine.device == "cuda" and options.model_name == "Qwen/Qwen3.5-0.8B" and options.gpu_share == 0.5
    scaled = application({"model": "m", "replicas": 2, "min_replicas": 1, "max_replicas": 6})._bound_deployment
    assert scaled._deployment_config.autoscaling_config.max_replicas == 6
    assert scaled._deployment_config.autoscaling_config.target_ongoing_requests == 16
    with pytest.raises(ValueError, match="unknown argument 'gpus'"):
        application({"model": "m", "gpus": 1})
    with pytest.raises(ValueError, match="needs args.model"):
        application({"replicas": 2})


def test_a_replica_on_part_of_a_gpu_starts_no_compile_workers_unless_told():
    from qwen_triton.server.ray_app import limit_compile_workers

    for share, given, expected in ((0.5, None, "0"), (0.25, "3", "3"), (1.0, None, None), (0.0, None, None)):
        environment = {} if given is None else {"QWEN_TRITON_COMPILE_WORKERS": given}
        limit_compile_workers(share, environment)
        assert environment.get("QWEN_TRITON_COMPILE_WORKERS") == expected, (share, given)


def test_haproxy_is_ray_serves_own_mode_on_ports_of_its_own():
    """--proxy haproxy: the variables Ray Serve 2.60 reads for its HAProxy mode (its constants module), HAProxy's
    metrics and stats on the ports given (two instances on one machine must not share Ray's defaults)."""
    import importlib

    from qwen_triton.server.ray_app import RayServer, free_ports, haproxy_environment

    assert len(set(free_ports(3))) == 3
    metrics, _ = free_ports(2)
    environment = haproxy_environment(metrics, 12346)
    constants = importlib.import_module("ray.serve._private.constants")
    names = {name for name in vars(constants) if name.startswith("RAY_SERVE_")}
    assert set(environment) <= names, set(environment) - names  # every variable is one Ray reads
    assert environment["RAY_SERVE_ENABLE_HA_PROXY"] == "1" and environment["RAY_SERVE_HAPROXY_STATS_PORT"] == "12346"
    with pytest.raises(ValueError, match="where `ray start` runs"):
        RayServer(host="127.0.0.1", port=8000, ray_address="auto", proxy="haproxy")
    with pytest.raises(ValueError, match="proxy must be 'ray' or 'haproxy'"):
        RayServer(host="127.0.0.1", port=8000, proxy="nginx")


def test_replicas_sharing_a_gpu_are_told_about_mps_unless_its_daemon_runs(tmp_path):
    from qwen_triton.server.ray_app import shared_gpu_note

    environment = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert "nvidia-cuda-mps-control -d" in shared_gpu_note(0.5, environment)
    assert shared_gpu_note(1.0, environment) is None and shared_gpu_note(0.0, environment) is None
    (tmp_path / "control").touch()  # the daemon's control pipe
    assert shared_gpu_note(0.5, environment) is None
