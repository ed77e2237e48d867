"""Each config of the chunked delta rule's three kernels timed, and its real-shape GPU test, in one run.

The chunked gated delta rule (prefill) at Qwen3.5-0.8B's shape: every config of its three kernels, timed as
a prefill runs them, and the correctness check of test_gpu_chunked.

Inputs as the model feeds them: Hk = Hv = 16, Dk = Dv = 128, bf16 q, k, v, z, b, a as strided views of
one fused row (tests/operators/test_gated_delta_rule.py's make_inputs), transformers-like A_log and
dt_bias. Each time is per call, from a CUDA graph of `copies` back-to-back calls on as many distinct
inputs and states (18 for short prompts, as the 18 DeltaNet layers of a prefill), replayed:
- `call`: gated_delta_rule_chunked with the autotuner's picks;
- `prepare`: kernel 1 (`_chunk_prepare_kernel`) alone, at each of its configs; for prompts of more than
  chunk.SPLIT_PREPARE_TOKENS tokens, where kernel 1 runs as two (`_chunk_inverse_kernel`, then
  `_chunk_products_kernel`), `inverse alone` and `products alone` (chunk.launch_inverse, launch_products) at the
  picks, and `inverse` and `products`: the two together with one of them at each of its configs (the other at the
  autotuner's pick);
- `state (engine)`: kernel 2 as the engine runs it (chunk.launch_state_pass: in Gluon where state_pass.py
  applies);
- `state`: kernel 2 in Triton (`_chunk_state_kernel`, the sequential state pass) alone, at each of its configs;
- `output`: kernel 3 (`_chunk_output_kernel`) alone, at each of its configs.
Then the checks of test_gpu_chunked: errors against the float32 torch reference (Frobenius and max of o
relative to the reference, Frobenius of the final state) for the default precision mix and the "tf32" and
"ieee" options, within the test's bounds, and a bit-identical repeat of the default call. The options run
each kernel at its first config (no tuning: they are accuracy options).

--baseline REV_OR_FILE also times another version of chunk.py (a git revision, or a copy of the file) as
`baseline call`, every kernel of it tuned over its own configs (whatever kernels that version has: the
versions before the state pass had a prepare kernel and a recurrence), so that the two calls compare the
versions as a prefill runs them; its compilation and tuning come on top of this run's.

--chunk-sizes 32,64 runs all of it at each chunk size (chunk_size=None: the size the engine's prefill takes at
each length, chunk.chunk_size_for).

    python3 benchmarks/chunk_sweep.py [--tokens 128,4096] [--chunk-sizes 32,64] [--out chunk.json]
        [--baseline REV_OR_FILE] [--check-only]

QWEN_TRITON_TUNING=default runs it without the H200's pins (tuning/__init__.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import triton

from qwen_triton.benchmark.harness import time_graph
from qwen_triton.operators.gated_delta_rule import chunk

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from tests.operators import test_gated_delta_rule as test_helpers  # noqa: E402  (the test's inputs and checks)

kernel_arguments = test_helpers.kernel_arguments

HEADS, DIM = 16, 128
DEVICE, DTYPE = "cuda", torch.bfloat16
# test_gpu_chunked's bounds: (o Frobenius, o max, state Frobenius) relative errors; None: not checked
BOUNDS = {None: (1.5e-2, 2e-2, 1e-2), "tf32": (1e-2, None, 5e-3), "ieee": (1e-2, None, 5e-3)}


def make_inputs(rows: int, seed: int) -> dict:
    """The test's inputs (test_gated_delta_rule.make_inputs) at the real shapes, bf16 on the GPU."""
    return test_helpers.make_inputs(rows, HEADS, HEADS, DIM, DIM, DTYPE, DEVICE, seed=seed)


def initial_state(seed: int = 1) -> torch.Tensor:
    """test_gpu_chunked's initial state."""
    return test_helpers.random_state((HEADS, DIM, DIM), DEVICE, seed=seed) * 0.2


def short(config) -> str:
    meta = " ".join(f"{key}={value}" for key, value in config.kwargs.items())
    registers = f" maxnreg={config.maxnreg}" if config.maxnreg else ""
    return f"{meta} warps={config.num_warps} stages={config.num_stages}{registers}".strip()


def tuned_picks(module) -> str:
    """The autotuner's pick for each kernel of a chunk.py module (after a call), by the kernel's name."""
    return "; ".join(f"{name.removeprefix('_chunk_').removesuffix('_kernel')} {short(kernel.best_config)}"
                     for name, kernel in vars(module).items()
                     if isinstance(kernel, triton.runtime.Autotuner) and hasattr(kernel, "best_config"))


def with_configs(autotuner, configs) -> None:
    autotuner.configs = configs
    autotuner.cache = {}


def graph_us(launch, count: int) -> float:
    """Time per call of a CUDA graph of `count` calls launch(0), ..., launch(count - 1), replayed."""
    calls = iter(range(10**9))
    return time_graph(lambda: launch(next(calls) % count), calls=count, replays=20) * 1e3


def check(length: int, chunk_size=None) -> list[dict]:
    """test_gpu_chunked at this length: the default mix (autotuned), then the tf32 and ieee options."""
    inputs = make_inputs(length, seed=20)
    initial = initial_state()
    float_inputs = dict(inputs, q=inputs["q"].float(), k=inputs["k"].float(), v=inputs["v"].float())
    ref_out, ref_state = test_helpers.reference_chunked(float_inputs, initial.clone())
    rows = []
    kernels = (chunk._chunk_prepare_kernel, chunk._chunk_inverse_kernel, chunk._chunk_products_kernel,
               chunk._chunk_state_kernel, chunk._chunk_output_kernel)
    all_configs = [list(kernel.configs) for kernel in kernels]
    for precision, bounds in BOUNDS.items():
        if precision is not None:
            for kernel, configs in zip(kernels, all_configs):
                with_configs(kernel, configs[:1])
        started = time.perf_counter()
        state = initial.clone()
        out = chunk.gated_delta_rule_chunked(*kernel_arguments(inputs), state, dot_precision=precision,
                                             chunk_size=chunk_size)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started  # compilation and tuning included
        errors = (test_helpers.frobenius_error(out, ref_out), test_helpers.max_error(out, ref_out),
                  test_helpers.frobenius_error(state, ref_state))
        row = dict(T=length, chunk=chunk_size or chunk.chunk_size_for(length), precision=precision or "default",
                   out_frobenius=errors[0], out_max=errors[1], state_frobenius=errors[2], bounds=bounds,
                   first_call_s=seconds)
        passed = all(bound is None or error < bound for error, bound in zip(errors, bounds))
        if precision is None:
            again = initial.clone()
            repeat = chunk.gated_delta_rule_chunked(*kernel_arguments(inputs), again, chunk_size=chunk_size)
            row["bit_identical_repeat"] = bool(torch.equal(repeat, out) and torch.equal(again, state))
            passed = passed and row["bit_identical_repeat"]
        row["passed"] = passed
        rows.append(row)
    for kernel, configs in zip(kernels, all_configs):
        with_configs(kernel, configs)
    return rows


def load_baseline(where: str):
    """chunk.py of a git revision, or a copy of it at a path, as a module of the same package."""
    if os.path.isfile(where):
        with open(where) as f:
            source = f.read()
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        source = subprocess.run(["git", "show", f"{where}:qwen_triton/operators/gated_delta_rule/chunk.py"],
                                cwd=root, capture_output=True, text=True, check=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "chunk_baseline.py")  # kept: Triton reads the kernels' source
    with open(path, "w") as f:
        f.write(source)
    name = "qwen_triton.operators.gated_delta_rule.chunk_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def sweep(length: int, baseline=None, chunk_size=None) -> list[dict]:
    size = chunk_size or chunk.chunk_size_for(length)
    copies = 18 if length <= 256 else 2
    sets = [make_inputs(length, seed=100 + i) for i in range(copies)]
    states = [initial_state(seed=200 + i) for i in range(copies)]
    outs = [torch.empty(length, HEADS, DIM, device=DEVICE, dtype=DTYPE) for _ in range(copies)]
    kernels = {"prepare": chunk._chunk_prepare_kernel, "state": chunk._chunk_state_kernel,
               "output": chunk._chunk_output_kernel}
    rows = []

    def call(i):
        chunk.gated_delta_rule_chunked(*kernel_arguments(sets[i]), states[i], out=outs[i], chunk_size=size)

    call(0)  # the autotuner's picks (tuned by check() already)
    picks = {name: short(kernel.best_config) if hasattr(kernel, "best_config") else None  # None: never ran
             for name, kernel in kernels.items()}
    rows.append(dict(T=length, chunk=size, kernel="call", config=tuned_picks(chunk), us=graph_us(call, copies),
                     autotuner_pick=True))

    if baseline is not None:
        def baseline_call(i):
            baseline.gated_delta_rule_chunked(*kernel_arguments(sets[i]), states[i], out=outs[i])

        baseline_call(0)  # tunes its kernels
        # chunk: the sweep it was timed beside (the baseline runs its own chunk size)
        rows.append(dict(T=length, chunk=size, kernel="baseline call", config=tuned_picks(baseline),
                         us=graph_us(baseline_call, copies), autotuner_pick=True))

    # each copy its own scratch: the state pass replays a consistent (bounded) update of its state
    scratches = [chunk.chunk_scratch(inputs["q"], inputs["v"], None, size) for inputs in sets]

    split = length > chunk.SPLIT_PREPARE_TOKENS

    def prepare_only(i):
        chunk.launch_prepare(*kernel_arguments(sets[i]), scratches[i])

    def state_only(i):
        chunk.launch_state_pass(states[i], scratches[i])

    def triton_state_only(i):
        chunk.launch_triton_state_pass(states[i], scratches[i])

    def output_only(i):
        chunk.launch_output(sets[i]["q"], sets[i]["k"], outs[i], scratches[i])

    swept = [("state", state_only), ("output", output_only)]
    if split:
        kernels.update(inverse=chunk._chunk_inverse_kernel, products=chunk._chunk_products_kernel)
        picks.update((name, short(kernels[name].best_config)) for name in ("inverse", "products"))
        for i in range(copies):  # the inverses that the products read
            prepare_only(i)
        for name, launch in (("inverse alone", chunk.launch_inverse), ("products alone", chunk.launch_products)):
            def part(i, launch=launch):  # at the picks
                launch(*kernel_arguments(sets[i]), scratches[i])

            rows.append(dict(T=length, chunk=size, kernel=name, config=picks[name.split()[0]],
                             us=graph_us(part, copies), autotuner_pick=True))
        swept = [("inverse", prepare_only), ("products", prepare_only)] + swept
    else:
        swept = [("prepare", prepare_only)] + swept
    # the state pass as the engine runs it (in Gluon where state_pass.py applies), then Triton's configs
    for i in range(copies):
        prepare_only(i)
    rows.append(dict(T=length, chunk=size, kernel="state (engine)", config="launch_state_pass",
                     us=graph_us(state_only, copies), autotuner_pick=True))
    swept = [(name, triton_state_only if name == "state" else launch) for name, launch in swept]
    for name, launch in swept:
        kernel = kernels[name]
        all_configs = list(kernel.configs)
        for config in all_configs:
            with_configs(kernel, [config])
            for i in range(copies):  # compiles; the inputs of the later kernels
                launch(i) if name == "prepare" else prepare_only(i)
                triton_state_only(i)
            rows.append(dict(T=length, chunk=size, kernel=name, config=short(config), us=graph_us(launch, copies),
                             autotuner_pick=short(config) == picks[name]))
        with_configs(kernel, all_configs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--chunk-sizes", help="e.g. 32,64 (default: the engine's choice at each length)")
    parser.add_argument("--out")
    parser.add_argument("--baseline", help="a git revision or a file: another chunk.py to time the call of")
    parser.add_argument("--check-only", action="store_true", help="the checks without the sweep")
    args = parser.parse_args()
    started = time.perf_counter()
    baseline = load_baseline(args.baseline) if args.baseline else None
    checks, rows = [], []
    sizes = [int(c) for c in args.chunk_sizes.split(",")] if args.chunk_sizes else [None]
    for length in (int(t) for t in args.tokens.split(",")):
        for size in sizes:
            checks += check(length, size)
            if not args.check_only:
                rows += sweep(length, baseline, size)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), checks=checks, rows=rows), f, indent=1)
    print(f"{torch.cuda.get_device_name()}: us per call, back to back in a CUDA graph ({time.perf_counter() - started:.0f} s "
          "in all, compilation included); * the autotuner's pick")
    for length, size in dict.fromkeys((r["T"], r["chunk"]) for r in checks):
        mine = [r for r in rows if r["T"] == length and r["chunk"] == size]
        if mine:
            print(f"T={length}, chunks of {size}: call {mine[0]['us']:.1f} us ({mine[0]['config']})")
        else:
            print(f"T={length}, chunks of {size}")
        for r in (r for r in mine if r["kernel"] == "baseline call"):
            print(f"  baseline call {r['us']:.1f} us ({r['config']})")
        for name in ("inverse alone", "products alone", "inverse", "products", "prepare", "state (engine)", "state",
                     "output"):
            timed = sorted((r for r in mine if r["kernel"] == name), key=lambda r: r["us"])
            if not timed:
                continue
            print(f"  {name:14s} " + "; ".join(f"{r['us']:.1f}{'*' if r['autotuner_pick'] else ''} ({r['config']})"
                                              for r in timed))
        for c in (c for c in checks if c["T"] == length and c["chunk"] == size):
            bounds = ", ".join("-" if b is None else f"{b:.0e}" for b in c["bounds"])
            repeat = f", bit-identical repeat {c['bit_identical_repeat']}" if "bit_identical_repeat" in c else ""
            print(f"  check {c['precision']:7s} o frob {c['out_frobenius']:.2e} max {c['out_max']:.2e}, state frob "
                  f"{c['state_frobenius']:.2e} (bounds {bounds}){repeat}: {'PASS' if c['passed'] else 'FAIL'} "
                  f"(first call {c['first_call_s']:.1f} s)")


if __name__ == "__main__":
    main()
