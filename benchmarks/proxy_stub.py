"""What a front costs a streamed chunk, without the engine: a stub app behind uvicorn, Ray Serve's Python proxy and
Ray Serve's HAProxy (D175).

The stub (`stub_app`) streams `--tokens` server-sent events a request, one to every open stream each `--step`
seconds (a decode step of the whole batch, as the engine's scheduler does), in the event format of app.py's
completions. `--clients` closed-loop streaming clients (httpx) read it for `--seconds` through each front in turn:
  uvicorn   the stub served by uvicorn itself (what `qwen-triton serve` does)
  ray       one Ray Serve replica serving the stub, behind Ray's Python HTTP proxy (`serve --replicas 1`)
  haproxy   the same replica serving on its own port, behind Ray's HAProxy (`serve --replicas 1 --proxy haproxy`)
Prints each front's events a second and its ratio to uvicorn's; the ceiling is clients / step.

    python3 benchmarks/proxy_stub.py [--fronts uvicorn,ray,haproxy] [--clients 64] [--step 0.005] [--seconds 20] \
        [--ray-env NAME=VALUE ...]

--ray-env sets Ray Serve's variables for the Ray instances, e.g. its throughput flags
(RAY_SERVE_THROUGHPUT_OPTIMIZED=1 RAY_SERVE_ENABLE_DIRECT_INGRESS=0: gRPC from the proxy to the replica, user code
on the replica's own loop, the garbage collector frozen, with the Python proxy kept).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stub_app(step: float, tokens: int):
    """The stub ASGI app: POST /v1/completions streams `tokens` events, one each `step` seconds for all streams."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    clock = {"event": None}

    async def tick():
        while True:
            await asyncio.sleep(step)
            event, clock["event"] = clock["event"], asyncio.Event()
            event.set()

    def next_step():
        if clock["event"] is None:
            clock["event"] = asyncio.Event()
            asyncio.get_running_loop().create_task(tick())
        return clock["event"].wait()

    async def completions(request):
        await request.json()

        async def events():
            for _ in range(tokens):
                await next_step()
                chunk = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
                         "choices": [{"index": 0, "text": " token", "logprobs": None, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


def serve_front(front: str, port: int, step: float, tokens: int) -> None:
    """Serve the stub through `front` on 127.0.0.1:port until killed (run in a process of its own)."""
    if front == "uvicorn":
        import uvicorn

        uvicorn.run(stub_app(step, tokens), host="127.0.0.1", port=port, log_level="warning")
        return
    if front == "haproxy":
        from qwen_triton.server.ray_app import free_ports, haproxy_environment

        os.environ.update(haproxy_environment(*free_ports(2)))
    import ray
    from ray import serve

    source = str(ROOT)
    os.environ["PYTHONPATH"] = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(address="local", logging_level="warning", include_dashboard=False)
    quiet = {"enable_access_log": False}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)

    @serve.deployment(max_ongoing_requests=1000, ray_actor_options={"num_cpus": 1})
    @serve.ingress()
    class Stub:
        def __serve_build_asgi_app__(self):
            from benchmarks.proxy_stub import stub_app
            return stub_app(step, tokens)

    serve.run(Stub.bind(), route_prefix="/", logging_config=quiet)
    print("serving", flush=True)
    try:
        while True:
            time.sleep(1)
    finally:
        serve.shutdown()
        ray.shutdown()


async def load(url: str, clients: int, seconds: float) -> float:
    """Closed-loop streaming clients for `seconds`: events received a second."""
    import httpx

    received = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=clients + 8)) as client:
        async def one_client():
            nonlocal received
            while time.perf_counter() < end:
                async with client.stream("POST", url + "/v1/completions", json={"prompt": "x", "stream": True}) as r:
                    async for line in r.aiter_lines():
                        received += line.startswith("data: {")
        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        return received / (time.perf_counter() - start)


def measure(front: str, args) -> float:
    from qwen_triton.server.ray_app import free_ports

    (port,) = free_ports(1)
    ray_env = dict(item.split("=", 1) for item in args.ray_env)
    process = subprocess.Popen([sys.executable, __file__, "--serve", front, "--port", str(port), "--step",
                                str(args.step), "--tokens", str(args.tokens)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled", **ray_env},
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        if front != "uvicorn":
            assert process.stdout.readline().strip() == "serving", f"{front} did not start"
        else:
            time.sleep(3)
        return asyncio.run(load(f"http://127.0.0.1:{port}", args.clients, args.seconds))
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fronts", default="uvicorn,ray,haproxy")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--step", type=float, default=0.005, help="seconds between two events of a stream")
    parser.add_argument("--tokens", type=int, default=256, help="events a request")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--ray-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="Ray Serve's variables for the Ray fronts")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if args.serve:
        serve_front(args.serve, args.port, args.step, args.tokens)
        return
    results = {}
    for front in args.fronts.split(","):
        results[front] = measure(front, args)
        ratio = f" ({results[front] / results['uvicorn']:.2f}x uvicorn's)" if "uvicorn" in results else ""
        print(f"{front:8s} {results[front]:8.0f} events/s{ratio}; ceiling {args.clients / args.step:.0f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"clients": args.clients, "step_s": args.step, "ray_env": args.ray_env,
                                        "events_per_s": results}, indent=2))


if __name__ == "__main__":
    main()
