"""`qwen-triton bench`: prefill and decode latency of each variant against the measured floor.

Variants (the names of the JSON rows):
  transformers               transformers' Qwen3_5ForCausalLM, bf16, what users run today
  reference                  this package's PyTorch model, eager
  reference+torch.compile    its decode step under torch.compile(mode="max-autotune") (CUDA graphs);
                             no prefill (not compiled, see EngineRunner._compiled_decode)
  triton                     the Triton kernels, no split-K, no CUDA graph
  triton+split_k             with split-K GEMVs
  triton+split_k+cuda_graph  with the decode step captured in a CUDA graph

Every model has random weights at the preset's shape (speed does not depend on the values).

Decode at context L: the triton variants run greedy steps as LLM.generate runs them (each step's id fed
back on the device, each step launched before the host reads the previous step's id:
engine/decode_pipeline.py), the context growing from L; the reference variants repeat a step at position
L; transformers grows its cache from L. Steps are launched back to back with one CUDA event between
consecutive steps, and a step's time is the interval between its two events as the GPU passes them: the
GPU's time per step when the host keeps ahead of it, the host's time when it does not. The median of
`steps` steps after warm-up. Prefill: CUDA events around each call, which is waited for; the median of
`steps` / 10 calls (/ 20 for long prompts) after warm-up. The ceilings are
measured in the same run: HBM bandwidth by a device-to-device copy (bytes read + written over time), the
bf16 matmul rate by an 8192^3 product.

On a CPU (the tiny preset, float32, Triton under its interpreter) the same harness runs end to end with
host timers and host ceilings, so that it is tested in CI; its numbers there mean nothing.
"""

from __future__ import annotations

import ast
import datetime
import importlib
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..checkpoint import PRESETS, official_config
from ..config import parse_config
from .floor import decode_bytes, prefill_flops

VARIANTS = ("transformers", "reference", "reference+torch.compile", "triton", "triton+split_k",
            "triton+split_k+cuda_graph")
PREFILL_LENGTHS = (128, 4096)
DECODE_CONTEXTS = (128, 4096, 32768)


def available_variants(variants) -> tuple[list[str], dict[str, str]]:
    """The variants whose packages are installed, and why each other one cannot run (transformers' own
    model needs the optional `transformers` package: `pip install 'qwen-triton[bench]'`)."""
    kept, missing = [], {}
    for variant in variants:
        if variant == "transformers" and importlib.util.find_spec("transformers") is None:
            missing[variant] = "transformers is not installed (pip install 'qwen-triton[bench]')"
        else:
            kept.append(variant)
    return kept, missing


def file_name(text: str) -> str:
    """text as a plain file name: letters, digits, '.', '_' and '-' ("CPU (x86_64)" -> "CPU-x86_64")."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def time_calls(function, steps: int, warmup: int, device: str = "cuda", back_to_back: bool = False) -> float:
    """Median milliseconds of `steps` calls, each timed by its own pair of CUDA events (a host timer on
    the CPU). back_to_back: the host does not wait for a call before making the next; one event is
    recorded between consecutive calls, and a call's time is the interval between the events around it
    as the GPU passes them (its GPU time when the host keeps ahead, the host's time when it does not)."""
    started = time.perf_counter()
    for _ in range(warmup):
        function()
    if device == "cuda":
        torch.cuda.synchronize()
    if time.perf_counter() - started > 5:  # compilation, autotuning, graph capture
        log(f"  warm-up took {time.perf_counter() - started:.1f} s")
    if device != "cuda":
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            function()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    if back_to_back:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for event in events[1:]:
            function()
            event.record()
        events[-1].synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph(function, calls: int = 20, replays: int = 20) -> float:
    """Median milliseconds per call of `function`, captured `calls` times back to back in one CUDA graph
    and replayed: no host launch cost in the number. Warm up (compile, autotune) before calling this."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            function()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def measure_hbm_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy (2 GiB on a GPU, 64 MiB on the host): bytes read plus written per second, TB/s."""
    elements = 2**30 if device == "cuda" else 2**25
    source = torch.empty(elements, dtype=torch.int16, device=device).random_()
    target = torch.empty_like(source)
    ms = time_calls(lambda: target.copy_(source), steps=20, warmup=3, device=device)
    return 2 * source.numel() * source.element_size() / (ms * 1e-3) / 1e12


def measure_matmul_rate(device: str = "cuda") -> float:
    """Matrix product on random data (bf16 8192^3 on a GPU, float32 512^3 on the host), in TFLOP/s."""
    size, dtype = (8192, torch.bfloat16) if device == "cuda" else (512, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    ms = time_calls(lambda: a @ b, steps=10, warmup=3, device=device)
    return 2 * size**3 / (ms * 1e-3) / 1e12


class EngineRunner:
    """One of this package's backends, timed through its model's prefill and decode calls."""

    def __init__(self, variant: str, preset: str, max_length: int, device: str, dtype: torch.dtype, **options):
        """options: more TritonModel options for a triton variant (benchmarks/engine_options.py)."""
        from .models import random_llm

        self.device = device
        if variant.startswith("triton"):
            options = dict(options, split_k="split_k" in variant, cuda_graph="cuda_graph" in variant)
            # no LLM warm-up (engine/warmup.py): each measurement warms its own shape up first, and a warm-up of
            # every length up to the longest context would cost each variant minutes
            self.llm = random_llm(preset, "triton", device=device, dtype=dtype, max_length=max_length,
                                  warm_up=False, **options)
        else:
            self.llm = random_llm(preset, "reference", device=device, dtype=dtype, max_length=max_length)
        self.model = self.llm.model
        self.variant = variant
        self.compiled_decode = None

    def _compiled_decode(self):
        """The reference's decode under torch.compile(mode="max-autotune"): Inductor's kernels, autotuned
        GEMMs and CUDA graphs (the caches and weights are marked static, so the graphs may update the caches
        in place). Prefill is not compiled: max-autotune tunes every GEMM shape of the chunked delta rule,
        and that alone took over two minutes for a 128-token prefill on the H200."""
        if self.compiled_decode is None:
            state = self.model.cache
            static = [*self.model.w.values(), self.model.cos, self.model.sin]
            for tensors in (state.key, state.value, state.conv, state.recurrent):
                static += tensors.values()
            for tensor in static:
                torch._dynamo.mark_static_address(tensor)
            self.compiled_decode = torch.compile(self.model.decode, mode="max-autotune", fullgraph=True,
                                                 dynamic=False)
        return self.compiled_decode

    def prefill(self, token_ids: torch.Tensor) -> None:
        self.model.reset(0)
        self.model.prefill(token_ids, slot=0, all_logits=False)

    def decode_step(self, context: int):
        token = torch.ones(1, device=self.device, dtype=torch.int64)
        position = torch.full((1,), context, device=self.device, dtype=torch.int64)
        if self.variant.startswith("triton"):  # greedy steps as LLM.generate runs them
            from ..engine.decode_pipeline import DecodePipeline
            from ..engine.sampling import SamplingParams
            from ..engine.device_sampling import DeviceSampling

            pipeline = DecodePipeline(self.model, DeviceSampling.build([SamplingParams()], self.device))
            state = dict(ids=[1], position=context, steps=0)

            def step():  # the context grows by one token a step: L..L+steps
                state["ids"] = pipeline.step(state["ids"], [state["position"]], [state["steps"]], [True])
                state["position"] += 1
                state["steps"] += 1
            return step
        decode = self._compiled_decode() if self.variant == "reference+torch.compile" else self.model.decode
        return lambda: decode(token, position)

    def close(self) -> None:
        del self.llm, self.model
        if self.device == "cuda":
            torch.cuda.empty_cache()


class TransformersRunner:
    """transformers' Qwen3_5ForCausalLM in bf16 with random weights; decode through its DynamicCache."""

    PIECE = 4096

    def __init__(self, preset: str, max_length: int, device: str, dtype: torch.dtype):
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        text = dict(PRESETS[preset])
        text.pop("dtype", None)
        self.device = device
        with torch.device(device):
            self.model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text)).to(dtype).eval()
        try:
            import fla  # noqa: F401

            self.note = "flash-linear-attention installed"
        except ImportError:
            self.note = "flash-linear-attention not installed (torch fallback kernels)"

    @torch.no_grad()
    def prefill(self, token_ids: torch.Tensor) -> None:
        self.model(token_ids[None], logits_to_keep=1, use_cache=True)

    @torch.no_grad()
    def decode_step(self, context: int):
        # the cache is filled in pieces of PIECE tokens (a 32768-token prompt at once would hold 32768^2
        # attention scores per head); the step's cost depends on the cache's length, not on its values
        cache = None
        for start in range(0, context, self.PIECE):
            piece = torch.randint(0, 1000, (1, min(self.PIECE, context - start)), device=self.device)
            cache = self.model(piece, past_key_values=cache, logits_to_keep=1, use_cache=True).past_key_values
        token = torch.ones(1, 1, device=self.device, dtype=torch.int64)

        def step():  # the cache grows by one token a step: context L..L+steps
            with torch.no_grad():
                self.model(token, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return step

    def close(self) -> None:
        del self.model
        if self.device == "cuda":
            torch.cuda.empty_cache()


def run_benchmark(variants=VARIANTS, preset: str = "0.8b", prefill_lengths=PREFILL_LENGTHS,
                  decode_contexts=DECODE_CONTEXTS, steps: int = 200, warmup: int = 10,
                  out_dir: str | Path | None = None, device: str = "cuda") -> dict:
    """Time every variant; write the JSON and the plot to out_dir (none written when None); return the report."""
    config = parse_config(official_config(PRESETS[preset]))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dot is wrong in bf16
    if not variants:
        raise ValueError("no variants to run")
    started = time.perf_counter()
    hbm = measure_hbm_bandwidth(device)
    matmul = measure_matmul_rate(device)
    log(f"ceilings: HBM copy {hbm:.2f} TB/s, bf16 matmul {matmul:.0f} TFLOP/s")
    max_length = max(list(decode_contexts) + list(prefill_lengths)) + steps + warmup + 2  # decode advances
    results = []
    notes = {}
    generator = torch.Generator().manual_seed(0)
    for variant in variants:
        log(f"{variant}: building")
        runner = TransformersRunner(preset, max_length, device, dtype) if variant == "transformers" \
            else EngineRunner(variant, preset, max_length, device, dtype)
        notes[variant] = getattr(runner, "note", "")
        for length in prefill_lengths:
            if variant == "reference+torch.compile":
                notes[variant] = "decode only: the prefill is not compiled (see EngineRunner._compiled_decode)"
                break
            token_ids = torch.randint(0, config.vocab_size, (length,), generator=generator).to(device)
            prefill_steps = max(3, steps // 20) if length > 1024 else max(5, steps // 10)
            ms = time_calls(lambda: runner.prefill(token_ids), steps=min(prefill_steps, steps), warmup=min(2, steps),
                            device=device)
            flops = prefill_flops(config, length)
            results.append(dict(variant=variant, phase="prefill", context=length, batch=1, ms=ms, bytes=None,
                                flops=flops, pct_of_floor=100 * flops / (ms * 1e-3) / (matmul * 1e12)))
            log(f"{variant}: prefill {length}: {ms:.3f} ms")
        for context in decode_contexts:
            step = runner.decode_step(context)
            ms = time_calls(step, steps=steps, warmup=min(warmup, steps), device=device, back_to_back=True)
            counted = decode_bytes(config, context).total
            results.append(dict(variant=variant, phase="decode", context=context, batch=1, ms=ms, bytes=counted,
                                flops=None, pct_of_floor=100 * counted / (ms * 1e-3) / (hbm * 1e12)))
            log(f"{variant}: decode at {context}: {ms * 1e3:.1f} us ({results[-1]['pct_of_floor']:.1f}% of HBM)")
        runner.close()
        report = dict(
            gpu=torch.cuda.get_device_name() if device == "cuda" else f"CPU ({platform.machine()})",
            date=datetime.date.today().isoformat(), commit=_commit(), torch=torch.__version__,
            triton=_triton_version(), hbm_copy_TBps=hbm, matmul_TFLOPs=matmul, steps=steps, notes=notes,
            results=results, python=platform.python_version(), preset=preset, dtype=str(dtype).replace("torch.", ""),
            seconds=time.perf_counter() - started,
        )
        if out_dir is not None:
            write_report(report, out_dir)  # after every variant: a run cut short keeps what it measured
    return report


def _commit() -> str:
    """QWEN_TRITON_COMMIT when set (a copy of the tree without its git history, as on a lent GPU machine),
    else git's HEAD."""
    if os.environ.get("QWEN_TRITON_COMMIT"):
        return os.environ["QWEN_TRITON_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _triton_version() -> str:
    import triton

    return triton.__version__


def format_table(report: dict) -> str:
    rows = report["results"]

    def find(variant, phase, context):
        return next((r for r in rows if (r["variant"], r["phase"], r["context"]) == (variant, phase, context)), None)

    lines = [f"{report['gpu']}, {report['date']}, torch {report['torch']}, triton {report['triton']}; "
             f"HBM copy {report['hbm_copy_TBps']:.2f} TB/s, bf16 matmul {report['matmul_TFLOPs']:.0f} TFLOP/s"
             + (f"; the run took {report['seconds']:.0f} s" if "seconds" in report else ""), ""]
    contexts = sorted({(r["phase"], r["context"]) for r in rows}, key=lambda k: (k[0] != "prefill", k[1]))
    header = "| variant | " + " | ".join(
        f"prefill {c} (ms)" if p == "prefill" else f"decode @{c} (us)" for p, c in contexts) + " |"
    lines += [header, "|---" * (len(contexts) + 1) + "|"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for variant in variants:
        cells = []
        for phase, context in contexts:
            r = find(variant, phase, context)
            if r is None:
                cells.append("-")
                continue
            value = r["ms"] if phase == "prefill" else r["ms"] * 1e3
            speedups = []
            for base in ("transformers", "reference+torch.compile"):
                b = find(base, phase, context)
                if b is not None and base != variant:
                    speedups.append(f"{b['ms'] / r['ms']:.1f}x vs {'hf' if base == 'transformers' else 'compile'}")
            extra = f"; {', '.join(speedups)}" if speedups else ""
            cells.append(f"{value:.3f} ({r['pct_of_floor']:.0f}%{extra})" if phase == "prefill"
                         else f"{value:.1f} ({r['pct_of_floor']:.0f}%{extra})")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Percentages: decode = bytes that must move / time, of the measured HBM copy bandwidth; "
                 "prefill = FLOPs / time, of the measured bf16 matmul rate.")
    # the floors' counts (benchmark/floor.py, from the config): the same for every variant
    moved = {r["context"]: r["bytes"] for r in rows if r["phase"] == "decode"}
    work = {r["context"]: r["flops"] for r in rows if r["phase"] == "prefill"}
    if moved:
        lines.append("Bytes per decode token: " + "; ".join(f"@{c}: {b:,}" for c, b in sorted(moved.items())) + ".")
    if work:
        lines.append("FLOPs per prefill: " + "; ".join(f"{c} tokens: {f:,}" for c, f in sorted(work.items())) + ".")
    lines += [f"{variant}: {note}." for variant, note in report.get("notes", {}).items() if note]
    return "\n".join(lines)


def write_report(report: dict, out_dir: str | Path) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2)
    (out_dir / (file_name(f"{report['date']}-{report['gpu']}") + ".json")).write_text(text)
    (out_dir / "latest.json").write_text(text)
    try:
        plot(report, out_dir / "latest.png")
    except ImportError:
        log("matplotlib is not installed: no plot written (pip install 'qwen-triton[plot]')")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    rows = report["results"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    for variant in variants:
        decode = sorted((r["context"], r["ms"] * 1e3) for r in rows if r["variant"] == variant and r["phase"] == "decode")
        if decode:
            right.plot(*zip(*decode), marker="o", label=variant)
    right.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode latency per token (us)",
              title="decode, batch 1")
    right.legend(fontsize=7)
    prefill = [(r["variant"], r["ms"]) for r in rows if r["phase"] == "prefill" and r["context"] == 128]
    if prefill:
        bars = left.barh([v for v, _ in prefill], [ms for _, ms in prefill])
        left.bar_label(bars, labels=[f"{ms:.3g} ms" for _, ms in prefill], padding=3, fontsize=8)
        left.set(xscale="log", xlabel="prefill of 128 tokens (ms)", title="prefill latency")
        left.set_xlim(right=max(ms for _, ms in prefill) * 4)  # room for the labels
    for axes in (left, right):  # the log axes' minor ticks unlabelled: their labels overlap
        axes.xaxis.set_minor_formatter(NullFormatter())
        axes.yaxis.set_minor_formatter(NullFormatter())
    figure.suptitle(f"Qwen3.5-0.8B shape, bf16, {report['gpu']}, {report['date']}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plan_options(text: str) -> dict:
    """'split_k=False,pdl=None' -> {'split_k': False, 'pdl': None}: TritonModel's options (engine/plan.py's
    Options; '' -> the defaults), for benchmark scripts that compare settings. An unknown name is an error naming
    it and the options there are."""
    from ..engine.plan import Options

    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in Options.names():
            raise SystemExit(f"no plan option {name!r}: choose from {', '.join(Options.names())}")
        options[name] = ast.literal_eval(value.strip())
    return options
