"""`qwen-triton serve`: its flags checked before the weights load (one line, exit status 2), an address it cannot
listen on reported before they load (exit status 1), and SIGTERM: the server stops admitting, lets what is in
flight finish (or aborts it after --drain-timeout) and exits with status 0, its engine process with it (and also
when the server is killed)."""

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from qwen_triton.cli import main
from tests.test_cli import no_loading  # noqa: F401 (a fixture: the weights must not load)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arguments, message", [
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--max-queue", "-1"], "--max-queue must be >= 0"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--prefill-chunk", "64", "--max-prefill-tokens", "32"], "--max-prefill-tokens must be >= --prefill-chunk (64)"),
    (["--drain-timeout", "-2"], "--drain-timeout must be >= 0"),
    (["--drain-timeout", "nan"], "--drain-timeout must be >= 0"),
    (["--max-length", "1"], "--max-length must be >= 2"),
    (["--served-model-name", " "], "--served-model-name must not be empty"),
])
def test_bad_flags_are_one_line_before_loading(checkpoint, arguments, message, capsys, no_loading):
    assert main(["serve", "--model", str(checkpoint), *arguments]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qwen-triton: error:") and message in err[0], err


def test_an_address_in_use_is_one_line_before_loading(checkpoint, capsys, no_loading):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(checkpoint), "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "cannot listen there" in err[-1] and f"--port {port}" in err[-1], err


def start(checkpoint, log: Path, drain_timeout: float, engine: str = "process") -> tuple[subprocess.Popen, str]:
    """`qwen-triton serve` in a process of its own on a free port; its URL once it serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "qwen_triton.cli", "serve", "--model", str(checkpoint), "--port", "0",
         "--max-length", "256", "--max-num-seqs", "2", "--drain-timeout", str(drain_timeout),
         "--served-model-name", "tiny", "--engine", engine],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"), stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (found := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return process, found.group(1)


def stream_lines(url: str, max_tokens: int):
    """A streamed completion whose first line has arrived: its client, the lines so far, the rest to come."""
    client = httpx.Client(timeout=60)
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = client.send(client.build_request("POST", url + "/v1/completions", json=body), stream=True)
    assert response.status_code == 200
    lines = (line for line in response.iter_lines() if line)
    return client, [next(lines)], lines


def children(pid: int) -> list[int]:
    """The processes `pid` started."""
    return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def engine_processes(pid: int) -> list[int]:
    """The engine process among them (multiprocessing's spawned child; not its resource tracker)."""
    return [child for child in children(pid) if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    """Whether the process exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("engine", ["process", "thread"])
def test_sigterm_stops_admitting_lets_short_requests_finish_cuts_long_ones_and_exits_0(checkpoint, tmp_path, engine):
    """Two streams in flight at the SIGTERM, with --drain-timeout 1: the short one (20 tokens) finishes; the long
    one (240) is ended at the deadline with an error event, the stream still closed properly; the engine process
    exits with the server."""
    log = tmp_path / "serve.log"
    process, url = start(checkpoint, log, drain_timeout=1.0, engine=engine)
    engines = engine_processes(process.pid)
    assert len(engines) == (1 if engine == "process" else 0)
    started = children(process.pid)
    try:
        streams = {max_tokens: stream_lines(url, max_tokens) for max_tokens in (20, 240)}
        process.send_signal(signal.SIGTERM)
        received = {}
        for max_tokens, (client, lines, rest) in streams.items():
            received[max_tokens] = lines + list(rest)
            client.close()
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert process.wait(timeout=60) == 0, log.read_text()
        assert wait_until_gone(started, 10)  # the engine process, and any helper of multiprocessing's
    finally:
        if process.poll() is None:
            process.kill()
    events = {n: [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
              for n, lines in received.items()}
    assert all(lines[-1] == "data: [DONE]" for lines in received.values())
    # ids counted by the usage each chunk carries: a lagging HTTP side sends several in one chunk (D145)
    assert events[20][-1]["usage"]["completion_tokens"] == 20 and events[20][-2]["choices"][0]["finish_reason"] == "length"
    cut = [event for event in events[240] if "usage" in event]
    assert cut[-1]["usage"]["completion_tokens"] < 240 and events[240][-1]["error"]["code"] == "shutting_down"
    assert "qwen-triton: stopped" in log.read_text()


def test_an_engine_process_stops_when_its_server_is_killed(checkpoint, tmp_path):
    """SIGKILL gives the server no chance to drain: its engine process sees the pipe close and exits by itself."""
    process, url = start(checkpoint, tmp_path / "serve.log", drain_timeout=1.0)
    try:
        (engine,) = engine_processes(process.pid)
        started = children(process.pid)
        assert running(engine)
        process.kill()
        process.wait(timeout=30)
        assert wait_until_gone(started, 30)
    finally:
        if process.poll() is None:
            process.kill()
