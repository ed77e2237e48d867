"""What a phase boundary costs a chain of decode GEMVs: kernel launches with PDL against one persistent kernel
whose programs meet at grid barriers, with the next phase's weights loaded into registers before each wait.

The measurement behind the persistent "megakernel" question of issue 6 (docs/perf-notes.md): a decode step is
~136 dependent phases, and each kernel boundary loses ~2.5 us. The chain here is LAYERS x (up: [3584 x 1024],
down: [1024 x 3584]) in bf16, x -> h = W_up x -> x = W_down h, the MLP's shapes (14.7 MB a layer, more than
the L2 over the chain), split over one program per SM (28 rows x 1024 or 8 rows x 3584 each, 56 KB), the same
work in every mode:
  launches     one kernel per phase, back to back in a CUDA graph with PDL: each program loads its weight
               slice, then waits for the previous kernel (griddepcontrol), then reads x (the engine's design)
  flags        one persistent launch; after each phase every program stores its phase number into its own
               flag (release) and waits until every flag has reached it (plain polling loads of all flags,
               then a fence): the next phase's slice was loaded before the wait
  counter      as flags, with one counter that every program adds 1 to (release) and polls
  no-sync      as flags with no barrier at all: wrong results, the chain's streaming time alone (the bound)
Prints each mode's time per chain, per phase, and the weight bytes over time as a share of the copy bandwidth;
checks every synchronised mode's result against torch's.

    python3 benchmarks/phase_sync.py [--layers 24] [--repeats 20] [--out phase_sync.json]

A persistent kernel needs all its programs resident at once: one program per SM, nothing else running.
GPU only (the waits would never end under the interpreter, which runs programs one after another).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl

from qwen_triton.benchmark.harness import measure_hbm_bandwidth, time_graph
from qwen_triton.operators.common import allow_next_kernel, launch_options, wait_for_previous_kernel

HIDDEN, INTERMEDIATE = 1024, 3584
WARPS = 16
MODES = {"flags": 0, "counter": 1, "no-sync": 2}


@triton.jit
def _fence():
    """fence.acq_rel.gpu: the plain loads that saw the other programs' release stores are ordered before
    everything after it."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", "=r,r", [tl.zeros([1], tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _signal(flags_ptr, epoch, MODE: tl.constexpr):
    tl.debug_barrier()  # every thread's stores of the phase before the release
    if MODE == 0:
        tl.atomic_xchg(flags_ptr + tl.program_id(0), epoch, sem="release", scope="gpu")
    elif MODE == 1:
        tl.atomic_add(flags_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait(flags_ptr, epoch, PROGRAMS: tl.constexpr, BLOCK_P: tl.constexpr, MODE: tl.constexpr):
    """Until every program has signalled `epoch`. BLOCK_P = the program's threads: one load per thread at
    most (flags: thread i reads program i's flag; counter: thread 0 alone), combined across the program."""
    lane = tl.arange(0, BLOCK_P)
    if MODE == 0:
        while tl.min(tl.load(flags_ptr + lane, mask=lane < PROGRAMS, other=2**30, volatile=True), axis=0) < epoch:
            pass
        _fence()
    elif MODE == 1:
        while tl.max(tl.load(flags_ptr + lane * 0, mask=lane == 0, other=0, volatile=True), axis=0) < epoch * PROGRAMS:
            pass
        _fence()


@triton.jit
def _slice(w_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr):
    """This program's rows of an [N, K] weight: (the [BLOCK_N, BLOCK_K] tile, its row offsets, their mask)."""
    share = tl.cdiv(N, PROGRAMS)
    lane = tl.arange(0, BLOCK_N)
    rows = tl.program_id(0) * share + lane
    row_mask = (lane < share) & (rows < N)
    columns = tl.arange(0, BLOCK_K)
    tile = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + columns[None, :],
                   mask=row_mask[:, None] & (columns < K)[None, :], other=0.0)
    return tile, rows, row_mask


@triton.jit
def _product(tile, x_ptr, K, rows, row_mask, out_ptr, BLOCK_K: tl.constexpr):
    columns = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + columns, mask=columns < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = tl.sum(tile.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _persistent_chain_kernel(x_ptr, h_ptr, up_ptr, down_ptr, flags_ptr, epoch_base, LAYERS: tl.constexpr,
                             HIDDEN: tl.constexpr, INTERMEDIATE: tl.constexpr, PROGRAMS: tl.constexpr,
                             BLOCK_P: tl.constexpr, UP_ROWS: tl.constexpr, DOWN_ROWS: tl.constexpr,
                             UP_K: tl.constexpr, DOWN_K: tl.constexpr, MODE: tl.constexpr):
    up, up_rows, up_mask = _slice(up_ptr, INTERMEDIATE, HIDDEN, UP_ROWS, UP_K, PROGRAMS)
    for layer in range(LAYERS):
        epoch = epoch_base + 2 * layer  # phases done before this layer's up phase
        if layer > 0:
            _wait(flags_ptr, epoch, PROGRAMS, BLOCK_P, MODE)
        _product(up, x_ptr, HIDDEN, up_rows, up_mask, h_ptr, UP_K)
        # the down slice before the wait: in flight while the other programs finish the up phase
        down, down_rows, down_mask = _slice(down_ptr + layer * HIDDEN * INTERMEDIATE, HIDDEN, INTERMEDIATE,
                                            DOWN_ROWS, DOWN_K, PROGRAMS)
        _signal(flags_ptr, epoch + 1, MODE)
        _wait(flags_ptr, epoch + 1, PROGRAMS, BLOCK_P, MODE)
        _product(down, h_ptr, INTERMEDIATE, down_rows, down_mask, x_ptr, DOWN_K)
        if layer + 1 < LAYERS:  # the next layer's up slice, in flight during the next wait
            up, up_rows, up_mask = _slice(up_ptr + (layer + 1) * INTERMEDIATE * HIDDEN, INTERMEDIATE, HIDDEN,
                                          UP_ROWS, UP_K, PROGRAMS)
        _signal(flags_ptr, epoch + 2, MODE)


@triton.jit
def _phase_kernel(x_ptr, w_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PROGRAMS: tl.constexpr, USE_PDL: tl.constexpr):
    allow_next_kernel(USE_PDL)
    tile, rows, row_mask = _slice(w_ptr, N, K, BLOCK_N, BLOCK_K, PROGRAMS)
    wait_for_previous_kernel(USE_PDL)
    _product(tile, x_ptr, K, rows, row_mask, out_ptr, BLOCK_K)


def chain_weights(layers: int):
    """The chain's weights and input, seeded: (up [layers, I, H], down [layers, H, I], start [H], the float
    result of the chain with bf16 roundings between phases, as the kernels round)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    up = (torch.randn(layers, INTERMEDIATE, HIDDEN, device="cuda", generator=generator) * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(layers, HIDDEN, INTERMEDIATE, device="cuda", generator=generator)
            * INTERMEDIATE**-0.5).bfloat16()
    start = torch.randn(HIDDEN, device="cuda", generator=generator).bfloat16()
    expected = start.float()
    for layer in range(layers):
        expected = (down[layer].float() @ (up[layer].float() @ expected).bfloat16().float()).bfloat16().float()
    return up, down, start, expected


def report(out, layers, weight_bytes, bandwidth, programs, program_text, warps, results) -> None:
    """The closing line, and the JSON at `out` (when given)."""
    print(f"{torch.cuda.get_device_name()}: {layers} layers, {2 * layers} phases, {weight_bytes / 1e6:.1f} MB of "
          f"weights, copy bandwidth {bandwidth:.2f} TB/s, {programs} programs of {program_text}")
    if out:
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), layers=layers, weight_bytes=weight_bytes,
                           copy_TBps=bandwidth, programs=programs, warps=warps, results=results), f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    layers = args.layers
    up, down, start, expected = chain_weights(layers)
    x = torch.empty(HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    shapes = dict(UP_ROWS=triton.next_power_of_2(triton.cdiv(INTERMEDIATE, programs)), UP_K=HIDDEN,
                  DOWN_ROWS=triton.next_power_of_2(triton.cdiv(HIDDEN, programs)),
                  DOWN_K=triton.next_power_of_2(INTERMEDIATE))
    weight_bytes = (up.numel() + down.numel()) * 2
    bandwidth = measure_hbm_bandwidth()
    results = []

    launched = {}

    def record(mode, times_ms, correct):
        us = statistics.median(times_ms) * 1e3
        same = bool(torch.equal(launched["x"], correct[1])) if launched else True
        results.append(dict(mode=mode, us=us, us_per_phase=us / (2 * layers),
                            pct_of_copy=100 * weight_bytes / (us * 1e-6) / (bandwidth * 1e12), correct=correct[0],
                            same_as_launches=same, times_ms=times_ms))
        print(f"  {mode:17s} {us:8.1f} us a chain, {us / (2 * layers):5.2f} us a phase, "
              f"{results[-1]['pct_of_copy']:5.1f}% of the copy bandwidth; result {'right' if correct[0] else 'WRONG'}"
              f"{', bit for bit as the launches' if same else ', not bit for bit as the launches'}")

    def right():  # 48 bf16 roundings in another order than torch's: a few percent of drift
        return ((x.float() - expected).norm() / expected.norm()).item() < 0.05, x.clone()

    for pdl in (True, False):
        def chain():
            for layer in range(layers):
                _phase_kernel[(programs,)](x, up[layer], h, INTERMEDIATE, HIDDEN, shapes["UP_ROWS"], shapes["UP_K"],
                                           programs, pdl, num_warps=WARPS, **launch_options(pdl))
                _phase_kernel[(programs,)](h, down[layer], x, HIDDEN, INTERMEDIATE, shapes["DOWN_ROWS"],
                                           shapes["DOWN_K"], programs, pdl, num_warps=WARPS, **launch_options(pdl))

        x.copy_(start)
        chain()
        torch.cuda.synchronize()
        correct = right()
        times = [time_graph(chain, calls=1, replays=args.repeats)]  # median of the replays
        record("launches" + ("" if pdl else " (no PDL)"), times, correct)
        launched.setdefault("x", correct[1])

    flags = torch.zeros(programs, device="cuda", dtype=torch.int32)
    for mode, number in MODES.items():
        flags.zero_()
        launches = 0
        times = []
        for repeat in range(args.repeats + 1):
            x.copy_(start)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            _persistent_chain_kernel[(programs,)](x, h, up, down, flags, launches * 2 * layers, layers, HIDDEN,
                                                  INTERMEDIATE, programs, 32 * WARPS, MODE=number, num_warps=WARPS,
                                                  **shapes)
            end.record()
            end.synchronize()
            launches += 1
            if repeat == 0:
                correct = right()
            else:
                times.append(begin.elapsed_time(end))
        record(mode, times, correct)
    report(args.out, layers, weight_bytes, bandwidth, programs, f"{WARPS} warps", WARPS, results)


if __name__ == "__main__":
    main()
