"""The server's metrics in Prometheus' text format (GET /metrics).

Counters, gauges and histograms small enough to write here rather than depend on a client library: each is
safe to update from the engine thread while the HTTP side renders it, and copied across when the engine runs in a
process of its own. Every name starts with `qwen_triton_`.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable

PREFIX = "qwen_triton_"
# seconds: from a tenth of a millisecond (a decode step on a GPU) to a minute (a long prompt on a CPU)
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    parts = [f'{name}="{value}"' for name, value in zip(names, values)]
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    """A count that only goes up, per combination of label values."""

    def __init__(self, name: str, description: str, labels: tuple[str, ...] = ()):
        self.name, self.description, self.label_names = PREFIX + name, description, labels
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1, **labels: str) -> None:
        key = tuple(str(labels[name]) for name in self.label_names)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(tuple(str(labels[name]) for name in self.label_names), 0)

    def state(self) -> dict:
        with self._lock:
            return dict(self._values)

    def load(self, state: dict) -> None:
        with self._lock:
            self._values = dict(state)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.description}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.label_names:
            items = [((), 0)]
        lines += [f"{self.name}{_labels(self.label_names, key)} {_number(value)}" for key, value in items]
        return lines


class Gauge:
    """A value read when the metrics are rendered (`read`), such as the scheduler's queue lengths."""

    def __init__(self, name: str, description: str, read: Callable[[], float]):
        self.name, self.description, self.read = PREFIX + name, description, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.description}", f"# TYPE {self.name} gauge",
                f"{self.name} {_number(self.read())}"]


class Histogram:
    """Observations counted in cumulative buckets (upper bounds), with their sum and count."""

    def __init__(self, name: str, description: str, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.name, self.description = PREFIX + name, description
        self.bounds = tuple(buckets)
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def observe_many(self, values: list[float]) -> None:
        """Each of values observed, under one acquisition of the lock (a step's tokens at once)."""
        indices = [bisect.bisect_left(self.bounds, value) for value in values]
        with self._lock:
            for index in indices:
                self._counts[index] += 1
            self._sum += sum(values)

    @property
    def count(self) -> int:
        return sum(self._counts)

    def state(self) -> tuple[list[int], float]:
        with self._lock:
            return list(self._counts), self._sum

    def load(self, state: tuple[list[int], float]) -> None:
        counts, total = state
        with self._lock:
            self._counts, self._sum = list(counts), total

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.description}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.bounds + (math.inf,), counts):
            cumulative += count
            bound_label = 'le="' + _number(bound) + '"'
            lines.append(f"{self.name}_bucket{{{bound_label}}} {cumulative}")
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """Every metric of the server. The scheduler observes steps, batch sizes and token latencies; the HTTP side
    counts requests by outcome and the tokens of each; the gauges read the scheduler when rendered."""

    def __init__(self):
        self.requests = Counter("requests_total", "HTTP requests to the API, by outcome: success, invalid (400), "
                                "not_found (404), rejected (429 or 503: the queue is full or the server is "
                                "stopping), aborted (the client went away), failed (500)", ("outcome",))
        self.prompt_tokens = Counter("prompt_tokens_total", "prompt tokens of the requests served")
        self.generation_tokens = Counter("generation_tokens_total", "tokens generated for the requests served "
                                         "(their usage's completion_tokens)")
        self.steps = Counter("steps_total", "engine steps (one decode of the running sequences and one batch of "
                             "prompt chunks each)")
        self.prefill_chunks = Counter("prefill_chunks_total", "prompt chunks prefilled (a whole prompt, or a chunk of "
                                      "a long one; a step prefills its chunks in one call)")
        self.step_seconds = Histogram("step_seconds", "the time of an engine step")
        self.decode_batch = Histogram("decode_batch_size", "sequences decoded together in a step", BATCH_BUCKETS)
        self.time_to_first_token = Histogram("time_to_first_token_seconds",
                                             "from a sequence's arrival to its first generated token")
        # the first token's time in two parts: waiting (the HTTP side, the hop to the engine, a full engine) and the
        # engine's work from the slot to the first id (the host's preparation, the prefill, the first choice)
        self.queue_time = Histogram("queue_time_seconds", "from a sequence's arrival to its slot")
        self.prefill_time = Histogram("prefill_time_seconds", "from a sequence's slot to its first generated token")
        self.time_per_output_token = Histogram("time_per_output_token_seconds",
                                               "between consecutive generated tokens of a sequence")
        # the garbage collector's pauses (heap.py): this process's, and the engine process's
        self.gc_pause = Histogram("gc_pause_seconds", "the Python garbage collector's pauses in the server's process "
                                  "(the HTTP side; with --engine thread, the engine too)")
        self.engine_gc_pause = Histogram("engine_gc_pause_seconds", "the Python garbage collector's pauses in the "
                                         "engine process")
        self.pauses: list = []  # heap.Pauses recording into the histograms above, flushed before they are read
        self.gauges: list[Gauge] = []

    # what the scheduler observes: in an engine process of its own, copied to the HTTP side's metrics before they
    # are rendered (`engine_state`, `load_engine_state`; engine_process.py)
    ENGINE_METRICS = ("steps", "prefill_chunks", "step_seconds", "decode_batch", "time_to_first_token",
                      "queue_time", "prefill_time", "time_per_output_token", "engine_gc_pause")

    def flush_pauses(self) -> None:
        for pauses in self.pauses:
            pauses.flush()

    def engine_state(self) -> dict:
        self.flush_pauses()
        return {name: getattr(self, name).state() for name in self.ENGINE_METRICS}

    def load_engine_state(self, state: dict) -> None:
        for name in self.ENGINE_METRICS:
            getattr(self, name).load(state[name])

    def add_gauge(self, name: str, description: str, read: Callable[[], float]) -> None:
        self.gauges.append(Gauge(name, description, read))

    def render(self) -> str:
        self.flush_pauses()
        metrics = [self.requests, self.prompt_tokens, self.generation_tokens, *self.gauges, self.steps,
                   self.prefill_chunks, self.step_seconds, self.decode_batch, self.time_to_first_token,
                   self.queue_time, self.prefill_time, self.time_per_output_token, self.gc_pause,
                   self.engine_gc_pause]
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"
