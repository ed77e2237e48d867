"""The listening socket of `qwen-triton serve` (runner.bind_socket): Nagle's algorithm off on every connection, so
that a stream's small writes leave at once under any event loop (docs/decisions.md, D156)."""

import asyncio
import socket
import statistics
import time
from types import SimpleNamespace

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

from qwen_triton.server.runner import BackgroundServer, bind_socket


def test_accepted_connections_have_nagle_off():
    with bind_socket("127.0.0.1", 0) as listening:
        assert listening.proto == socket.IPPROTO_TCP
        with socket.create_connection(listening.getsockname()) as client:
            accepted, _ = listening.accept()
            with accepted:
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                client.sendall(b"x")
                assert accepted.recv(1) == b"x"


def streaming_app() -> Starlette:
    """One route streaming three small events 5 ms apart, as the server streams ids; the state runner's drain
    needs (a scheduler that stops admitting and cancels)."""
    async def events():
        for index in range(3):
            yield f"data: {index}\n\n"
            await asyncio.sleep(0.005)

    async def stream(request):
        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/stream", stream)])
    app.state.scheduler = SimpleNamespace(stop_admitting=lambda: None, cancel_all=lambda: None)
    return app


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_a_streamed_first_event_is_not_held_back(loop):
    """With Nagle on, the first event after the headers waited for the client's delayed ACK: ~40 ms under asyncio's
    loop on Linux. The median of 7 requests on one connection must stay well below that."""
    waits = []
    with BackgroundServer(streaming_app(), loop=loop) as server, httpx.Client(base_url=server.url) as client:
        for _ in range(8):
            sent = time.perf_counter()
            with client.stream("GET", "/stream") as response:
                lines = (line for line in response.iter_lines() if line)
                assert next(lines) == "data: 0"
                waits.append(time.perf_counter() - sent)
                assert list(lines) == ["data: 1", "data: 2"]
    assert statistics.median(waits[1:]) < 0.02, [f"{w * 1e3:.1f} ms" for w in waits]
