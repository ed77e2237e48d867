"""The engine in a process of its own: the scheduler and the backend in one process, the HTTP side in the other.

With the engine on a thread of the server's process, the HTTP side (detokenizing, pydantic, SSE framing, starlette
and uvicorn: 42-53 us of CPU per generated id) and the engine loop share one interpreter lock, and at 64 or 128
streams they need more than one CPU can give (docs/decisions.md, D137). So by default `qwen-triton serve` runs the
engine in a process spawned for it (D146), as vLLM's V1 does:

    HTTP process (app.py, uvicorn)                      engine process (`engine_main`)
    EngineProcess: the Scheduler's face to the app      its own thread reading the pipe; the Scheduler and its
      submit / abort / cancel / stop  ---- pipe ---->     engine thread over the backend (the LLM, loaded here)
      a thread reading the pipe       <--- pipe -----   each step's outputs in one message: (identity, id,
        -> emit(outputs) to the event loop                log-probabilities, finish reason, error) per sequence

Only ids cross: prompts as token ids one way, chosen ids the other; text stays in the HTTP process. The HTTP side
counts the sequences in flight and refuses what does not fit (429), so the engine queues what it is sent
(`Scheduler.enqueue`). A sequence the HTTP side aborts leaves its count at once; the engine frees its slot at its
next step and its later outputs are dropped. The metrics the scheduler observes (steps, step time, batch sizes,
token latencies) live in the engine process and are fetched when /metrics is rendered (`refresh_metrics`);
`statistics` fetches the scheduler's counts and recent steps the same way.

The engine process ignores SIGINT and SIGTERM: the HTTP process drains it (`stop`), and where the HTTP process dies
the pipe closes, which stops the engine. Where the engine process dies, every sequence in flight ends with an
error, /health answers 503 and new requests get 503.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import multiprocessing
import signal
import threading
import time
import traceback
from collections.abc import Callable

from . import heap
from .metrics import ServerMetrics
from .scheduler import STOPPING, QueueFull, Scheduler, SchedulerStatistics, ShuttingDown, StepRecord, check_sequence
from .sequence import Sequence, SequenceOutput

logger = logging.getLogger("qwen_triton.server")

ENGINE_DIED = ("the engine process stopped unexpectedly{detail}: this request was lost; the server cannot serve "
               "until it is restarted")
# how long the HTTP side waits for the engine's answer to a question (its metrics, its statistics)
SNAPSHOT_TIMEOUT_S = 30.0


def load_llm_backend(options: dict):
    """An LLM's backend, built in the engine process from LLM's keyword arguments (the CLI's `build`)."""
    from ..engine.llm import LLM

    return LLM(**options).model, None


# ---- the engine process ---------------------------------------------------------------------------------
def engine_main(connection, build: Callable, scheduler_options: dict) -> None:
    """The engine process: `build()` gives (backend, sampler or None); a Scheduler runs them; messages from the
    HTTP side are applied until it says stop or its end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            connection.send(message)

    live: dict[int, Sequence] = {}  # identity -> the engine's sequence, until its last output or its abort

    def emit(outputs: list[tuple[Sequence, SequenceOutput]]) -> None:
        rows = []
        for sequence, output in outputs:
            if output.finish_reason is not None or output.error is not None:
                live.pop(sequence.identity, None)
            rows.append((sequence.identity, output.token_id, output.logprob, output.top_logprobs,
                         output.finish_reason, output.error))
        send(("outputs", (rows, scheduler.running)))

    try:
        backend, sampler = build()
        scheduler = Scheduler(backend, sampler=sampler, emit=emit, metrics=ServerMetrics(), **scheduler_options)
        # the start's heap (the model, its graphs, the modules) frozen: collections walk only what comes after it
        frozen = heap.freeze_startup_heap()
        scheduler.metrics.pauses.append(heap.Pauses(scheduler.metrics.engine_gc_pause).start())
        scheduler.start()
    except BaseException as error:  # noqa: BLE001 - every failure to start is reported to the HTTP side
        send(("failed", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
        connection.close()
        raise SystemExit(1) from None
    send(("ready", dict(max_length=scheduler.max_length, vocab_size=scheduler.vocab_size, frozen_objects=frozen)))

    def snapshot() -> dict:
        statistics = scheduler.statistics
        counts = {name: getattr(statistics, name) for name in
                  ("steps", "prefill_chunks", "mixed_steps", "largest_decode_batch", "finished", "aborted", "failed")}
        return dict(metrics=scheduler.metrics.engine_state(), running=scheduler.running, statistics=counts,
                    recent=[(r.decode_rows, r.prefill_tokens, r.seconds) for r in list(statistics.recent)])

    while True:
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):  # the HTTP process is gone
            scheduler.stop(0.0)
            return
        if kind == "submit":
            sequences = [Sequence(ids, params, max_tokens, stop_ids, logprobs, identity=identity,
                                  arrival_time=arrival)
                         for identity, ids, params, max_tokens, stop_ids, logprobs, arrival in payload]
            live.update((sequence.identity, sequence) for sequence in sequences)
            scheduler.enqueue(sequences)
        elif kind == "abort":
            aborted = [live.pop(identity) for identity in payload if identity in live]
            scheduler.abort(aborted)
        elif kind == "cancel":
            scheduler.cancel_all()
        elif kind == "snapshot":
            send(("snapshot", (payload, snapshot())))
        elif kind == "stop":
            scheduler.stop(0.0)  # what is still in flight ends with an error output, sent before "stopped"
            send(("stopped", None))
            connection.close()
            return


# ---- the HTTP side --------------------------------------------------------------------------------------
class EngineProcess:
    """What app.py needs of a Scheduler, over an engine in a process of its own (`engine_main`). build: a picklable
    callable, run in the engine process, that returns (backend, sampler or None) (`load_llm_backend` for an LLM);
    the options are the Scheduler's. `start()` spawns the process and returns when the backend is built and the
    engine runs (RuntimeError where it fails: the engine's error and traceback)."""

    def __init__(self, build: Callable, *, max_num_seqs: int, max_queue: int = 256, prefill_chunk: int = 512,
                 max_prefill_tokens: int | None = None):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.build = build
        self.max_num_seqs, self.max_queue = max_num_seqs, max_queue
        self.scheduler_options = dict(max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
                                      max_prefill_tokens=max_prefill_tokens)
        self.max_length = self.vocab_size = None  # the engine's, once started
        self.frozen_objects: int | None = None  # the objects the engine process froze after its start (heap.py)
        self.emit: Callable[[list[tuple[Sequence, SequenceOutput]]], None] = lambda outputs: None
        self.metrics = ServerMetrics()  # create_app gives its own
        self.process = None
        self._connection = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._live: dict[int, Sequence] = {}  # identity -> the HTTP side's sequence, in flight
        self._accepting = True
        self._stopping = False
        self._died: str | None = None  # why the engine is gone, when it is
        self._running = 0  # the engine's count of sequences holding a slot, as of its last message
        self._questions = itertools.count()
        self._answers: dict[int, concurrent.futures.Future] = {}

    # ---- start and stop -------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        """Spawn the engine process and wait until it serves (its backend built, its warm-up done); a second call
        does nothing. RuntimeError where the engine fails to start or `timeout` seconds pass."""
        if self.process is not None:
            return
        context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked process
        ours, theirs = context.Pipe()
        self.process = context.Process(target=engine_main, args=(theirs, self.build, self.scheduler_options),
                                       name="qwen-triton-engine")
        self.process.start()
        theirs.close()
        self._connection = ours
        atexit.register(self._at_exit)  # before multiprocessing's own, which would wait for the engine forever
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ours.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process exited with code {self.process.exitcode} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                self._kill()
                raise RuntimeError(f"the engine process was not ready within {timeout:g} s")
        try:
            kind, payload = ours.recv()
        except EOFError:
            self.process.join(10)
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} before it was "
                               "ready") from None
        if kind == "failed":
            self.process.join(10)
            raise RuntimeError(f"the engine failed to start: {payload}")
        self.max_length, self.vocab_size = payload["max_length"], payload["vocab_size"]
        self.frozen_objects = payload["frozen_objects"]
        self._reader = threading.Thread(target=self._read, name="qwen-triton-engine-pipe", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 0.0) -> None:
        """Stop admitting, let what is in flight finish for up to `timeout` seconds, then stop the engine (what is
        left ends with an error output) and wait for its process to exit."""
        self.stop_admitting()
        if self.process is None:
            return
        self.wait_until_idle(timeout)
        self._stopping = True
        self._send(("stop", None))
        if self._reader is not None:
            self._reader.join(max(timeout, 30.0))
        self.process.join(30.0)
        if self.process.is_alive():
            logger.warning("the engine process did not exit after stop: killed")
            self._kill()

    def _at_exit(self) -> None:
        """The interpreter exits with the engine still running (a server that failed before its lifespan ended):
        the engine is told to stop, and killed where it does not exit within 10 s."""
        if self.process.is_alive():
            self._stopping = True
            self._send(("stop", None))
            self.process.join(10.0)
            if self.process.is_alive():
                self._kill()

    def _kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    # ---- the Scheduler's interface (app.py) --------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_queue

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting_count(self) -> int:
        return max(len(self._live) - self._running, 0)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        return (self._died is None and self.process is not None and self.process.is_alive()
                and self._reader is not None and self._reader.is_alive())

    def check(self, sequence: Sequence) -> None:
        check_sequence(sequence, self.vocab_size, self.max_length)

    def submit(self, sequences: list[Sequence]) -> None:
        """As Scheduler.submit: all or none; ShuttingDown once stopping or when the engine is gone, QueueFull when
        they do not fit beside those in flight, ValueError for a sequence that cannot run."""
        for sequence in sequences:
            self.check(sequence)
        with self._lock:
            if self._died is not None:
                raise ShuttingDown(self._died)
            if not self._accepting:
                raise ShuttingDown("the server is stopping and admits no new requests")
            if len(self._live) + len(sequences) > self.capacity:
                raise QueueFull(f"the server is full: {len(self._live)} sequences in flight, room for "
                                f"{self.capacity} ({self.max_num_seqs} running, {self.max_queue} waiting); "
                                "retry later")
            for sequence in sequences:
                self._live[sequence.identity] = sequence
        self._send(("submit", [(s.identity, s.prompt_ids, s.params, s.max_tokens, s.stop_token_ids, s.logprobs,
                                s.arrival_time) for s in sequences]))

    def abort(self, sequences: list[Sequence]) -> None:
        identities = []
        with self._idle:
            for sequence in sequences:
                sequence.aborted = True
                if self._live.pop(sequence.identity, None) is not None:
                    identities.append(sequence.identity)
            self._notify_if_idle()
        if identities:
            self._send(("abort", identities))

    def stop_admitting(self) -> None:
        with self._lock:
            self._accepting = False

    def cancel_all(self) -> None:
        self._send(("cancel", None))

    def wait_until_idle(self, timeout: float) -> bool:
        with self._idle:
            return self._idle.wait_for(lambda: not self._live, timeout=timeout)

    async def refresh_metrics(self) -> None:
        """Copy the engine's metrics into `metrics` (its gauges' counts too), to render them."""
        if not self.alive:
            return
        try:
            state = await asyncio.wait_for(asyncio.wrap_future(self._ask()), SNAPSHOT_TIMEOUT_S)
        except (TimeoutError, ConnectionError, OSError):
            return
        self._take_snapshot(state)

    @property
    def statistics(self) -> SchedulerStatistics:
        """The engine's counts and its last steps (asked for: blocks until the engine answers)."""
        state = self._ask().result(SNAPSHOT_TIMEOUT_S)
        self._take_snapshot(state)
        statistics = SchedulerStatistics(**state["statistics"])
        statistics.recent.extend(StepRecord(*record) for record in state["recent"])
        return statistics

    # ---- the pipe -------------------------------------------------------------------------------
    def _send(self, message) -> None:
        if self._died is not None or self._connection is None:
            return
        try:
            with self._send_lock:
                self._connection.send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            pass  # the reader sees the pipe close and fails what is in flight

    def _ask(self) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(ConnectionError(self._died or "the engine process is not running"))
            return future
        question = next(self._questions)
        self._answers[question] = future
        self._send(("snapshot", question))
        return future

    def _take_snapshot(self, state: dict) -> None:
        self._running = state["running"]
        self.metrics.load_engine_state(state["metrics"])

    def _notify_if_idle(self) -> None:  # with self._idle held
        if not self._live:
            self._idle.notify_all()

    def _read(self) -> None:
        """The pipe's reader: each step's outputs to `emit` (for the sequences still in flight here), answers to
        their questions; at the end of the pipe, an error output for everything in flight."""
        connection = self._connection
        while True:
            try:
                kind, payload = connection.recv()
            except (EOFError, OSError):
                break
            if kind == "outputs":
                rows, self._running = payload
                outputs = []
                with self._idle:
                    for identity, token_id, logprob, top, finish_reason, error in rows:
                        sequence = self._live.get(identity)
                        if sequence is None:
                            continue  # aborted here: the engine had not yet heard
                        if finish_reason is not None or error is not None:
                            del self._live[identity]
                        outputs.append((sequence, SequenceOutput(token_id, logprob, top, finish_reason, error)))
                    self._notify_if_idle()
                if outputs:
                    self._deliver(outputs)
            elif kind == "snapshot":
                question, state = payload
                future = self._answers.pop(question, None)
                if future is not None:
                    future.set_result(state)
            elif kind == "stopped":
                break
        self._end()

    def _end(self) -> None:
        """The pipe is closed: a stop, or the engine process died. Everything still in flight ends with an error."""
        if self.process is not None:
            self.process.join(5.0 if self._stopping else 1.0)
        code = None if self.process is None else self.process.exitcode
        with self._idle:
            if not self._stopping:
                self._died = ENGINE_DIED.format(detail="" if code is None else f" (exit code {code})")
                logger.error(self._died)
            message = self._died or STOPPING
            left = list(self._live.values())
            self._live.clear()
            self._running = 0
            self._notify_if_idle()
        for future in list(self._answers.values()):
            future.set_exception(ConnectionError(message))
        self._answers.clear()
        if left:
            self._deliver([(sequence, SequenceOutput(None, error=message)) for sequence in left])

    def _deliver(self, outputs) -> None:
        try:
            self.emit(outputs)
        except Exception:  # the HTTP side's failure must not stop the reader
            logger.exception("delivering a step's outputs failed")
