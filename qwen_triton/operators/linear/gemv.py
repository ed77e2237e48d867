"""Split-K GEMV: the projections of a decode step, out[M, N] = x[M, K] @ W[N, K].T for M <= 16 tokens.

A decode step is memory-bound: every weight byte is read once and used M times, so the floor is the
weight bytes over HBM bandwidth (about 4.8 TB/s on an H200). Qwen3.5-0.8B's projections (bf16, M = 1):

    projection                        N x K                 weight bytes   FLOPs (2*M*N*K)   floor
    Gated DeltaNet in-proj (+z,b,a)    8224 x 1024          16.8 MB        16.8 M            3.5 us
    attention in-proj (q+gate,k,v)     5120 x 1024          10.5 MB        10.5 M            2.2 us
    MLP gate+up (swiglu)               7168 x 1024          14.7 MB        14.7 M            3.1 us
    MLP down (+residual)               1024 x 3584           7.3 MB         7.3 M            1.5 us
    attention / DeltaNet out-proj      1024 x 2048           4.2 MB         4.2 M            0.9 us

(x, the output and the residual add M*(K + 2N)*2 bytes: a few KB.) N = 1024 gives only 128 programs of
8 rows, too few bytes in flight to reach the HBM bandwidth on 132 SMs, hence split-K: SPLIT_K programs
share each block of rows, each over its own slice of K.

Grid: (cdiv(N, BLOCK_N), SPLIT_K, M): one token per program, multiplied and added on the CUDA cores
(a tensor-core tile would waste 15/16 of its work at one token). Rows 2..16 re-read the weight tile from
L2 rather than sharing it: a row is then reduced exactly as it would be alone (batch invariance).

Programmatic dependent launch (pdl=True, Hopper): the kernel lets the next one launch at once and loads
its first weight tile before waiting for the previous kernel, so weight streaming overlaps the previous
kernel's tail (see common.py). The autotune space includes splits of exactly one tile per program, whose
whole weight slice is then in flight before the wait.

Deterministic split-K ("the last program reduces"): each split stores its float32 partial tile to a
workspace [SPLIT_K, 2, M, N], then increments a per-tile int32 counter (integer atomics are exact).
The program that sees SPLIT_K - 1 arrivals sums the SPLIT_K partials in split order 0, 1, ... (a fixed
order, whichever program arrives last), applies the epilogue, stores the output and resets the counter
to zero, so the workspace is ready for the next call without a memset (and the kernel is one launch,
capturable in a CUDA graph). No float atomics touch the output: run-to-run bit-identical.
The workspace is cached per (device, M, N): calls on one stream may share it, calls on
concurrent streams must not.

Autotuning: BLOCK_N, BLOCK_K, SPLIT_K, num_warps and num_stages per (M, N, K, fusions, dtypes), once, at
warm-up; `cache_results=True` writes the winner to Triton's cache directory ($TRITON_CACHE_DIR, default
~/.triton/cache) so a new process reads it instead of tuning again (see linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import active
from ..common import (
    allow_next_kernel,
    autotune_configs,
    interpreting,
    keep_preferred,
    preferred_entry,
    launch_options,
    wait_for_previous_kernel,
)
from .fusion import (
    SWIGLU,
    accumulate_row,
    load_weight_tile,
    row_rstd,
    split_workspace,
    store_output,
    store_split_output,
)

MAX_ROWS = 16  # the GEMV serves M <= 16 (one tensor-core tile of tokens)
INTERPRETER_WIDE_N = 4096


def _configs(split: bool) -> list[triton.Config]:
    # first: the interpreter's (small blocks, and a real split of K so the CPU tests exercise the reduction)
    configs = [triton.Config({"BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2 if split else 1}, num_warps=4, num_stages=2)]
    # (SPLIT_K, BLOCK_N, BLOCK_K, num_warps, num_stages): 8-32 rows of 256-1024 elements (0.5-2 KB
    # contiguous per row) per step; splits of K to put 256-1024 programs on the SMs when N is small, and
    # splits of exactly one tile per program (the whole weight slice in flight before the PDL wait)
    candidates = [
        (1, 8, 512, 4, 3), (1, 16, 256, 4, 3), (1, 16, 512, 8, 3), (1, 32, 256, 8, 2), (1, 8, 1024, 8, 1),
        (2, 8, 512, 4, 3), (2, 16, 256, 4, 3), (2, 16, 512, 8, 1), (2, 8, 1024, 8, 1),
        (4, 8, 256, 4, 3), (4, 16, 256, 4, 3), (4, 8, 512, 4, 2), (4, 16, 512, 8, 1),
        (7, 8, 512, 4, 1), (7, 16, 512, 8, 1),  # K = 3584 (the MLP down projection) in one tile per split
        (8, 8, 256, 4, 3), (8, 16, 128, 4, 3),
    ]
    for split_k, block_n, block_k, warps, stages in candidates:
        if split or split_k == 1:
            configs.append(triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k},
                                         num_warps=warps, num_stages=stages))
    return autotune_configs(configs)


SPLIT_CONFIGS = _configs(split=True)
NO_SPLIT_CONFIGS = _configs(split=False)
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in SPLIT_CONFIGS)
MIN_BLOCK_N = min(c.kwargs["BLOCK_N"] for c in SPLIT_CONFIGS + NO_SPLIT_CONFIGS)


# The config that was fastest in the decode step's own setting (back to back in a CUDA graph with PDL), by K, from
# this GPU's tuning table (tuning/h200.py): where it applies it is the only candidate; without a table (None) the
# autotuner chooses among all.
PREFERRED_BY_K = active().gemv_by_k


def _prune(configs, named_args, **kwargs):
    """Drop configs that split K into slices under one block, or whose one block overshoots K; then keep the
    in-graph winner for this K where it is among them (see PREFERRED_BY_K)."""
    K = named_args["K"]
    kept = [
        c for c in configs
        if (c.kwargs["SPLIT_K"] == 1 or K // c.kwargs["SPLIT_K"] >= c.kwargs["BLOCK_K"])
        and c.kwargs["BLOCK_K"] <= triton.next_power_of_2(K)
    ]
    return keep_preferred(kept, preferred_entry(PREFERRED_BY_K, K, ("SPLIT_K", "BLOCK_N", "BLOCK_K"))) or configs[:1]


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, residual_ptr, gate_ptr, norm_ptr, partial_ptr, counter_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om, stride_rm, stride_gm,
    eps,
    ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One token (row pid 2) times BLOCK_N weight rows over one split of K, on the CUDA cores.

    The weight tile of the next K step is loaded one step ahead; the first one before waiting for the
    previous kernel (PDL), so a program whose split is one tile has all its weights in flight while the
    kernel that writes its x is still draining.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    row = tl.program_id(2)
    allow_next_kernel(USE_PDL)
    offs_m = row + tl.arange(0, 1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w_rows = offs_n.to(tl.int64) * stride_wn
    up_offset = N * stride_wn
    # this split's slice of K, whole blocks except at the end of K
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # the first weight tile before the wait: no kernel writes the weights
    w, w_up = load_weight_tile(w_ptr, w_rows, up_offset, n_mask, k_start + tl.arange(0, BLOCK_K), k_end,
                               ACTIVATION == SWIGLU)
    wait_for_previous_kernel(USE_PDL)
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, 1, BLOCK_K, "")
    else:
        rstd = tl.zeros([1], dtype=tl.float32)
    acc, acc_up = accumulate_row(
        x_ptr, row.to(tl.int64) * stride_xm, w_ptr, w_rows, up_offset, n_mask, gate_ptr, stride_gm, norm_ptr, rstd,
        offs_m, K, k_start, k_end, w, w_up, ACTIVATION == SWIGLU, HAS_GATE, HAS_NORM, BLOCK_N, BLOCK_K, "",
    )
    if SPLIT_K == 1:
        store_output(acc, acc_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, N,
                     ACTIVATION, HAS_RESIDUAL)
    else:
        counter = counter_ptr + row * tl.num_programs(0) + pid_n
        store_split_output(acc, acc_up, partial_ptr, counter, pid_k, out_ptr, stride_om, residual_ptr, stride_rm,
                           offs_m, offs_n, M, N, SPLIT_K, ACTIVATION, HAS_RESIDUAL)


# M is not in the key: a row's result must not depend on how many rows share the call (batch invariance:
# a batched generation equals one at a time), so every M uses the config tuned first for its shape.
_KEY = ["N", "K", "ACTIVATION", "HAS_RESIDUAL", "HAS_GATE", "HAS_NORM"]
# restore_value: autotuning runs the kernel many times; an in-place residual add (out is residual) would
# otherwise be added once per run. Only the benchmark runs copy and restore: a tuned call does not.
_gemv_split = triton.autotune(configs=SPLIT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                              restore_value=["out_ptr"], cache_results=True)(_gemv_kernel)
_gemv_no_split = triton.autotune(configs=NO_SPLIT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                                 restore_value=["out_ptr"], cache_results=True)(_gemv_kernel)

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, M: int, N: int):
    """The split-K partials and arrival counters of M rows (fusion.split_workspace)."""
    return split_workspace(_workspaces, device, MAX_SPLIT_K, M, N, M * triton.cdiv(N, MIN_BLOCK_N))


def gemv(x, weight, out, *, residual=None, gate=None, norm_weight=None, eps=1e-6, activation=0, split_k=True,
         pdl=False):
    """Launch the GEMV on checked arguments (see linear.linear, which checks them)."""
    M, K = x.shape
    N = out.shape[1]
    if split_k:
        kernel = _gemv_split
        partial, counters = _workspace(x.device, M, N)
    else:
        kernel, partial, counters = _gemv_no_split, out, out

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], M)

    explicit = {}
    if interpreting() and N > INTERPRETER_WIDE_N:
        # the interpreter pays per program: a vocabulary-sized N (the LM head) gets wide blocks there (at most
        # 16 programs a row and split)
        kernel = _gemv_kernel
        explicit = dict(BLOCK_N=max(1024, triton.next_power_of_2(triton.cdiv(N, 16))), BLOCK_K=64,
                        SPLIT_K=2 if split_k else 1)
    kernel[grid](
        x, weight, out,
        out if residual is None else residual,
        x if gate is None else gate,
        x if norm_weight is None else norm_weight,
        partial, counters,
        M, N, K,
        x.stride(0), weight.stride(0), out.stride(0),
        0 if residual is None else residual.stride(0),
        0 if gate is None else gate.stride(0),
        eps,
        ACTIVATION=activation, HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        HAS_NORM=norm_weight is not None, USE_PDL=pdl, **explicit, **launch_options(pdl),
    )
    return out
