"""The host's share of serving: the engine loop's CPU time per step, and the HTTP side's per token, over a backend
that computes nothing (so that only the host's work is measured). Answers whether the engine loop needs a process
of its own (docs/decisions.md, D137).

    python3 benchmarks/serve_overhead.py [--batches 1,8,64,128] [--steps 300] [--concurrency 8,64,128]
                                         [--requests-per-client 2] [--output-tokens 256] [--engine thread,process]
                                         [--loop auto|asyncio|uvloop] [--out overhead.json]

NullBackend answers the scheduler's calls at once: decode_tokens "chooses" ids (words of a sentence, so that every
id has text to detokenize and stream) and leaves them where the triton backend's feedback kernel does (host rows by
step parity), so the scheduler runs its device-sampling path (server/sampler.py, DeviceSampler) unchanged; the
first ids of a prompt are chosen without a kernel (NullSampler). Optionally each step sleeps for a GPU's step time
(sleep, like waiting on a CUDA event, releases the GIL).

1. The engine alone: a Scheduler with B sequences decoding, stepped on this thread; its CPU time per step
   (time.thread_time: a loaded machine's waiting is not counted), with the batch unchanged from step to step and
   with one sequence replaced every step (each step then rebuilds the batch's sampling parameters and copies its
   inputs).
2. The whole server: create_app over NullBackend, each step sleeping issue 35's per-token target for its batch (so
   an engine that keeps up gives the target's tokens/s), the load generator's clients (benchmark/serve_load.py) in
   processes of their own; the engine (--engine) on a thread of this process (uvicorn's event loop beside it) or in
   an engine process of its own (server/engine_process.py). Per level: the output tokens/s and per-token latency
   p50 the clients see against the emulated GPU's; the engine's CPU time per step (its thread's, or its whole
   process's) and the HTTP side's per token (the rest of this process: detokenizing, SSE framing, HTTP); and the
   engine's steps' wall time beyond the sleep (its host work plus its waits for the GIL).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import math
import statistics
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from qwen_triton.benchmark.serve_load import ClientProcesses, ServeSizes, level_prompts, summarize
from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import parse_config
from qwen_triton.engine.sampling import SamplingParams
from qwen_triton.server.sampler import DeviceSampler
from qwen_triton.server.scheduler import Scheduler
from qwen_triton.server.sequence import Sequence, SequenceOutput
from qwen_triton.tokenizer import Tokenizer

SENTENCE = " the quick brown fox jumps over the lazy dog and runs far away"
# issue 35's per-token latency targets (ms) by concurrency: the emulated GPU's step time, interpolated between
TARGET_STEP_MS = {1: 0.65, 8: 0.9, 64: 2.5, 128: 3.6}


def target_step_seconds(batch: int) -> float:
    points = sorted(TARGET_STEP_MS.items())
    for (low, low_ms), (high, high_ms) in zip(points, points[1:]):
        if batch <= high:
            return (low_ms + (high_ms - low_ms) * max(batch - low, 0) / (high - low)) * 1e-3
    return points[-1][1] * 1e-3


class NullBackend:
    """The scheduler's backend interface, computing nothing: ids from TEXT_IDS by each row's step counter, left in
    host rows by step parity as the triton backend's feedback kernel leaves them."""

    def __init__(self, config, text_ids: list[int], max_batch: int, max_length: int, step_seconds=None):
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32
        self.max_batch, self.max_length = max_batch, max_length
        self.text_ids = torch.tensor(text_ids)
        self.host = torch.zeros(2, max_batch, dtype=torch.int64)
        self.counters = torch.zeros(max_batch, dtype=torch.int64)
        self.rows = torch.arange(max_batch)
        self.step_seconds = step_seconds

    def reset(self, slot=None):
        pass

    def prefill_batch(self, token_ids, slots, starts=None):
        return torch.zeros(len(token_ids), 1)  # NullSampler.first reads none of it

    def decode(self, token_ids, positions, slots=None):
        raise NotImplementedError("NullBackend serves requests without log-probabilities only")

    def decode_tokens(self, token_ids, positions, sampling, step, feedback=False, slots=None):
        batch = sampling.temperature.shape[0]
        if step is not None:
            self.counters[:batch] = step
        counters = self.counters[:batch]
        ids = self.text_ids[counters % len(self.text_ids)]
        self.host[counters % 2, self.rows[:batch]] = ids
        counters += 1
        if self.step_seconds is not None:
            time.sleep(self.step_seconds(batch))
        return ids

    def chosen_on_host(self, batch):
        return self.host


class NullSampler(DeviceSampler):
    """The device sampler, its first ids chosen without a kernel (the first word)."""

    def first(self, sequences, logits):
        return [SequenceOutput(int(self.backend.text_ids[0])) for _ in sequences]


def engine_alone(config, text_ids, batch: int, steps: int, churn: bool) -> float:
    """Microseconds of this thread's CPU per engine step with `batch` sequences decoding."""
    backend = NullBackend(config, text_ids, batch, 1 << 20)
    scheduler = Scheduler(backend, max_num_seqs=batch, max_queue=batch, sampler=NullSampler(backend))

    def sequence():
        return Sequence([1, 2, 3], SamplingParams(), 1 << 19)

    scheduler.submit([sequence() for _ in range(batch)])
    scheduler._take_inbox(block=False)
    scheduler._admit()
    scheduler._step()  # the prefill: every sequence decoding from the next step on
    times = []
    for _ in range(steps):
        if churn:  # one sequence out, a new one in
            scheduler.abort([scheduler.decoding[0]])
            scheduler.submit([sequence()])
        start = time.thread_time()
        scheduler._take_inbox(block=False)
        scheduler._admit()
        scheduler._step()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e6


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def emulated_gpu(text_ids: list[int], top: int):
    """NullBackend sleeping each step for its batch's target, and its sampler: built where the engine runs."""
    backend = NullBackend(parse_config(official_config(PRESETS["0.8b"])), text_ids, top, 1 << 20,
                          step_seconds=target_step_seconds)
    return backend, NullSampler(backend)


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU time of every thread of a process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def whole_server(text_ids, tokenizer, concurrencies, requests_per_client: int, output_tokens: int,
                 engine: str, loop: str = "auto") -> list:
    """engine "thread": the scheduler on a thread of this process; "process": in an engine process (D146)."""
    from qwen_triton.server.app import create_app
    from qwen_triton.server.engine_process import EngineProcess
    from qwen_triton.server.runner import BackgroundServer

    top = max(concurrencies)
    if engine == "thread":
        backend, sampler = emulated_gpu(text_ids, top)
        scheduler = Scheduler(backend, max_num_seqs=top, max_queue=top, sampler=sampler)
    else:
        scheduler = EngineProcess(functools.partial(emulated_gpu, text_ids, top), max_num_seqs=top, max_queue=top)
        scheduler.start()
    llm = SimpleNamespace(tokenizer=tokenizer, eos_token_ids=set(), path=Path("null"))

    def engine_cpu() -> float:
        if engine == "thread":
            return thread_cpu(scheduler._thread)
        return process_cpu_seconds(scheduler.process.pid)
    sizes = ServeSizes(concurrencies=tuple(concurrencies), prompt_lengths=(64, 512), output_tokens=output_tokens,
                       requests_per_client=requests_per_client)
    processes = ClientProcesses(max(2, math.ceil(top / 16)))
    results = []
    try:
        with BackgroundServer(create_app(llm, scheduler=scheduler, model_name="null"), loop=loop) as server:
            processes.run(server.url, "null", level_prompts(sizes, top, 1000, 1, 99), 4)  # warm-up
            for index, concurrency in enumerate(concurrencies):
                prompts = level_prompts(sizes, concurrency, 1000, requests_per_client, index)
                steps_before, engine_before, process_before = scheduler.statistics.steps, engine_cpu(), \
                    time.process_time()
                records = processes.run(server.url, "null", prompts, output_tokens)
                level = summarize(records, concurrency)
                counts = scheduler.statistics
                steps = counts.steps - steps_before
                engine_seconds = engine_cpu() - engine_before
                # the HTTP side: this process (less the engine's thread, where it runs here)
                other_cpu = time.process_time() - process_before - (engine_seconds if engine == "thread" else 0.0)
                recent = list(counts.recent)[-min(steps, 1024):]
                full = [s.seconds for s in recent if s.decode_rows == concurrency and not s.prefill_tokens]
                emulated = target_step_seconds(concurrency)
                results.append(dict(
                    concurrency=concurrency, failed=level["failed"], output_tokens=level["output_tokens"],
                    output_tokens_per_s=level["output_tokens_per_s"], emulated_tokens_per_s=concurrency / emulated,
                    per_token_ms_p50=level["per_token_ms_p50"],
                    request_per_token_ms_p50=level["request_per_token_ms_p50"], emulated_step_ms=emulated * 1e3,
                    ttft_ms_p50=level["ttft_ms_p50"], ttft_ms_p99=level["ttft_ms_p99"],
                    engine=engine, loop=loop, engine_cpu_us_per_step=engine_seconds / steps * 1e6,
                    http_cpu_us_per_token=other_cpu / level["output_tokens"] * 1e6,
                    full_step_beyond_sleep_us_p50=(statistics.median(full) - emulated) * 1e6 if full else None))
                print(json.dumps(results[-1]), flush=True)
    finally:
        processes.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,8,64,128")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--concurrency", default="8,64,128", help="the whole server's levels ('' to skip it)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--engine", default="thread,process",
                        help="where the whole server's engine runs: thread, process or both (D137, D146)")
    parser.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                        help="the server's event loop (uvicorn's; auto: uvloop where installed)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if not set(args.engine.split(",")) <= {"thread", "process"}:
        parser.error(f"--engine takes thread, process or both, got {args.engine!r}")
    config = parse_config(official_config(PRESETS["0.8b"]))
    tokenizer = Tokenizer.default()
    text_ids = tokenizer.encode(SENTENCE)
    report = dict(engine=[], server=[])
    for batch in (int(b) for b in args.batches.split(",")):
        row = dict(batch=batch, steady_us=engine_alone(config, text_ids, batch, args.steps, churn=False),
                   churn_us=engine_alone(config, text_ids, batch, args.steps, churn=True))
        report["engine"].append(row)
        print(json.dumps(row), flush=True)
    if args.concurrency:
        for engine in args.engine.split(","):
            report["server"] += whole_server(text_ids, tokenizer, [int(c) for c in args.concurrency.split(",")],
                                             args.requests_per_client, args.output_tokens, engine, args.loop)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
