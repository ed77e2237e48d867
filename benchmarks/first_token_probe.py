"""Where a lone request's time to first token goes, on a GPU: `LLM.generate` against the server.

Builds the 0.8B model (random weights, bf16, no warm-up), times `LLM.generate`'s first token for a prompt of each
length, then serves the same model (`create_app` with the engine on a thread of this process, so that the
scheduler's and the backend's calls can be marked) and sends streamed completions one at a time from this
process: for each, the times from sending to the scheduler's `submit`, to the backend's `prefill_batch` call and
its return (the launch), to the first decode step's launch (after the first id is chosen, which waits for the
prefill), and to the first text chunk at the client. Medians after 3 requests of warm-up. (The client shares this
process's interpreter lock with the server; `qwen-triton bench --serve` runs its clients in processes of their
own, and /metrics splits the engine's side as `queue_time_seconds` and `prefill_time_seconds`.)

With --engine process the server runs its engine in a process of its own, as `qwen-triton serve` does (D146), the
model built there; both processes mark their stages (perf_counter: one clock for the machine's processes), the
engine's written to a file per request: sent -> the HTTP side's submit (the pipe's send) -> the engine's receipt
-> the slot's reset -> prefill_batch's call and return -> the first id chosen (its host read) -> the step's
outputs emitted -> their delivery on the HTTP side -> the first text chunk at the client.

    python3 benchmarks/first_token_probe.py [--lengths 300,500] [--requests 12] [--max-length 1024]
                                            [--engine thread|process]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import httpx
import torch

from qwen_triton.benchmark.models import random_llm
from qwen_triton.server.app import create_app
from qwen_triton.server.runner import BackgroundServer
from qwen_triton.server.scheduler import Scheduler
from qwen_triton.tokenizer import Tokenizer


def streamed_first_chunk(client, prompt: list[int]) -> tuple[float, float | None]:
    """A streamed completion of 3 ids for `prompt`: the time it was sent and that of its first text chunk."""
    sent, first = time.perf_counter(), None
    body = dict(model="m", prompt=prompt, max_tokens=3, stream=True)
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter()
    return sent, first


ENGINE_STAGES = ("received", "reset", "prefill", "prefilled", "chosen", "emitted")


def marked_engine(marks_path: str, max_length: int):
    """Built in the engine process: the model, with each stage of a request's first id marked and written (one
    JSON line per request) to marks_path."""
    from qwen_triton.server import sampler, scheduler

    llm = random_llm("0.8b", max_length=max_length, max_batch=2, warm_up=False, tokenizer=Tokenizer.default())
    model, marks = llm.model, {}

    def mark(name):
        marks.setdefault(name, time.perf_counter())

    def wrap(owner, attribute, before, after=None):
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def marked(*call_args, **kwargs):
            mark(before)
            result = original(*call_args, **kwargs)
            if after:
                mark(after)
            return result
        setattr(owner, attribute, marked)

    wrap(scheduler.Scheduler, "enqueue", "received")
    wrap(model, "reset", "reset")
    wrap(model, "prefill_batch", "prefill", "prefilled")
    for kind in (sampler.DeviceSampler, sampler.HostSampler):
        wrap(kind, "first", "first", "chosen")
    send = scheduler.Scheduler._send

    def marked_send(self, outputs):
        if "chosen" in marks and "emitted" not in marks:
            mark("emitted")
            send(self, outputs)
            with open(marks_path, "a") as file:
                file.write(json.dumps(marks) + "\n")
            marks.clear()
            return
        send(self, outputs)
    scheduler.Scheduler._send = marked_send
    return model, None


def probe_engine_process(args, lengths) -> None:
    from qwen_triton.server.engine_process import EngineProcess
    from types import SimpleNamespace
    from pathlib import Path

    marks_path = os.path.join(tempfile.mkdtemp(), "marks.jsonl")
    engine = EngineProcess(functools.partial(marked_engine, marks_path, args.max_length), max_num_seqs=2, max_queue=4)
    engine.start()
    http = {}
    submit, deliver = engine.submit, engine._deliver

    def marked_submit(*call_args, **kwargs):
        http.setdefault("submit", time.perf_counter())
        return submit(*call_args, **kwargs)

    def marked_deliver(outputs):
        http.setdefault("delivered", time.perf_counter())
        return deliver(outputs)
    engine.submit, engine._deliver = marked_submit, marked_deliver
    llm = SimpleNamespace(tokenizer=Tokenizer.default(), eos_token_ids=set(), path=Path("m"))
    stages = ("submit", *ENGINE_STAGES, "delivered", "first")
    with BackgroundServer(create_app(llm, scheduler=engine, model_name="m")) as server:
        client = httpx.Client(base_url=server.url, timeout=60)
        for length in lengths:
            rows = []
            for index in range(args.requests):
                prompt = list(range(1000 + index, 1000 + index + length))
                http.clear()
                sent, first = streamed_first_chunk(client, prompt)
                with open(marks_path) as file:
                    engine_marks = json.loads(file.read().splitlines()[-1])
                rows.append(dict(sent=sent, **http, **{k: engine_marks[k] for k in ENGINE_STAGES}, first=first))
            rows = rows[3:]
            steps = [f"{b}->{a} {statistics.median(r[a] - r[b] for r in rows) * 1e3:.3f}"
                     for b, a in zip(("sent", *stages), stages)]
            total = [(r["first"] - r["sent"]) * 1e3 for r in rows]
            print(f"serve (engine process) {length} tokens: {', '.join(steps)}; time to first token "
                  f"{statistics.median(total):.3f} (max {max(total):.3f}) ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="300,500")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--engine", choices=("thread", "process"), default="thread")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.engine == "process":
        probe_engine_process(args, lengths)
        return
    llm = random_llm("0.8b", max_length=args.max_length, max_batch=2, warm_up=False, tokenizer=Tokenizer.default())
    for length in lengths:
        prompt = list(range(1000, 1000 + length))
        times = []
        for _ in range(8):
            result = llm.generate([prompt], max_new_tokens=2)
            torch.cuda.synchronize()
            times.append(result[0].timings["time_to_first_token_s"] * 1e3)
        print(f"LLM.generate {length} tokens: time to first token {statistics.median(times[3:]):.3f} ms", flush=True)

    marks: dict[str, list[float]] = {}
    model = llm.model
    for name in ("prefill_batch", "decode_tokens"):
        original = getattr(model, name)

        def marked(*call_args, _original=original, _name=name, **kwargs):
            marks.setdefault(_name, []).append(time.perf_counter())
            result = _original(*call_args, **kwargs)
            marks.setdefault(_name + " returned", []).append(time.perf_counter())
            return result
        setattr(model, name, marked)
    scheduler = Scheduler(model, max_num_seqs=2, max_queue=4)
    submit = scheduler.submit

    def marked_submit(*call_args, **kwargs):
        marks.setdefault("submit", []).append(time.perf_counter())
        return submit(*call_args, **kwargs)
    scheduler.submit = marked_submit
    with BackgroundServer(create_app(llm, scheduler=scheduler, model_name="m")) as server:
        client = httpx.Client(base_url=server.url, timeout=60)
        for length in lengths:
            rows = []
            for index in range(args.requests):
                prompt = list(range(1000 + index, 1000 + index + length))
                for values in marks.values():
                    values.clear()
                sent, first = streamed_first_chunk(client, prompt)
                rows.append(dict(sent=sent, first=first, submit=marks["submit"][0], prefill=marks["prefill_batch"][0],
                                 launched=marks["prefill_batch returned"][0], decode=marks["decode_tokens"][0]))
            rows = rows[3:]

            def median_ms(start: str, end: str) -> float:
                return statistics.median(row[end] - row[start] for row in rows) * 1e3

            print(f"serve {length} tokens: sent->submit {median_ms('sent', 'submit'):.3f}, submit->prefill "
                  f"{median_ms('submit', 'prefill'):.3f}, prefill launch {median_ms('prefill', 'launched'):.3f}, "
                  f"launched->first decode {median_ms('launched', 'decode'):.3f}, launched->first chunk "
                  f"{median_ms('launched', 'first'):.3f}, time to first token {median_ms('sent', 'first'):.3f} (max "
                  f"{max(row['first'] - row['sent'] for row in rows) * 1e3:.3f}) ms", flush=True)


if __name__ == "__main__":
    main()
