"""`qwen-triton profile`: one decode step and one prefill of the Triton engine, kernel by kernel.

For each operator of the model (`TritonModel._operator` names them, with the bytes and FLOPs of their
floor) and each kernel it launches: the kernel's time, the gap before it (the GPU idle between the end
of the previous kernel and the start of this one), and the operator's floor, max(bytes / HBM bandwidth,
FLOPs / matmul rate), as a share of its time. The ceilings are measured in the same run.

How: a first, eager step runs with a Triton launch hook that records which operator launched which
kernel (`engine.trace.KernelTrace`); then the step is timed under the CUDA profiler (torch.profiler,
CUPTI) as the engine runs it: replaying its CUDA graphs (decode, and a prefill whose length repeats).
Kernel i of the timeline is launch i of the trace (their names are checked to agree). The profiler's
own cost is small per kernel but not zero: compare the step time here with `qwen-triton bench`.

The report ends with the config each autotuned kernel ran with, per tuning key (operators.common.
autotune_choices): which tiles and splits the autotuner picked for the shapes of this run.

On a CPU (the interpreter, which calls no launch hooks) each operator is timed on the host as a whole:
the same report, without kernel names or gaps, so that CI runs the command end to end.
"""

from __future__ import annotations

import statistics

import torch

from ..engine.packed import aligned
from ..engine.trace import KernelTrace
from .floor import decode_bytes
from .harness import log, measure_hbm_bandwidth, measure_matmul_rate


def _floor_us(op, hbm_TBps: float, matmul_TFLOPs: float) -> float:
    return max(op.bytes / (hbm_TBps * 1e12), op.flops / (matmul_TFLOPs * 1e12)) * 1e6


def cuda_kernel_events(prof, names: set[str]) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of the device kernels whose names are in `names`, by start time."""
    events = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name in names:
            events.append((event.name, event.time_range.start, event.time_range.end))
    return sorted(events, key=lambda e: e[1])


def _timeline(run, trace: KernelTrace, steps: int) -> tuple[list[float], list[float], list[float]] | None:
    """Median duration and gap per launch over `steps` runs, and each run's span; None when the profiler's
    kernels do not line up with the trace."""
    from torch.profiler import ProfilerActivity, profile

    launches = [name for _, name in trace.launches()]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
    events = cuda_kernel_events(prof, set(launches))
    count = len(launches)
    if len(events) != steps * count or any(
            events[s * count + k][0] != launches[k] for s in range(steps) for k in range(count)):
        log(f"profile: {len(events)} kernels recorded for {steps} x {count} launches: no per-kernel timeline")
        return None
    durations, gaps, spans = [[] for _ in range(count)], [[] for _ in range(count)], []
    for s in range(steps):
        run_events = events[s * count:(s + 1) * count]
        for k, (_, start, end) in enumerate(run_events):
            durations[k].append(end - start)
            if k > 0:
                gaps[k].append(start - run_events[k - 1][2])
        spans.append(run_events[-1][2] - run_events[0][1])
    return ([statistics.median(d) for d in durations], [statistics.median(g) if g else 0.0 for g in gaps], spans)


def _report(trace: KernelTrace, timeline, hbm: float, matmul: float) -> dict:
    timed: dict[int, list[dict]] = {id(op): [] for op in trace.operators}
    if timeline is not None:
        for k, (op, name) in enumerate(trace.launches()):  # launch k is kernel k of the timeline
            timed[id(op)].append(dict(name=name, us=timeline[0][k], gap_before_us=timeline[1][k]))
    operators = []
    for op in trace.operators:
        kernels = timed[id(op)]
        if timeline is not None:
            us = sum(k["us"] for k in kernels)
            gap = sum(k["gap_before_us"] for k in kernels)
        else:
            us, gap = op.host_us, 0.0
        floor = _floor_us(op, hbm, matmul)
        operators.append(dict(kind=op.kind, layer=op.layer, bytes=op.bytes, flops=op.flops, us=us, gap_before_us=gap,
                              floor_us=floor, pct_of_floor=100 * floor / us if us else 0.0, kernels=kernels))
    kinds: dict[str, dict] = {}
    for op in operators:
        row = kinds.setdefault(op["kind"], dict(kind=op["kind"], count=0, kernels=0, us=0.0, gap_before_us=0.0,
                                                bytes=0, flops=0, floor_us=0.0))
        row["count"] += 1
        row["kernels"] += len(op["kernels"])
        for key in ("us", "gap_before_us", "bytes", "flops", "floor_us"):
            row[key] += op[key]
    for row in kinds.values():
        row["pct_of_floor"] = 100 * row["floor_us"] / row["us"] if row["us"] else 0.0
        # what the operator adds to the span: with PDL a kernel's own time includes waiting for the previous
        # one (its gap before is then negative); the shares add up to about the span (medians of each)
        row["span_share_us"] = row["us"] + row["gap_before_us"]
    kernel_us = sum(op["us"] for op in operators)
    gap_us = sum(op["gap_before_us"] for op in operators)
    span = statistics.median(timeline[2]) if timeline is not None else kernel_us
    floor = sum(op["floor_us"] for op in operators)
    return dict(span_us=span, kernel_us=kernel_us, gap_us=gap_us, floor_us=floor,
                pct_of_floor=100 * floor / span if span else 0.0, kernel_count=sum(len(op.kernels) for op in trace.operators),
                per_kernel=timeline is not None, by_kind=list(kinds.values()), operators=operators)


def profile_decode(model, context: int, steps: int, hbm: float, matmul: float, rows: int = 1,
                   params=None) -> dict:
    """Profile one decode step of `model` (a TritonModel) for slots 0..rows-1, each at `context` tokens of
    context, as generation runs it (with the feedback kernel that makes its ids the next step's inputs); every row
    with the SamplingParams `params` (default greedy)."""
    from ..engine.sampling import SamplingParams
    from ..engine.device_sampling import DeviceSampling
    from ..engine.graphs import restore_states, save_states

    device = model.device
    token = torch.ones(rows, device=device, dtype=torch.int64)
    position = torch.full((rows,), context, device=device, dtype=torch.int64)
    sampling = DeviceSampling.build([params or SamplingParams()] * rows, device)
    mode = sampling.mode
    for slot in range(rows):  # a penalized mode's history: the slot's prompt, here one token
        if params is not None and params.penalized:
            model.history.start(slot, token[:1])
    counter = torch.zeros(rows, device=device, dtype=torch.int64)
    model.decode_tokens(token, position, sampling, counter, feedback=True)  # warm-up: compile, autotune, capture
    buffers = model.buffers_for(rows)
    saved = save_states(model.state, model.history, buffers.slots)
    model.trace_context = context
    on_gpu = device.type == "cuda"
    model.trace = KernelTrace()
    try:
        with model.trace:
            model.decode_step(buffers, mode, feedback=True)
        trace = model.trace
    finally:
        model.trace = None
    if not on_gpu:
        restore_states(model.state, model.history, saved)
        return dict(context=context, rows=rows, mode=mode, timeline="host (interpreter)",
                    **_report(trace, None, hbm, matmul))
    torch.cuda.synchronize()
    timeline = _timeline(lambda: model.run_step(buffers, mode, feedback=True), trace, steps)
    where = "cuda graph" if model.plan.cuda_graph else "eager"
    if timeline is None and model.plan.cuda_graph:
        timeline = _timeline(lambda: model.decode_step(buffers, mode, feedback=True), trace, steps)
        where = "eager: the profiler recorded no kernels inside the CUDA graph, so gaps include host time"
    if timeline is None:
        raise RuntimeError("the CUDA profiler's kernels do not match the launches of the step")
    restore_states(model.state, model.history, saved)
    report = _report(trace, timeline, hbm, matmul)
    report["bytes_counted_by_floor"] = decode_bytes(model.config, context, rows).total
    return dict(context=context, rows=rows, mode=mode, timeline=where, pdl=model.plan.pdl, **report)


def profile_prefill(model, tokens: int, steps: int, hbm: float, matmul: float, prompts: int = 1) -> dict:
    """Profile a prefill of `prompts` prompts of `tokens` random tokens each, into slots 0..prompts-1, as the engine
    runs it (`prefill_batch`: with cuda_graph its packed bucket's graphs, or where packed_prefill is off a CUDA graph
    once the length repeats; eager otherwise)."""
    device = model.device
    generator = torch.Generator().manual_seed(0)
    token_ids = [torch.randint(0, model.config.vocab_size, (tokens,), generator=generator).to(device)
                 for _ in range(prompts)]
    slots = list(range(prompts))

    def reset():
        for slot in slots:
            model.reset(slot)

    def run():
        reset()
        model.prefill_batch(token_ids, slots)

    def run_eager():  # the same kernels launched now, for the trace (prefill_batch's choice of path)
        reset()
        if model.plan.packed_prefill and (prompts > 1 or model.packed_graphs is not None):
            model.prefill_packed(token_ids, slots, [0] * prompts, graphs=False)
        else:
            for ids, slot in zip(token_ids, slots):
                model.prefill_eager(ids, slot, 0, False)

    run()  # warm-up: compile, autotune
    run()  # with cuda_graph: capture
    on_gpu = device.type == "cuda"
    model.trace = KernelTrace()
    try:
        with model.trace:
            run_eager()
        trace = model.trace
    finally:
        model.trace = None
    if not on_gpu:
        return dict(tokens=tokens, prompts=prompts, timeline="host (interpreter)", **_report(trace, None, hbm, matmul))
    timeline, where = _timeline(run, trace, steps), "cuda graph" if model.plan.cuda_graph else "eager"
    if timeline is None and model.plan.cuda_graph:
        timeline = _timeline(run_eager, trace, steps)
        where = "eager: the profiler recorded no kernels inside the CUDA graph, so gaps include host time"
    if timeline is None:
        raise RuntimeError("the CUDA profiler's kernels do not match the launches of the prefill")
    return dict(tokens=tokens, prompts=prompts, timeline=where, **_report(trace, timeline, hbm, matmul))


def run_profile(preset: str = "0.8b", context: int = 128, prefill_tokens: int = 128, steps: int = 20,
                device: str = "cuda", pdl: bool | None = None, rows: int = 1, prompts: int = 1, sampling=None) -> dict:
    from .models import random_llm

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    hbm = measure_hbm_bandwidth(device)
    matmul = measure_matmul_rate(device)
    log(f"ceilings: HBM copy {hbm:.2f} TB/s, matmul {matmul:.0f} TFLOP/s")
    # room for the decode's context, and for the prompts in one packed pass (a pass holds max_length's rows); no
    # LLM warm-up: the profile warms its two shapes up itself, and its autotune choices list only theirs
    max_length = max(context + 2, prefill_tokens + 2, prompts * aligned(prefill_tokens))
    llm = random_llm(preset, "triton", device=device, dtype=dtype, max_length=max_length,
                     pdl=pdl, warm_up=False, max_batch=max(rows, prompts))
    model = llm.model
    log("profiling a decode step")
    decode = profile_decode(model, context, steps, hbm, matmul, rows=rows, params=sampling)
    log("profiling a prefill")
    prefill = profile_prefill(model, prefill_tokens, max(2, steps // 4), hbm, matmul, prompts=prompts)
    from ..operators.common import autotune_choices

    return dict(preset=preset, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                hbm_copy_TBps=hbm, matmul_TFLOPs=matmul, decode=decode, prefill=prefill,
                autotune_choices=autotune_choices())


def format_profile(report: dict) -> str:
    lines = [f"{report['device']}: HBM copy {report['hbm_copy_TBps']:.2f} TB/s, "
             f"matmul {report['matmul_TFLOPs']:.0f} TFLOP/s"]
    for phase, title in (("decode", "decode step at context {context}"), ("prefill", "prefill of {tokens} tokens")):
        part = report[phase]
        heading = title.format(**part) + (f", {part['rows']} rows" if part.get("rows", 1) > 1 else "")
        heading += f", {part['prompts']} prompts" if part.get("prompts", 1) > 1 else ""
        heading += f", {part['mode']} mode" if part.get("mode", "greedy") != "greedy" else ""
        lines += ["", f"{heading} ({part['timeline']}{', PDL' if part.get('pdl') else ''}): "
                  f"{part['span_us']:.1f} us first kernel start to last kernel end; {part['kernel_count']} kernels "
                  f"{part['kernel_us']:.1f} us + gaps {part['gap_us']:.1f} us; floor {part['floor_us']:.1f} us "
                  f"({part['pct_of_floor']:.1f}% of floor)", "",
                  "| operator | count | kernels | time (us) | gaps before (us) | share of the span (us) | MB | "
                  "floor (us) | % of floor |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in sorted(part["by_kind"], key=lambda r: -(r["us"] + r["gap_before_us"])):
            lines.append(f"| {row['kind']} | {row['count']} | {row['kernels']} | {row['us']:.1f} | "
                         f"{row['gap_before_us']:.1f} | {row['span_share_us']:.1f} | "
                         f"{row['bytes'] / 1e6:.1f} | {row['floor_us']:.1f} | {row['pct_of_floor']:.0f}% |")
    choices = report.get("autotune_choices") or []
    if choices:
        lines += ["", "autotuned configs that ran (kernel, its tuning key, the config chosen):", "",
                  "| kernel | key | config |", "|---|---|---|"]
        for choice in choices:
            config = ", ".join(f"{name} {value}" for name, value in choice["config"].items())
            registers = f", at most {choice['maxnreg']} registers" if choice.get("maxnreg") else ""
            lines.append(f"| {choice['kernel']} | {', '.join(choice['key'])} | {config}, "
                         f"{choice['num_warps']} warps, {choice['num_stages']} stages{registers} |")
    return "\n".join(lines)

