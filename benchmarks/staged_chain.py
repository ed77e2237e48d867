"""Does a kernel boundary still cost when the next kernel's programs are resident early? A chain of staged GEMV
launches whose programs fit two or three to an SM, against the same launches held to one an SM.

phase_sync.py (twelfth session) measured a launch per phase with PDL at 2.99 us a phase for 1.74 us of weight
bytes (the chain below): each program loads its slice into registers before its PDL wait, but a program of
the next launch can only start once the previous launch's program has left its SM (16 warps and 56 KB of
registers each), so the next slice's loads start at the boundary, not before it. Here each phase is one
launch of a Gluon kernel (the staged tail's tiles and sums, staged_out_projection_mlp.py): a loading warp
asks the TMA engine for the program's rows into shared memory at entry, the computing warps let the next
launch start (griddepcontrol.launch_dependents) at entry, wait for the previous launch (griddepcontrol.wait),
read the input vector and sum. A program takes 65-72 KB of shared memory and 288 threads, so the launch after
it can be resident on the same SM while it waits and computes: its weights stream during the boundary.

Modes (each LAYERS x (up [3584 x 1024], down [1024 x 3584]) in bf16, 352 MB, back to back in a CUDA graph):
  co-resident    the kernel as described (PDL), its registers bounded so that three (72 a thread) or two (96)
                 programs fit an SM
  one per SM     the same with `--blocker` KB more shared memory a program, so one program fills an SM
  no PDL         two an SM, launched without PDL (each launch waits for the previous to end)
Prints each mode's time per phase and the weight bytes over time as a share of the copy bandwidth, and checks
the chain's result against torch's.

    python3 benchmarks/staged_chain.py [--layers 24] [--repeats 20] [--blocker 128] [--out staged_chain.json]

GPU only (Hopper: TMA, mbarriers, griddepcontrol).
"""

from __future__ import annotations

import argparse

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from phase_sync import HIDDEN, INTERMEDIATE, chain_weights, report
from qwen_triton.benchmark.harness import measure_hbm_bandwidth, time_graph
from qwen_triton.operators.common import launch_options
from qwen_triton.operators.linear.staged_out_projection_mlp import (
    INPUT_SLICES,
    TILE_COLUMNS,
    TILE_ROWS,
    _groups_layout,
    _next_kernel_may_launch,
    _own_rows,
    _phase_sums,
    _previous_kernel_done,
    _stage,
    _vector_offsets,
    padded_groups,
    weight_descriptors,
)

WARPS = 8  # computing warps, and one loading warp
PROGRAMS = 128


@gluon.jit
def _load(descriptor, tiles, arrival, first_row, GROUPS: gl.constexpr, SLICES: gl.constexpr):
    """The loading warp: every tile of this program's rows, counted on one mbarrier."""
    mbarrier.expect(arrival, GROUPS * SLICES * TILE_ROWS * TILE_COLUMNS * 2)
    _stage(descriptor, tiles, arrival, first_row, GROUPS, SLICES)


@gluon.jit
def _compute(tiles, inputs, blocker, arrival, x_ptr, out_ptr, first_row, N: gl.constexpr, K: gl.constexpr,
             GROUPS: gl.constexpr, PADDED: gl.constexpr, SLICES: gl.constexpr, USE_PDL: gl.constexpr,
             BLOCKER: gl.constexpr, WARPS: gl.constexpr):
    """The computing warps: let the next launch start, wait for the previous one, then x into shared memory,
    the sums of this program's rows, their store."""
    layout: gl.constexpr = _groups_layout(PADDED, WARPS)
    _next_kernel_may_launch(USE_PDL)
    _previous_kernel_done(USE_PDL)
    offsets = _vector_offsets(WARPS)
    inputs.store(gl.load(x_ptr + offsets, mask=offsets < K, other=0.0, cache_modifier=".cg"))
    # touch the blocking allocation (BLOCKER bytes, at least 32 x WARPS) so that it stays
    blocker.slice(0, 32 * WARPS).store(gl.zeros([32 * WARPS], gl.int8, gl.BlockedLayout([1], [32], [WARPS], [0])))
    gl.thread_barrier()
    mbarrier.wait(arrival, 0)
    acc = _phase_sums(tiles, inputs, PADDED, SLICES, layout)
    rows, mask = _own_rows(first_row, N, GROUPS, PADDED, layout)
    gl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _staged_phase_kernel(descriptor, x_ptr, out_ptr, N: gl.constexpr, K: gl.constexpr, GROUPS: gl.constexpr,
                         PADDED: gl.constexpr, USE_PDL: gl.constexpr, BLOCKER: gl.constexpr, WARPS: gl.constexpr):
    SLICES: gl.constexpr = K // TILE_COLUMNS
    first_row = gl.program_id(0) * (GROUPS * TILE_ROWS)
    tiles = gl.allocate_shared_memory(descriptor.dtype, [SLICES, PADDED, TILE_ROWS, TILE_COLUMNS],
                                      descriptor.layout)
    inputs = gl.allocate_shared_memory(descriptor.dtype, [INPUT_SLICES * TILE_COLUMNS],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    blocker = gl.allocate_shared_memory(gl.int8, [BLOCKER], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    arrival = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(arrival, count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_compute, (tiles, inputs, blocker, arrival, x_ptr, out_ptr, first_row, N, K, GROUPS, PADDED, SLICES,
                    USE_PDL, BLOCKER, WARPS)),
        (_load, (descriptor, tiles, arrival, first_row, GROUPS, SLICES)),
    ], [1], [64])
    mbarrier.invalidate(arrival)


def phase_launch(n: int, k: int, programs: int = PROGRAMS) -> dict:
    """Row groups a program, padded, and the grid for an [n, k] weight."""
    groups = triton.cdiv(triton.cdiv(n, programs), TILE_ROWS.value)
    return dict(grid=triton.cdiv(n, groups * TILE_ROWS.value), GROUPS=groups, PADDED=padded_groups(groups))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--blocker", type=int, default=128,
                        help="KB of shared memory (a power of two) that make one program fill an SM")
    parser.add_argument("--out")
    args = parser.parse_args()
    layers = args.layers
    up, down, start, expected = chain_weights(layers)
    # a descriptor per layer's weight (the staged tail's tiles: [1, 4, 256] of [1, N, K])
    up_descriptors = [weight_descriptors(up[layer], up[layer], up[layer])[0] for layer in range(layers)]
    down_descriptors = [weight_descriptors(down[layer], down[layer], down[layer])[0] for layer in range(layers)]
    x = torch.empty(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h = torch.empty(1, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
    up_launch, down_launch = phase_launch(INTERMEDIATE, HIDDEN), phase_launch(HIDDEN, INTERMEDIATE)
    weight_bytes = (up.numel() + down.numel()) * 2
    bandwidth = measure_hbm_bandwidth()
    results = []
    least = 32 * WARPS  # the blocking allocation's smallest size (bytes)
    # (PDL, blocking bytes, registers a thread): 72 registers let three programs share an SM (288 threads each,
    # 64K registers), 96 two; the blocker one
    modes = {"co-resident, 3 an SM": (True, least, 72), "co-resident, 2 an SM": (True, least, 96),
             f"one per SM (+{args.blocker} KB)": (True, args.blocker * 1024, 96), "no PDL": (False, least, 96)}
    for mode, (pdl, blocker, registers) in modes.items():
        def chain():
            for layer in range(layers):
                for descriptor, source, target, n, k, launch in (
                        (up_descriptors[layer], x, h, INTERMEDIATE, HIDDEN, up_launch),
                        (down_descriptors[layer], h, x, HIDDEN, INTERMEDIATE, down_launch)):
                    _staged_phase_kernel[(launch["grid"],)](
                        descriptor, source, target, N=n, K=k, GROUPS=launch["GROUPS"], PADDED=launch["PADDED"],
                        USE_PDL=pdl, BLOCKER=blocker, WARPS=WARPS, num_warps=WARPS, maxnreg=registers,
                        **launch_options(pdl))

        x.copy_(start[None])
        chain()
        torch.cuda.synchronize()
        error = ((x[0].float() - expected).norm() / expected.norm()).item()
        us = time_graph(chain, calls=1, replays=args.repeats) * 1e3
        results.append(dict(mode=mode, us=us, us_per_phase=us / (2 * layers),
                            pct_of_copy=100 * weight_bytes / (us * 1e-6) / (bandwidth * 1e12), relative_error=error,
                            correct=error < 0.05))
        print(f"  {mode:24s} {us:8.1f} us a chain, {us / (2 * layers):5.2f} us a phase, "
              f"{results[-1]['pct_of_copy']:5.1f}% of the copy bandwidth; result {'right' if error < 0.05 else 'WRONG'}"
              f" ({error:.2e})")
    report(args.out, layers, weight_bytes, bandwidth, PROGRAMS, f"{WARPS} + 1 warps", WARPS, results)


if __name__ == "__main__":
    main()
