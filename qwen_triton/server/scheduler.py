"""Continuous batching: the engine thread that owns the model and runs the sequences of every request.

One thread owns the backend (its weights and its per-slot caches) and loops over steps. A step:
1. takes in what the HTTP side sent since the last step (new sequences, aborts) and frees the slots of the
   aborted;
2. gives free slots to waiting sequences, first come first served (`backend.reset(slot)` on each);
3. decodes every sequence that has a token to continue from, together, in one step over the slots they hold, and
   chooses each one's next id (sampler.py: on the device inside the step for the triton backend, on the host from
   the logits for the reference backend);
4. prefills the prompts holding a slot in one `prefill_batch(token_ids, slots, starts)` call: each prompt
   contributes its next chunk, at most `prefill_chunk` tokens, oldest first while the step's prompt tokens stay
   within `max_prefill_tokens`; a longer prompt goes on from `start` > 0 at the next step. So the sequences already
   decoding wait at most one bounded prefill a step. Chunks end at multiples of `prefill_chunk` whatever else runs,
   so a sequence's computation does not depend on the load; the prompts whose prefill ends choose their first ids
   (one `first` call) and decode from the next step on;
5. sends every output of the step to the HTTP side in one `emit(outputs)` call.

A sequence ends at one of its stop ids or at its max_tokens (or when the HTTP side aborts it: a stop string
matched in the text, or the client gone); its slot is free for the next step. With nothing to run, the thread
sleeps until something arrives. Tokenizing, detokenizing and matching stop strings stay on the HTTP side.

`submit` and `abort` are safe to call from any thread; everything else belongs to the engine thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .metrics import ServerMetrics
from .sampler import make_sampler
from .sequence import DECODING, FINISHED, PREFILLING, WAITING, Sequence, SequenceOutput

logger = logging.getLogger("qwen_triton.server")

STOPPING = "the server is stopping: this request was cancelled before it finished"
DEFAULT_PREFILL_CHUNKS = 4  # max_prefill_tokens by default: this many chunks of prefill_chunk tokens a step


def check_sequence(sequence: Sequence, vocab_size: int, max_length: int) -> None:
    """ValueError where the sequence cannot run: an empty prompt, an id outside the vocabulary, no room in the
    context for one generated token, or a max_tokens below 1."""
    if not sequence.prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    bad = next((t for t in sequence.prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} in the prompt is outside the vocabulary [0, {vocab_size})")
    if len(sequence.prompt_ids) >= max_length:
        raise ValueError(f"the prompt has {len(sequence.prompt_ids)} tokens, which leaves no room to generate "
                         f"within the context of {max_length} tokens")
    if sequence.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {sequence.max_tokens}")


class QueueFull(Exception):
    """No room for the request: every slot is taken and the waiting queue is full."""


class ShuttingDown(Exception):
    """The server is stopping and admits no more requests."""


@dataclass
class StepRecord:
    """One step: how many sequences decoded and how many prompt tokens were prefilled, and its time."""

    decode_rows: int
    prefill_tokens: int
    seconds: float


@dataclass
class SchedulerStatistics:
    """Totals since the scheduler started, and the last steps (`recent`), for the metrics and the tests."""

    steps: int = 0
    prefill_chunks: int = 0
    mixed_steps: int = 0  # steps that decoded and prefilled both
    largest_decode_batch: int = 0
    finished: int = 0
    aborted: int = 0
    failed: int = 0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=1024))


class Scheduler:
    """The engine loop over a backend (engine/backend.py) with `max_num_seqs` slots (at most the backend's
    max_batch) and room for `max_queue` sequences waiting for one. `emit(outputs)` receives each step's
    [(sequence, SequenceOutput)] on the engine thread; it must return quickly (the HTTP side posts them to
    its event loop)."""

    def __init__(
        self,
        backend,
        *,
        max_num_seqs: int | None = None,
        max_queue: int = 256,
        prefill_chunk: int = 512,
        max_prefill_tokens: int | None = None,
        emit: Callable[[list[tuple[Sequence, SequenceOutput]]], None] | None = None,
        metrics: ServerMetrics | None = None,
        sampler=None,
    ):
        max_num_seqs = backend.max_batch if max_num_seqs is None else max_num_seqs
        if not 1 <= max_num_seqs <= backend.max_batch:
            raise ValueError(f"max_num_seqs must be in [1, {backend.max_batch}] (the backend's max_batch), "
                             f"got {max_num_seqs}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if max_prefill_tokens is None:
            max_prefill_tokens = DEFAULT_PREFILL_CHUNKS * prefill_chunk
        if max_prefill_tokens < prefill_chunk:
            raise ValueError(f"max_prefill_tokens must be >= prefill_chunk ({prefill_chunk}), got {max_prefill_tokens}")
        self.backend = backend
        self.max_num_seqs, self.max_queue, self.prefill_chunk = max_num_seqs, max_queue, prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.max_length = backend.max_length
        self.vocab_size = backend.config.vocab_size
        self.sampler = make_sampler(backend) if sampler is None else sampler
        self.emit = emit or (lambda outputs: None)
        self.metrics = metrics or ServerMetrics()
        self.statistics = SchedulerStatistics()
        # the engine thread's
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))  # popped from the end: slot 0 first
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.prefilling: list[Sequence] = []
        self.decoding: list[Sequence] = []
        # shared with the HTTP side
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0  # submitted and not yet finished
        self._accepting = True
        self._thread: threading.Thread | None = None

    # ---- any thread ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The most sequences in flight at once: every slot's and every place in the queue."""
        return self.max_num_seqs + self.max_queue

    @property
    def running(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.prefilling) + len(self.decoding)

    @property
    def waiting_count(self) -> int:
        """Sequences submitted that hold no slot yet."""
        return max(self._in_flight - self.running, 0)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self, sequence: Sequence) -> None:
        """ValueError where the sequence cannot run (`check_sequence`)."""
        check_sequence(sequence, self.vocab_size, self.max_length)

    def submit(self, sequences: list[Sequence]) -> None:
        """Queue sequences to run (all or none): ShuttingDown once stopping, QueueFull when they do not fit
        beside those in flight, ValueError for a sequence that cannot run (`check`)."""
        for sequence in sequences:
            self.check(sequence)
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is stopping and admits no new requests")
            if self._in_flight + len(sequences) > self.capacity:
                raise QueueFull(f"the server is full: {self._in_flight} sequences in flight, room for "
                                f"{self.capacity} ({self.max_num_seqs} running, {self.max_queue} waiting); "
                                "retry later")
            self._in_flight += len(sequences)
        self._inbox.put(("submit", sequences))

    def enqueue(self, sequences: list[Sequence]) -> None:
        """Queue sequences already checked and admitted elsewhere (the HTTP side of an engine process counts what
        is in flight and refuses what does not fit, engine_process.py): no check, no limit."""
        with self._lock:
            self._in_flight += len(sequences)
        self._inbox.put(("submit", sequences))

    def abort(self, sequences: list[Sequence]) -> None:
        """Stop sequences (their client went away, or a stop string ended them): their slots are free by the
        next step, and they produce nothing more. Finished ones are ignored."""
        for sequence in sequences:
            sequence.aborted = True
        self._inbox.put(("abort", sequences))

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the scheduler has already started")
        self._thread = threading.Thread(target=self._run, name="qwen-triton-engine", daemon=True)
        self._thread.start()

    def stop_admitting(self) -> None:
        """From now on submit raises ShuttingDown; what is in flight goes on."""
        with self._lock:
            self._accepting = False

    def cancel_all(self) -> None:
        """End every sequence in flight now, each with an error output saying the server is stopping; the engine
        thread goes on (what a drain does when its time is up)."""
        self._inbox.put(("cancel", None))

    def stop(self, timeout: float = 0.0) -> None:
        """Stop admitting, let what is in flight finish for up to `timeout` seconds, abort the rest (its
        receivers get an error output) and end the engine thread."""
        self.stop_admitting()
        if self._thread is None:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)
        self._inbox.put(("stop", None))
        self._thread.join(timeout=max(timeout, 10.0))

    async def refresh_metrics(self) -> None:
        """Bring `metrics` up to date before they are rendered: here they already are (this thread's scheduler
        observes them itself; an engine process's are fetched, engine_process.py)."""

    def wait_until_idle(self, timeout: float) -> bool:
        """Block until nothing is in flight (True) or `timeout` seconds pass (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            busy = bool(self.waiting or self.prefilling or self.decoding)
            if not self._take_inbox(block=not busy):
                return
            try:
                self._admit()
                if self.prefilling or self.decoding:
                    self._step()
            except Exception as error:  # a backend failure fails the sequences of the step, not the server
                logger.exception("an engine step failed")
                self._fail_running(f"the engine step failed: {type(error).__name__}: {error}")

    def _take_inbox(self, block: bool) -> bool:
        """Apply what the HTTP side sent; False when told to stop (everything left is then aborted)."""
        try:
            messages = [self._inbox.get() if block else self._inbox.get_nowait()]
        except queue.Empty:
            return True
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        aborted: list[Sequence] = []
        for kind, sequences in messages:
            if kind == "submit":
                self.waiting.extend(sequences)
            elif kind == "abort":
                aborted += sequences
            elif kind == "cancel":
                self._cancel_everything()
            else:
                self._cancel_everything()
                return False
        for sequence in aborted:
            self._drop(sequence)
        return True

    def _drop(self, sequence: Sequence) -> None:
        """Take an aborted sequence out of wherever it is and free its slot."""
        if sequence.state == FINISHED:
            return
        if sequence.state == WAITING:
            if sequence not in self.waiting:  # never submitted (refused)
                return
            self.waiting.remove(sequence)
        self.statistics.aborted += 1
        self._release(sequence)

    def _cancel_everything(self) -> None:
        outputs = [(s, SequenceOutput(None, error=STOPPING))
                   for s in [*self.waiting, *self.prefilling, *self.decoding] if not s.aborted]
        for sequence in [*self.waiting, *self.prefilling, *self.decoding]:
            self._drop(sequence)
        self._send(outputs)

    def _admit(self) -> None:
        admitted = []
        while self.waiting and self.free_slots:
            sequence = self.waiting.popleft()
            sequence.budget = min(sequence.max_tokens, self.max_length - len(sequence.prompt_ids))
            sequence.slot = self.free_slots.pop()
            self.backend.reset(sequence.slot)
            self.sampler.start(sequence)
            sequence.state = PREFILLING
            self.prefilling.append(sequence)
            admitted.append(sequence)
        if admitted:
            now = time.perf_counter()
            for sequence in admitted:
                sequence.admitted_time = now
            self.metrics.queue_time.observe_many([now - s.arrival_time for s in admitted])

    def _step(self) -> None:
        start = time.perf_counter()
        outputs: list[tuple[Sequence, SequenceOutput]] = []
        batch = list(self.decoding)
        if batch:
            # with no prompt waiting to join, the next step decodes these sequences (or fewer): the sampler may
            # launch it before handing this one's ids back
            self._advance(batch, self.sampler.decode(batch, ahead=not self.prefilling), outputs)
        prefilled = self._prefill(outputs)
        self._send(outputs)
        seconds = time.perf_counter() - start
        statistics, metrics = self.statistics, self.metrics
        statistics.steps += 1
        statistics.mixed_steps += bool(batch and prefilled)
        statistics.largest_decode_batch = max(statistics.largest_decode_batch, len(batch))
        statistics.recent.append(StepRecord(len(batch), prefilled, seconds))
        metrics.steps.inc()
        metrics.step_seconds.observe(seconds)
        if batch:
            metrics.decode_batch.observe(len(batch))

    def _prefill(self, outputs: list) -> int:
        """One prefill_batch of the next chunks of the oldest prompts, up to max_prefill_tokens in all; the number
        of tokens prefilled."""
        chunks: list[tuple[Sequence, int]] = []  # (sequence, where its chunk ends)
        total = 0
        for sequence in self.prefilling:
            end = min(len(sequence.prompt_ids), (sequence.prefilled // self.prefill_chunk + 1) * self.prefill_chunk)
            if chunks and total + end - sequence.prefilled > self.max_prefill_tokens:
                break
            chunks.append((sequence, end))
            total += end - sequence.prefilled
        if not chunks:
            return 0
        # every chunk's ids in one host tensor, split into views: the backend lays them out in its inputs (one
        # copy to the device, which does not wait for a step in flight)
        ids = torch.tensor([t for s, end in chunks for t in s.prompt_ids[s.prefilled:end]], dtype=torch.int64)
        pieces = ids.split([end - s.prefilled for s, end in chunks])
        logits = self.backend.prefill_batch(list(pieces), [s.slot for s, _ in chunks], [s.prefilled for s, _ in chunks])
        done = [r for r, (sequence, end) in enumerate(chunks) if end == len(sequence.prompt_ids)]
        for sequence, end in chunks:
            sequence.prefilled = end
        self.statistics.prefill_chunks += len(chunks)
        self.metrics.prefill_chunks.inc(len(chunks))
        if done:
            ready = [chunks[r][0] for r in done]
            for sequence in ready:
                self.prefilling.remove(sequence)
                sequence.state = DECODING
                self.decoding.append(sequence)
            first = self.sampler.first(ready, logits[done] if len(done) < len(chunks) else logits)
            self._advance(ready, first, outputs)
        return total

    def _advance(self, sequences: list[Sequence], chosen: list[SequenceOutput], outputs: list) -> None:
        """Record the id a step chose for each sequence; end it at a stop id or at its token budget. (Once a step
        for every running sequence: kept to a plain loop.)"""
        now = time.perf_counter()
        first_waits, prefill_times, gaps, ended = [], [], [], []
        for sequence, output in zip(sequences, chosen):
            if output.error is not None:
                self.statistics.failed += 1
                ended.append(sequence)
                outputs.append((sequence, output))
                continue
            last = sequence.last_token_time
            if last is None:
                first_waits.append(now - sequence.arrival_time)
                prefill_times.append(now - sequence.admitted_time)
            else:
                gaps.append(now - last)
            sequence.last_token_time = now
            generated = sequence.generated
            generated.append(output.token_id)
            if output.token_id in sequence.stop_token_ids:
                output.finish_reason = "stop"
            elif len(generated) >= sequence.budget:
                output.finish_reason = "length"
            outputs.append((sequence, output))
            if output.finish_reason is not None:
                self.statistics.finished += 1
                ended.append(sequence)
        if first_waits:
            self.metrics.time_to_first_token.observe_many(first_waits)
            self.metrics.prefill_time.observe_many(prefill_times)
        if gaps:
            self.metrics.time_per_output_token.observe_many(gaps)
        for sequence in ended:
            self._release(sequence)

    def _release(self, sequence: Sequence) -> None:
        """The sequence is done: out of the running lists, its slot free (reset when next given)."""
        if sequence.state == PREFILLING:
            self.prefilling.remove(sequence)
        elif sequence.state == DECODING:
            self.decoding.remove(sequence)
        if sequence.slot is not None:
            self.free_slots.append(sequence.slot)
            sequence.slot = None
        sequence.state = FINISHED
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def _fail_running(self, message: str) -> None:
        outputs = []
        for sequence in [*self.prefilling, *self.decoding]:
            self.statistics.failed += 1
            self._release(sequence)
            outputs.append((sequence, SequenceOutput(None, error=message)))
        self._send(outputs)

    def _send(self, outputs: list) -> None:
        if not outputs:
            return
        try:
            self.emit(outputs)
        except Exception:  # the HTTP side's failure must not stop the engine
            logger.exception("delivering a step's outputs failed")
