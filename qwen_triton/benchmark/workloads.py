"""`qwen-triton bench --workloads`: the engine as users run it, timed through its public API.

Every number comes from `LLM.generate` / `LLM.stream` on the triton backend (`random_llm(preset,
backend="triton", max_batch=...)`, the plan's default options, random weights at the preset's shape) and from
the `Generation.timings` they return: `time_to_first_token_s` (every prompt's prefill and first token) and
`total_s`. A step is one decode launch for all rows; `generate` of N new tokens runs N - 1 of them (the first
token comes from the prefill), fewer where every row stopped at an end-of-turn id, so the steps are counted from
the tokens actually generated. ms per step = (total - time to first token) / steps.

The rows (the JSON's `workloads.rows`, one table line each; `floor_ms` and `pct_of_floor` = 100 * floor / time):

  chat       first "ready in": the time from making the random weights to `LLM(...)` returning, its warm-up
             included (engine/warmup.py: every prompt length's kernels compiled and tuned; on by default on a GPU,
             `--no-warm-up` leaves it out; `warm_up_s` its part; no floor). Then `requests` prompts of distinct
             random lengths in `chat_lengths` (random ids, seed `seed`; no length the process has run before),
             Qwen's sampling (temperature 0.7, top_p 0.8, top_k 20), `chat_new_tokens` each, one `generate` after
             another. Rows: time to first token p50 and max, ms per token p50 (per
             request (total - first token) / its decode steps). Floors per request: its prefill's FLOPs
             (floor.prefill_flops) over the measured matmul rate; its steps' bytes (floor.decode_run_bytes,
             batch 1) over the measured copy bandwidth. The p50 rows quote the median request floor, the max row
             the floor of the request that took longest. `workloads.chat` holds every request.
  decode     one `generate` of B prompts of `decode_prompt` tokens, greedy, `decode_new_tokens` each, for each B of
             `decode_batches` (the median of `repeats` generates): ms per step, tokens per second (decode tokens of
             all rows / decode time). Floor: the bytes of the steps for B rows (floor.decode_run_bytes: every
             weight once in bf16, each row's recurrent and conv states read and written and its KV cache read)
             over the measured copy bandwidth.
  prefill    one `generate(prompts, max_new_tokens=1)` of count x length random prompts for each of `prefill`:
             the time to the first tokens (all prompts' prefills). Floor: the prompts' prefill FLOPs, summed,
             over the measured matmul rate.
  sampling   decode as above (B of `sampling_batches`, `sampling_new_tokens`) under each of SAMPLING_SETTINGS:
             ms per step and `ratio_to_greedy` (ms per step / greedy's at the same B). Floor: the greedy decode
             floor (the logits a sampling step writes and reads are not counted).
  streaming  one prompt of `stream_prompt` tokens, `stream_new_tokens` greedy, through `LLM.stream` (every piece
             consumed) and through `generate`: ms per token each (from the timings; stream's from
             `llm.last_generation`) and `ratio` = stream / generate. Floor: the decode floor at batch 1.

Each shape is generated once before it is timed (`warmup`: CUDA-graph capture, and without the LLM's warm-up
compilation and autotuning), but the chat run's lengths, which are new to the process on purpose (the warm-up
request has its own length): after the LLM's warm-up their times to first token hold no compilation or tuning.
The sizes come from one `WorkloadSizes` per device (GPU_SIZES, CPU_SIZES; the JSON's `workloads.sizes`), the
logic is the same. On a CPU (the tiny preset, Triton interpreted, float32, host timers) the sizes are tiny and the
numbers mean nothing: the section runs there so that it is tested.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass

import torch

from ..checkpoint import PRESETS, official_config
from ..config import parse_config
from .floor import decode_run_bytes, prefill_flops
from .harness import log, measure_hbm_bandwidth, measure_matmul_rate

QWEN_SAMPLING = dict(temperature=0.7, top_p=0.8, top_k=20)
SAMPLING_SETTINGS = (
    ("greedy", {}),
    ("t0.7 p0.8 k20", dict(QWEN_SAMPLING)),
    ("t1.0 p0.95 k20", dict(temperature=1.0, top_p=0.95, top_k=20)),
    ("t0.7 p0.8 k20 presence1.5", dict(QWEN_SAMPLING, presence_penalty=1.5)),
    ("t1.0 p0.95 k20 presence1.5", dict(temperature=1.0, top_p=0.95, top_k=20, presence_penalty=1.5)),
)


@dataclass(frozen=True)
class WorkloadSizes:
    """The sizes of every workload (the GPU's by default)."""

    chat_requests: int = 20
    chat_lengths: tuple[int, int] = (32, 2048)  # prompt lengths drawn from [low, high], distinct
    chat_new_tokens: int = 256
    chat_warmup_length: int = 100  # the warm-up request's length, never drawn
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    decode_prompt: int = 128
    decode_new_tokens: int = 128
    prefill: tuple[tuple[int, int], ...] = ((16, 128), (4, 1024))  # (prompts, tokens each)
    sampling_batches: tuple[int, ...] = (1, 16)
    sampling_new_tokens: int = 128
    stream_prompt: int = 128
    stream_new_tokens: int = 128
    repeats: int = 3  # timed generates per decode / sampling / streaming shape (their median)
    warmup: bool = True  # a first generate of each shape before it is timed
    seed: int = 0

    def max_length(self) -> int:
        """Tokens per sequence the LLM must hold: every workload's prompt + new tokens."""
        return max(self.chat_lengths[1] + self.chat_new_tokens, self.chat_warmup_length + self.chat_new_tokens,
                   self.decode_prompt + self.decode_new_tokens, self.sampling_prompt + self.sampling_new_tokens,
                   self.stream_prompt + self.stream_new_tokens, *(length + 1 for _, length in self.prefill))

    def max_batch(self) -> int:
        return max(1, *self.decode_batches, *self.sampling_batches, *(count for count, _ in self.prefill))

    @property
    def sampling_prompt(self) -> int:
        return self.decode_prompt


GPU_SIZES = WorkloadSizes()
# the interpreter takes seconds per prefill and per step of the tiny model: the fewest calls that run every path
# one decode step a generate (the least that times one): an interpreted step of the tiny model takes seconds
CPU_SIZES = WorkloadSizes(chat_requests=2, chat_lengths=(8, 24), chat_new_tokens=2, chat_warmup_length=6,
                          decode_batches=(1, 2), decode_prompt=8, decode_new_tokens=2, prefill=((2, 8),),
                          sampling_batches=(1,), sampling_new_tokens=2, stream_prompt=8, stream_new_tokens=2,
                          repeats=1, warmup=False)


def sizes_for(device: str) -> WorkloadSizes:
    return GPU_SIZES if device == "cuda" else CPU_SIZES


class Workloads:
    """One LLM, its ceilings and the report's rows; a method per workload."""

    def __init__(self, preset: str, device: str, sizes: WorkloadSizes, hbm: float, matmul: float, **options):
        from ..tokenizer import Tokenizer
        from .models import random_llm

        self.sizes, self.device, self.hbm, self.matmul = sizes, device, hbm, matmul
        self.config = parse_config(official_config(PRESETS[preset]))
        dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dot is wrong in bf16
        # the bundled tokenizer given (the random checkpoint has none): the same one, without the warning
        started = time.perf_counter()
        self.llm = random_llm(preset, "triton", device=device, dtype=dtype, max_length=sizes.max_length(),
                              max_batch=sizes.max_batch(), tokenizer=Tokenizer.default(), **options)
        if device == "cuda":
            torch.cuda.synchronize()
        self.ready_s = time.perf_counter() - started  # the weights made and LLM(...) returned, its warm-up done
        self.random = random.Random(sizes.seed)
        self.rows: list[dict] = []

    # ---- helpers ------------------------------------------------------------------------------------
    def prompts(self, count: int, length: int) -> list[list[int]]:
        vocab = self.config.vocab_size
        return [[self.random.randrange(vocab) for _ in range(length)] for _ in range(count)]

    def generate(self, prompts, new_tokens: int, **sampling) -> list:
        results = self.llm.generate(prompts, max_new_tokens=new_tokens, **sampling)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return results

    @staticmethod
    def steps(results) -> int:
        """The decode steps a generate ran: a row's tokens came from the prefill and one step each (an
        end-of-turn id is produced but not kept), and the steps ran until the last row finished."""
        return max(len(r.token_ids) + (r.finish_reason == "stop") for r in results) - 1

    def decode_time(self, results) -> tuple[float, int]:
        """(ms per step, steps) of one generate's results."""
        steps = self.steps(results)
        if steps < 1:
            raise RuntimeError("every row stopped at its first token: no decode step to time")
        timings = results[0].timings
        return (timings["total_s"] - timings["time_to_first_token_s"]) * 1e3 / steps, steps

    def decode_floor_ms(self, context: int, steps: int, batch: int) -> tuple[float, int]:
        """(floor ms per step, bytes per step) of `steps` steps of `batch` rows from `context`."""
        moved = decode_run_bytes(self.config, context, steps, batch) / steps
        return moved / (self.hbm * 1e12) * 1e3, round(moved)

    def prefill_floor_ms(self, lengths) -> tuple[float, int]:
        flops = sum(prefill_flops(self.config, length) for length in lengths)
        return flops / (self.matmul * 1e12) * 1e3, flops

    def add(self, workload: str, case: str, metric: str, ms: float, floor_ms: float | None, **extra) -> dict:
        """A row; floor_ms None for a time without a floor (the ready row)."""
        row = dict(workload=workload, case=case, metric=metric, ms=ms, floor_ms=floor_ms,
                   pct_of_floor=None if floor_ms is None else 100 * floor_ms / ms, **extra)
        self.rows.append(row)
        against = "" if floor_ms is None else f" ({row['pct_of_floor']:.1f}% of floor)"
        log(f"workloads: {workload} {case}: {metric} {ms:.3f} ms{against}")
        return row

    def timed_decode(self, batch: int, prompt: int, new_tokens: int, **sampling) -> dict:
        """Warm-up (one generate of the shape), then the median of `repeats` generates: ms per step and the rest."""
        if self.sizes.warmup:
            self.generate(self.prompts(batch, prompt), new_tokens, **sampling)
        runs = []
        for _ in range(self.sizes.repeats):
            results = self.generate(self.prompts(batch, prompt), new_tokens, **sampling)
            ms, steps = self.decode_time(results)
            decode_tokens = sum(max(len(r.token_ids) - 1, 0) for r in results)
            runs.append(dict(ms=ms, steps=steps, tokens_per_s=decode_tokens / (ms * 1e-3 * steps)))
        middle = sorted(runs, key=lambda run: run["ms"])[len(runs) // 2]
        floor_ms, moved = self.decode_floor_ms(prompt, middle["steps"], batch)
        return dict(middle, floor_ms=floor_ms, bytes=moved, runs_ms=[run["ms"] for run in runs])

    # ---- the workloads ------------------------------------------------------------------------------
    def chat(self) -> dict:
        s = self.sizes
        low, high = s.chat_lengths
        seen = {s.chat_warmup_length, s.decode_prompt, s.sampling_prompt, s.stream_prompt,
                *(length for _, length in s.prefill)}
        choices = [length for length in range(low, high + 1) if length not in seen]
        if len(choices) < s.chat_requests:
            raise ValueError(f"chat_lengths {s.chat_lengths} hold fewer than {s.chat_requests} new lengths")
        lengths = self.random.sample(choices, s.chat_requests)
        if s.warmup:
            self.generate(self.prompts(1, s.chat_warmup_length), s.chat_new_tokens, **QWEN_SAMPLING)
        warm_up = self.llm.warm_up_report
        self.add("chat", "LLM(...) " + ("with its warm-up" if warm_up else "without a warm-up"), "ready in",
                 self.ready_s * 1e3, None, floor="none", warm_up_s=None if warm_up is None else warm_up.seconds)
        requests = []
        for index, length in enumerate(lengths):
            result = self.generate(self.prompts(1, length), s.chat_new_tokens, seed=index, **QWEN_SAMPLING)[0]
            timings = result.timings
            ttft_ms = timings["time_to_first_token_s"] * 1e3
            steps = self.steps([result])
            request = dict(prompt_tokens=length, generated_tokens=len(result.token_ids), steps=steps,
                           finish_reason=result.finish_reason, time_to_first_token_ms=ttft_ms,
                           ttft_floor_ms=self.prefill_floor_ms([length])[0], ms_per_token=None,
                           ms_per_token_floor=None)
            if steps >= 1:
                request["ms_per_token"] = (timings["total_s"] - timings["time_to_first_token_s"]) * 1e3 / steps
                request["ms_per_token_floor"] = self.decode_floor_ms(length, steps, 1)[0]
            requests.append(request)
        ttft = [r["time_to_first_token_ms"] for r in requests]
        slowest = max(requests, key=lambda r: r["time_to_first_token_ms"])
        case = f"{s.chat_requests} x [{low}, {high}] -> {s.chat_new_tokens}"
        self.add("chat", case, "time to first token p50", statistics.median(ttft),
                 statistics.median(r["ttft_floor_ms"] for r in requests), floor="flops")
        self.add("chat", case, "time to first token max", slowest["time_to_first_token_ms"],
                 slowest["ttft_floor_ms"], floor="flops", prompt_tokens=slowest["prompt_tokens"])
        decoded = [r for r in requests if r["ms_per_token"] is not None]
        if decoded:
            self.add("chat", case, "ms per token p50", statistics.median(r["ms_per_token"] for r in decoded),
                     statistics.median(r["ms_per_token_floor"] for r in decoded), floor="bytes",
                     generated_tokens=sum(r["generated_tokens"] for r in requests))
        return dict(sampling=QWEN_SAMPLING, lengths=lengths, requests=requests)

    def decode(self) -> None:
        s = self.sizes
        for batch in s.decode_batches:
            run = self.timed_decode(batch, s.decode_prompt, s.decode_new_tokens)
            self.add("decode", f"B={batch}, {s.decode_prompt} -> {s.decode_new_tokens}", "ms per step", run["ms"],
                     run["floor_ms"], floor="bytes", batch=batch, steps=run["steps"], bytes=run["bytes"],
                     tokens_per_s=run["tokens_per_s"], runs_ms=run["runs_ms"])

    def prefill(self) -> None:
        for count, length in self.sizes.prefill:
            if self.sizes.warmup:
                self.generate(self.prompts(count, length), 1)
            result = self.generate(self.prompts(count, length), 1)
            floor_ms, flops = self.prefill_floor_ms([length] * count)
            self.add("prefill", f"{count} x {length}", "time to first tokens",
                     result[0].timings["time_to_first_token_s"] * 1e3, floor_ms, floor="flops", batch=count,
                     prompt_tokens=length, flops=flops)

    def sampling(self) -> None:
        s = self.sizes
        for batch in s.sampling_batches:
            greedy = None
            for name, settings in SAMPLING_SETTINGS:
                run = self.timed_decode(batch, s.sampling_prompt, s.sampling_new_tokens, **settings)
                greedy = run["ms"] if greedy is None else greedy  # SAMPLING_SETTINGS starts with greedy
                self.add("sampling", f"B={batch}, {name}", "ms per step", run["ms"], run["floor_ms"],
                         floor="bytes", batch=batch, setting=name, sampling=settings, steps=run["steps"],
                         bytes=run["bytes"], ratio_to_greedy=run["ms"] / greedy)

    def streaming(self) -> None:
        s = self.sizes
        times = {}
        for way in ("stream", "generate"):
            if s.warmup:
                self.run_one(way)
            runs = [self.run_one(way) for _ in range(s.repeats)]
            times[way] = sorted(runs)[len(runs) // 2]
        for way, (ms, steps) in times.items():
            floor_ms, moved = self.decode_floor_ms(s.stream_prompt, steps, 1)
            self.add("streaming", f"{way}, {s.stream_prompt} -> {s.stream_new_tokens}", "ms per token", ms,
                     floor_ms, floor="bytes", batch=1, steps=steps, bytes=moved,
                     ratio=ms / times["generate"][0] if way == "stream" else 1.0)

    def run_one(self, way: str) -> tuple[float, int]:
        prompt = self.prompts(1, self.sizes.stream_prompt)[0]
        if way == "stream":
            for _ in self.llm.stream(prompt, max_new_tokens=self.sizes.stream_new_tokens):
                pass
            results = [self.llm.last_generation]
        else:
            results = self.llm.generate([prompt], max_new_tokens=self.sizes.stream_new_tokens)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return self.decode_time(results)

    def close(self) -> None:
        del self.llm
        if self.device == "cuda":
            torch.cuda.empty_cache()


WORKLOADS = ("chat", "decode", "prefill", "sampling", "streaming")


def run_workloads(preset: str = "0.8b", device: str = "cuda", sizes: WorkloadSizes | None = None,
                  hbm: float | None = None, matmul: float | None = None, which: tuple[str, ...] = WORKLOADS,
                  **options) -> dict:
    """The workloads named in `which` (default: every one) in one process on one LLM; the ceilings measured unless
    given (TB/s, TFLOP/s). Returns the report's `workloads` section."""
    unknown = [name for name in which if name not in WORKLOADS]
    if unknown or not which:
        raise ValueError(f"unknown workloads {unknown}: choose among {', '.join(WORKLOADS)}")
    sizes = sizes_for(device) if sizes is None else sizes
    started = time.perf_counter()
    hbm = measure_hbm_bandwidth(device) if hbm is None else hbm
    matmul = measure_matmul_rate(device) if matmul is None else matmul
    log(f"workloads: building the {preset} model (max_batch {sizes.max_batch()}, max_length {sizes.max_length()})")
    workloads = Workloads(preset, device, sizes, hbm, matmul, **options)
    # the chat first: its lengths are the process's first prefills of those lengths
    chat = workloads.chat() if "chat" in which else None
    for name in WORKLOADS[1:]:
        if name in which:
            getattr(workloads, name)()
    workloads.close()
    return dict(preset=preset, device=device, sizes_for="gpu" if sizes == GPU_SIZES else
                "cpu" if sizes == CPU_SIZES else "custom", sizes=dataclasses.asdict(sizes),
                which=list(which), hbm_copy_TBps=hbm, matmul_TFLOPs=matmul, rows=workloads.rows, chat=chat,
                seconds=time.perf_counter() - started)


def format_workloads(section: dict) -> str:
    """The section as a Markdown table, a row per measurement with its floor."""
    lines = [f"Workloads through LLM.generate / LLM.stream ({section['preset']}, {section['sizes_for']} sizes; "
             f"took {section['seconds']:.0f} s)", "",
             "| workload | case | measure | ms | floor (ms) | % of floor | notes |", "|---|---|---|---|---|---|---|"]
    for row in section["rows"]:
        notes = []
        if "tokens_per_s" in row:
            notes.append(f"{row['tokens_per_s']:.1f} tok/s")
        if "ratio_to_greedy" in row:
            notes.append(f"{row['ratio_to_greedy']:.2f}x greedy")
        if row["workload"] == "streaming" and row["case"].startswith("stream"):
            notes.append(f"{row['ratio']:.2f}x generate")
        if "prompt_tokens" in row and row["workload"] == "chat":
            notes.append(f"{row['prompt_tokens']}-token prompt")
        if row.get("warm_up_s") is not None:
            notes.append(f"warm-up {row['warm_up_s']:.1f} s")
        if row["floor"] == "none":
            lines.append(f"| {row['workload']} | {row['case']} | {row['metric']} | {row['ms']:.3f} | - | - | "
                         f"{'; '.join(notes + ['no floor'])} |")
            continue
        notes.append(f"floor: {'FLOPs / matmul rate' if row['floor'] == 'flops' else 'bytes / copy bandwidth'}")
        lines.append(f"| {row['workload']} | {row['case']} | {row['metric']} | {row['ms']:.3f} | "
                     f"{row['floor_ms']:.4f} | {row['pct_of_floor']:.1f}% | {'; '.join(notes)} |")
    lines += ["", f"Ceilings: copy {section['hbm_copy_TBps']:.2f} TB/s, matmul {section['matmul_TFLOPs']:.1f} TFLOP/s. "
              "Steps counted from the tokens generated; ms per step = (total - time to first token) / steps."]
    return "\n".join(lines)
