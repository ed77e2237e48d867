"""Running the app under uvicorn: in the foreground for `qwen-triton serve`, or on a thread (tests, a load
generator in the same process).

In the foreground, SIGTERM (or a first Ctrl-C) drains: the scheduler stops admitting (a request on an open
connection gets 503), uvicorn stops accepting connections, the requests in flight get `drain_timeout` seconds to
finish, then what is left ends with an error saying the server is stopping; the engine thread ends and `serve`
returns, so the process exits with status 0 after a SIGTERM.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (port 0: a free one) and listening, made before the weights load so that an
    address in use is reported at once (connections made before the server starts wait in its backlog). OSError
    where it cannot be bound.

    Nagle's algorithm is off (TCP_NODELAY, which the accepted connections inherit): a streamed response is many
    small writes, and with it on each one after the first waited for the client's delayed ACK. asyncio's loop
    turns it off only on sockets made with proto IPPROTO_TCP (uvloop on every TCP socket), so under plain asyncio a
    socket made without it gave each stream's first id ~40 ms late (docs/decisions.md, D156)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


# after the drain's deadline, the time the cancelled requests have to send their error and close
CLOSING_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the app's scheduler when asked to exit: it stops admitting at once, and when
    `drain_timeout` seconds have passed it cancels what is still in flight, so each such request ends with an
    error saying the server is stopping (an error event, then [DONE], for a stream) rather than a cut connection.
    uvicorn itself waits CLOSING_GRACE_S seconds longer for the connections to close."""

    def __init__(self, app, drain_timeout: float, log_level: str = "info", on_started=None, loop: str = "auto"):
        super().__init__(uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=drain_timeout + CLOSING_GRACE_S,
                                        log_level=log_level, access_log=False, loop=loop))
        self.app, self.drain_timeout, self.on_started = app, drain_timeout, on_started
        self._deadline: threading.Timer | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        scheduler = self.app.state.scheduler
        scheduler.stop_admitting()
        if self._deadline is None:
            self._deadline = threading.Timer(self.drain_timeout, scheduler.cancel_all)
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)


def serve(app, sock: socket.socket, drain_timeout: float, log_level: str = "info", on_started=None) -> None:
    """Serve `app` on `sock` until SIGTERM or SIGINT, then drain (above) and return; `on_started()` is called once
    the app has started and requests are answered."""
    # uvicorn raises the signal again once it has shut down, for the default action; SIGTERM's would end the
    # process with -15 after a clean drain, so it is made a no-op for that moment.
    previous = signal.signal(signal.SIGTERM, lambda number, frame: None)
    try:
        DrainingServer(app, drain_timeout, log_level, on_started).run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)


class BackgroundServer:
    """`app` served on a thread at 127.0.0.1 on a free port: `with BackgroundServer(app) as server:` and
    `server.url` ("http://127.0.0.1:PORT"); leaving the block shuts it down as a SIGTERM would. loop: uvicorn's
    event loop ("auto": uvloop where installed, else asyncio)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 5.0,
                 log_level: str = "warning", loop: str = "auto"):
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = DrainingServer(app, drain_timeout, log_level, loop=loop)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="qwen-triton-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
