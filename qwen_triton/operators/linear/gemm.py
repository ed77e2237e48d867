"""Tiled GEMM: the projections of a prefill, out[M, N] = x[M, K] @ W[N, K].T for M > 16 tokens.

Each program computes one [BLOCK_M, BLOCK_N] output tile on the tensor cores, walking K in BLOCK_K steps
(software-pipelined over num_stages buffers); programs are ordered in groups of GROUP_M row-blocks so
that concurrently running programs share weight tiles in L2. The epilogues (SwiGLU of paired gate/up
accumulators, residual add) run on the float32 accumulators before the single store (see fusion.py).

The prologues (zero-centred RMSNorm of x, attention output gate) run first as a pass of their own,
`_prologue_kernel`: one program per row writes prologue(x) (fusion.prologue, the same rounding as the
GEMV's fused prologue) to a workspace, 2*M*K*2 bytes more (1 MB at M = 256, 17 MB at M = 4096: 4 us).
The engine's norms need no pass: their weights folded into the projections' (linear.py, "The folded norm"), the
GEMM scales its accumulators' rows by 1/rms in the epilogue (FOLDED_NORM, from norm_squares [M, P]: P floats a
row from L2), and the residual adds write the rows' sums of squares there for the next norm (WRITE_SQUARES: each
tile its rows' sums, one float a row per SQUARES_COLUMNS output columns; needs BLOCK_N >= SQUARES_COLUMNS).
Measured on the H200 (docs/decisions.md, D51; the profile at 4096 tokens, kernel medians): the
GEMMs that scale by 1/rms 3.1-4.6 us over the same tiles without it (the pass they replace took 5.2), those that
write the sums 0.7-0.8 us; in the engine's prefill (benchmarks/prefill_options.py, one process) 24-45 us faster at
128 tokens, 34-65 us at 4096 replayed. The sums' load issued before the main loop and reduced after it
(docs/decisions.md, D48; the loop does not wait for it): the scaling GEMMs 0.4-1.3 us a kernel faster at 4096 tokens.
Applied inside the main loop instead, the transform takes every x tile through registers and the
projections ran 1.6-2.6x slower on the H200 (benchmarks/gemm_sweep.py, 2026-11-29: the DeltaNet
in-projection at M = 4096 in 262 us fused against 132 us for the same tiles without it).

Floor for a prefill of M = 4096 tokens of Qwen3.5-0.8B (bf16; H200 ~ 990 TFLOP/s dense bf16, 4.8 TB/s):

    projection                       N x K          FLOPs 2*M*N*K   bytes (W + x + out)   compute floor
    Gated DeltaNet in-proj            8224 x 1024   69.0 G          16.8 + 8.4 + 67.4 MB  70 us
    attention in-proj                 5120 x 1024   42.9 G          10.5 + 8.4 + 41.9 MB  43 us
    MLP gate+up (swiglu, out 3584)    7168 x 1024   60.1 G          14.7 + 8.4 + 29.4 MB  61 us
    MLP down (+residual)              1024 x 3584   30.1 G           7.3 + 29.4 + 16.8 MB 30 us
    out-proj (+residual)              1024 x 2048   17.2 G           4.2 + 16.8 + 16.8 MB 17 us

At M = 4096 these are compute-bound (450-1150 FLOP/byte, above the H200's ~ 206 FLOP/byte ridge); at M of a
few dozen tokens they are bound by the weight bytes, like the GEMV.

A short prompt (M <= 256) is bound by the weight bytes, and a grid of tiles covering [M, N] has too few
programs to stream them: at M = 128 the MLP down projection (N = 1024) has 16 tiles of 128 x 64. Split-K
(SPLIT_K > 1, for M <= 256 and when the caller allows it) gives each tile SPLIT_K programs, each over a
K range: they write float32 partial tiles to a workspace, count their arrival on an int32 counter per
tile, and the last to arrive sums the partials in split order (deterministic whichever arrives last),
applies the epilogue, stores and resets the counter (so a CUDA graph can replay it): the GEMV's scheme.

Loads. For prompts of TMA_ROWS (257) tokens or more in 16-bit types, on Hopper, the x and weight tiles come
through tensor descriptors (`accumulate_described`: one TMA instruction per tile into shared memory, no
per-element address arithmetic or masks in the loop, zero fill past the edges) instead of pointer loads
(float32 keeps them unless gemm(tma=True) asks: only bf16 was measured on the GPU); the kernel,
its epilogues and its tile order are otherwise the same. Measured on the H200 (benchmarks/gemm_sweep.py,
back to back in a CUDA graph, 2026-11-30, commit 8e66760) at M = 4096, best pointer config -> best TMA
config -> cuBLAS's bare product, us: DeltaNet in-projection 149.6 -> 116.5 -> 96.8, gate/up 127.0 ->
106.2 -> 87.2, down 51.7 -> 46.7 -> 41.6, out-projection 32.2 -> 28.6 -> 26.5, attention in-projection
92.0 -> 75.9 -> 65.8; at M = 1024 14-26% faster. In the engine's prefill (docs/decisions.md, D57;
commits 4109275, 8e66760, 657be08) 15.59-15.76 -> 14.34 ms at 4096
tokens, 3.58-3.77 -> 3.11-3.59 at 384 and 512 (the GEMMs' median 20 -> 14 us), 4.77-5.06 -> 4.72-4.80 at
1024 (25 -> 22.5 us). At 128 tokens (split-K, the short prompts' pins) the TMA loads are slower in the
prefill (the GEMMs' median 9.0 -> 11.0 us), so short prompts keep the pointer loads.
A persistent TMA kernel (one program per SM looping over tiles, the tile loop flattened into the K loop
so that the next tile's loads overlap this one's epilogue: Triton's persistent matmul) is faster for
the in-projections in isolation (109.0 us) but slower for gate/up (127.1) and in the prefill (15.45 and
15.59 ms at 4096 tokens against 14.34): not kept (docs/decisions.md, D56).

PDL: with gemm(pdl=True) (a prompt of up to 256 tokens in the engine: the plan's prefill_pdl_tokens) the prologue pass
and the GEMM let the next kernel launch at their entry and wait for the previous kernel before their first
load; in the engine's 128-token prefill, with the convs and attention alike, 1,785 -> 1,756 us (docs/decisions.md,
D99). Asking the L2 for the program's weight rows before the wait is no faster (D100).

Autotuning: BLOCK_M/N/K, GROUP_M, SPLIT_K, num_warps, num_stages per (bucket of M = next power of two, N,
K, epilogues, dtypes), so a prefill of a new length reuses its bucket's choice; `cache_results=True` keeps
the choice in Triton's cache directory across processes (see linear.py). For prompts of up to
MAX_SPLIT_ROWS tokens, and of LONG_PROMPT_ROWS or more, the config measured fastest in a CUDA graph is the only
candidate (PREFERRED_BY_K, PREFERRED_LONG_BY_N; at 4096 tokens the same tiles won with the TMA loads). A decode
step of 2-128 rows (DECODE_ROWS) takes PREFERRED_DECODE_BY_K, one pick per K for every bucket but BLOCK_M (the
bucket's rows): a row's result then does not depend on how many rows share the step (measured with PDL as the step
launches them: benchmarks/decode_gemm_sweep.py; docs/decisions.md, D149). Where rows may depend on their batch (the
engine without batch_invariant asks for `bucket_picks`), a bucket with its own picks in the table
(PREFERRED_DECODE_BY_ROWS: 64 rows, D180) launches the kernel with its pick for K directly, no autotuner.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from ...tuning import active
from ..common import (allow_next_kernel, autotune_configs, hopper_or_later, interpreting, keep_preferred,
                      launch_options, preferred_entry, shared_memory_limit, wait_for_previous_kernel)
from .fusion import (SQUARES_COLUMNS, SWIGLU, accumulate, dot, epilogue_operands, load_row_squares, prologue,
                     row_rstd, split_workspace, store_tile)


MAX_SPLIT_ROWS = 256  # split-K serves prompts of at most this many tokens
TMA_ROWS = active().gemm_tma_rows  # gemm(tma=None) loads through descriptors from this many rows on, where it can
MIN_BLOCK = 16  # the smallest BLOCK_M / BLOCK_N: sizes the arrival counters


def _configs(split: bool) -> list[triton.Config]:
    # first: the interpreter's (small blocks, and a real split of K so the CPU tests exercise the reduction)
    configs = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 2 if split else 1},
                             num_warps=4, num_stages=2)]
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the usual Hopper bf16 tiles, then
    # smaller tiles and splits of K that put 100-300 programs on the SMs for a prompt of 32-256 tokens.
    # Six more were swept on the H200 (benchmarks/gemm_sweep.py, 2026-11-29) and dropped (tuning time):
    # none came within 10% of the fastest config of any projection at M = 128 or 4096 without a prologue.
    for block_m, block_n, block_k, warps, stages, split_k in [
        (128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1), (64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1),
        (64, 64, 64, 4, 4, 1), (64, 32, 128, 4, 3, 1),
        (64, 64, 128, 4, 3, 4), (64, 64, 64, 4, 3, 8), (128, 64, 128, 8, 3, 8), (128, 64, 64, 4, 3, 4),
        (64, 128, 64, 4, 3, 2),
        # a decode step of 2-64 rows (and a prompt of as few tokens): short tiles of rows, the weights streamed by
        # 130-520 programs (N = 1024 split 4-8 ways, the in-projections 64-128 rows a program)
        (16, 64, 128, 4, 4, 1), (16, 128, 64, 4, 4, 1), (16, 64, 128, 4, 4, 4), (16, 64, 256, 4, 3, 8),
        (32, 64, 128, 4, 4, 1), (32, 64, 128, 4, 4, 4), (32, 32, 256, 4, 3, 8), (64, 32, 128, 4, 4, 8),
        # the decode pins' (tuning/h200.py, GEMM_DECODE_BY_K) at each BLOCK_M
        (64, 64, 128, 4, 4, 1), (16, 32, 256, 4, 3, 2), (32, 32, 256, 4, 3, 2), (64, 32, 256, 4, 3, 2),
        (16, 32, 128, 4, 4, 4), (32, 32, 128, 4, 4, 4), (64, 32, 128, 4, 4, 4),
        (16, 32, 128, 4, 4, 1), (32, 32, 128, 4, 4, 1), (64, 32, 128, 4, 4, 1),
    ]:
        if split or split_k == 1:
            configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                          "GROUP_M": 8, "SPLIT_K": split_k}, num_warps=warps, num_stages=stages))
    return autotune_configs(configs)


def _describe_blocks(nargs) -> None:
    """A TMA config's pre-hook: the descriptors' block shapes are the config's tiles."""
    nargs["x_ptr"].block_shape = [nargs["BLOCK_M"], nargs["BLOCK_K"]]
    nargs["w_ptr"].block_shape = [nargs["BLOCK_N"], nargs["BLOCK_K"]]


def _tma_configs(split: bool) -> list[triton.Config]:
    # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K); BLOCK_K = 64, a 128-byte row of bf16 (the
    # widest swizzled box). BLOCK_K = 128 (128 x 128 and 128 x 256 tiles, 2-3 stages) was 16-70% slower for
    # every projection at M = 4096 (benchmarks/gemm_sweep.py, commit fb1a75d) and 3.1 ms slower in the prefill
    # when pinned: not among them
    # first: the interpreter's (as in _configs)
    configs = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 8, "SPLIT_K": 2 if split else 1},
                             num_warps=4, num_stages=2, pre_hook=_describe_blocks)]
    for block_m, block_n, block_k, warps, stages, split_k in [
        (128, 128, 64, 8, 3, 1), (128, 128, 64, 8, 4, 1), (128, 256, 64, 8, 3, 1),
        (128, 256, 64, 8, 4, 1), (128, 128, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1),
        (64, 64, 64, 4, 4, 1), (64, 64, 64, 4, 6, 1), (64, 32, 64, 4, 4, 1),
        (64, 64, 64, 4, 4, 2), (64, 64, 64, 4, 4, 4), (128, 64, 64, 4, 4, 4), (64, 128, 64, 4, 4, 2),
    ]:
        if split or split_k == 1:
            configs.append(triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                          "GROUP_M": 8, "SPLIT_K": split_k}, num_warps=warps, num_stages=stages,
                                         pre_hook=_describe_blocks))
    return autotune_configs(configs)


SPLIT_CONFIGS = _configs(split=True)
NO_SPLIT_CONFIGS = _configs(split=False)
TMA_SPLIT_CONFIGS = _tma_configs(split=True)
TMA_NO_SPLIT_CONFIGS = _tma_configs(split=False)
MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in SPLIT_CONFIGS + TMA_SPLIT_CONFIGS)


# The configs measured fastest in the prefill's own setting (back to back in a CUDA graph), from this GPU's tuning
# table (tuning/h200.py): by K for prompts of up to MAX_SPLIT_ROWS tokens, by N from LONG_PROMPT_ROWS tokens on
# and, on the TMA loads, in the bucket MEDIUM_PROMPT_BUCKET. Where one applies it is the only candidate; without
# a table (None) the autotuner chooses among all.
PREFERRED_BY_K = active().gemm_by_k  # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) by the largest K it serves
DECODE_ROWS = active().gemm_decode_rows  # buckets of up to this many rows take PREFERRED_DECODE_BY_K instead
PREFERRED_DECODE_BY_K = active().gemm_decode_by_k  # DECODE_FIELDS by K; BLOCK_M the bucket's rows, 16 to 64
# a decode bucket's own pick (gemm(bucket_picks=True)): bucket of rows -> BUCKET_FIELDS by K
PREFERRED_DECODE_BY_ROWS = dict(active().gemm_decode_by_rows or ())
LONG_PROMPT_ROWS = active().gemm_long_prompt_rows
PREFERRED_LONG_BY_N = active().gemm_long_by_n  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by N
MEDIUM_PROMPT_BUCKET = active().gemm_medium_prompt_bucket
PREFERRED_MEDIUM_BY_N = active().gemm_medium_by_n


TILE_FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")  # of the tables by N
DECODE_FIELDS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages")  # of the decode table, by K
BUCKET_FIELDS = ("BLOCK_M",) + DECODE_FIELDS  # of a decode bucket's own picks, by K
# the split workspace's partials: as many as any config (however few the autotuning space keeps) or any bucket's pick
WORKSPACE_SPLITS = max([MAX_SPLIT_K] + [values[3] for table in PREFERRED_DECODE_BY_ROWS.values() for _, values in table])


def pipeline_bytes(config, element_size: int, weight_tiles: int) -> int:
    """The shared memory of a config's pipeline: num_stages copies of its x tile [BLOCK_M, BLOCK_K] and its
    weight tiles [BLOCK_N, BLOCK_K] (two with SwiGLU's gate and up)."""
    k = config.kwargs
    return config.num_stages * (k["BLOCK_M"] + weight_tiles * k["BLOCK_N"]) * k["BLOCK_K"] * element_size


def fits_shared_memory(config, x, weight_tiles: int) -> bool:
    """Whether the config's pipeline fits the GPU's shared memory for x's dtype (the tables' pins were chosen in
    bf16: in float32 the same tiles take twice the bytes, and the gate/up pin then needs 294,912 of an H100's
    232,448). True where the limit is unknown (the interpreter; a tensor descriptor, always 16-bit)."""
    if not isinstance(x, torch.Tensor):
        return True
    limit = shared_memory_limit(x.device)
    return limit is None or pipeline_bytes(config, x.element_size(), weight_tiles) <= limit


def shape_takes(config, x, activation: int, write_squares: bool) -> bool:
    """Whether a config serves a launch's shape: its accumulators within 128 float32 registers a thread (two with
    SwiGLU), whole groups of SQUARES_COLUMNS columns where the epilogue writes the sums of squares, and its pipeline
    within the GPU's shared memory."""
    accumulators = 2 if activation == SWIGLU else 1
    return (config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"] * accumulators <= 128 * 32 * config.num_warps
            and (config.kwargs["BLOCK_N"] >= SQUARES_COLUMNS or not write_squares)
            and fits_shared_memory(config, x, accumulators))


def _prune(configs, named_args, **kwargs):
    """Drop tiles taller than the bucket of M (or shorter than 64 rows past 64 rows), accumulators over 128 float32
    registers per thread, and splits of K where not allowed (M > MAX_SPLIT_ROWS, or the caller's split_k=False); for a short prompt,
    keep the in-graph winner for this K where it is among them (PREFERRED_DECODE_BY_K up to DECODE_ROWS rows, then
    PREFERRED_BY_K), for a long one that
    for this N (PREFERRED_LONG_BY_N), and on the TMA loads for one of 513-1024 tokens that of
    PREFERRED_MEDIUM_BY_N."""
    bucket = named_args["M_BUCKET"]
    split_allowed = kwargs["SPLIT_ALLOWED"] and bucket <= MAX_SPLIT_ROWS
    kept = [
        c for c in configs
        if c.kwargs["BLOCK_M"] <= max(bucket, 64) and (c.kwargs["BLOCK_M"] >= 64 or bucket <= 64)
        and (c.kwargs["SPLIT_K"] == 1 or split_allowed)
        and shape_takes(c, named_args.get("x_ptr"), kwargs["ACTIVATION"], kwargs.get("WRITE_SQUARES"))
    ]
    if bucket <= DECODE_ROWS and "K" in named_args:
        preferred = preferred_entry(PREFERRED_DECODE_BY_K, named_args["K"], DECODE_FIELDS)
        if preferred is not None:
            preferred["BLOCK_M"] = min(max(bucket, MIN_BLOCK), 64)
        kept = keep_preferred(kept, preferred)
    elif bucket <= MAX_SPLIT_ROWS and "K" in named_args:
        kept = keep_preferred(kept, preferred_entry(PREFERRED_BY_K, named_args["K"],
                                                    ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")))
    if bucket >= LONG_PROMPT_ROWS and "N" in named_args:
        kept = keep_preferred(kept, preferred_entry(PREFERRED_LONG_BY_N, named_args["N"], TILE_FIELDS))
    if bucket == MEDIUM_PROMPT_BUCKET and kwargs.get("TMA") and "N" in named_args:
        kept = keep_preferred(kept, preferred_entry(PREFERRED_MEDIUM_BY_N, named_args["N"], TILE_FIELDS))
    if kept:
        return kept
    first = configs[0]
    return [triton.Config(dict(first.kwargs, SPLIT_K=1), num_warps=first.num_warps, num_stages=first.num_stages,
                          pre_hook=first.pre_hook)]


def bucket_pick(bucket: int, K: int, activation: int, write_squares: bool, x=None) -> dict | None:
    """A decode bucket's own pick for K (PREFERRED_DECODE_BY_ROWS) as launch settings, where the shape takes it
    (`shape_takes`, and the split workspace); None where the table has none or the shape does not take it (the one
    pick per K then serves)."""
    pick = preferred_entry(PREFERRED_DECODE_BY_ROWS.get(bucket), K, BUCKET_FIELDS)
    if pick is None:
        return None
    pick["GROUP_M"] = 8
    config = triton.Config({name: pick[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K")},
                           num_warps=pick["num_warps"], num_stages=pick["num_stages"])
    return pick if pick["SPLIT_K"] <= WORKSPACE_SPLITS and shape_takes(config, x, activation, write_squares) else None


@triton.jit
def _prologue_kernel(x_ptr, gate_ptr, norm_ptr, out_ptr, M, K, stride_xm, stride_gm, stride_om, eps,
                     HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    """out[row] = prologue(x[row]): the normalised (rstd * (1 + w)) or gated (sigmoid(gate)) row the GEMM
    multiplies, rounded to x's dtype. One program per row; bytes 2*K*2 (+ K*2 of gate) per row."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    offs_m = row + tl.arange(0, 1)
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, 1, BLOCK_K, "")
    else:
        rstd = tl.zeros([1], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_k < K)[None, :]
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        x = prologue(x, offs_m, offs_k, mask, K, gate_ptr, stride_gm, norm_ptr, rstd, HAS_GATE, HAS_NORM)
        tl.store(out_ptr + row.to(tl.int64) * stride_om + offs_k[None, :], x, mask=mask)


@triton.jit
def accumulate_described(x_desc, w_desc, m_start, n_start, up_rows, k_start, k_end, PAIR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`accumulate` with the tiles loaded through tensor descriptors (the TMA unit on Hopper: one
    instruction per tile, no address arithmetic in the loop, zero fill past the tensor's edges): x rows
    m_start.. and weight rows n_start.. (and with PAIR the up rows up_rows further), columns k_start..k_end
    (a multiple of BLOCK_K from k_start, or the end of K, past which the descriptor reads zeros)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        x = x_desc.load([m_start, k0])
        acc = dot(x, w_desc.load([n_start, k0]).T, acc)
        if PAIR:
            acc_up = dot(x, w_desc.load([up_rows + n_start, k0]).T, acc_up)
    if not PAIR:
        acc_up = acc
    return acc, acc_up


@triton.jit
def _tile_coordinates(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number `tile`, in groups of GROUP_M row blocks (the tiles
    running at once share weight tiles in L2)."""
    num_m = tl.cdiv(M, BLOCK_M)
    in_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // in_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_rows, (tile % in_group) // group_rows


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, residual_ptr, partial_ptr, counter_ptr, norm_squares_ptr, squares_ptr,
    M, N, K, M_BUCKET, PARTS,
    stride_xm, stride_wn, stride_om, stride_rm, stride_nm, stride_sm, eps,
    ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SPLIT_ALLOWED: tl.constexpr,
    FOLDED_NORM: tl.constexpr, WRITE_SQUARES: tl.constexpr, BLOCK_PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr, TMA: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):
    # M_BUCKET and SPLIT_ALLOWED only key the autotuning (M rounded up to a power of two; splits allowed).
    # TMA: x_ptr and w_ptr are tensor descriptors (`_described`) and the tiles come through the TMA unit.
    # FOLDED_NORM: the rows' sums of squares in norm_squares [M, PARTS] scale the accumulators (fusion.py);
    # WRITE_SQUARES: the output rows' sums of squares to squares (fusion.store_output).
    # USE_PDL: launched with PDL (everything after the wait)
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = _tile_coordinates(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # the folded norm's sums of squares of the rows (P floats a row from L2): loaded before the main loop and
    # reduced after it, so that the main loop waits for neither the load nor the reduction
    if FOLDED_NORM:
        row_squares = load_row_squares(norm_squares_ptr, stride_nm, offs_m, M, PARTS, BLOCK_PARTS)
    else:
        row_squares = None
    if TMA:
        acc, acc_up = accumulate_described(x_ptr, w_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, N, k_start, k_end,
                                           ACTIVATION == SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc, acc_up = accumulate(x_ptr, stride_xm, w_ptr, stride_wn, N * stride_wn, offs_m, offs_n, M, N,
                                 k_start, k_end, ACTIVATION == SWIGLU, BLOCK_M, BLOCK_N, BLOCK_K)
    store_tile(acc, acc_up, row_squares, K, eps, partial_ptr, counter_ptr + pid, pid_k, out_ptr, stride_om,
               residual_ptr, stride_rm, offs_m, offs_n, M, N, SPLIT_K, ACTIVATION, HAS_RESIDUAL, squares_ptr,
               stride_sm, FOLDED_NORM, WRITE_SQUARES)


_KEY = ["M_BUCKET", "N", "K", "ACTIVATION", "HAS_RESIDUAL", "SPLIT_ALLOWED", "FOLDED_NORM", "WRITE_SQUARES"]
# (a single config, as under the interpreter, is not pruned: the split list's first config then splits K
# at any M, and the launcher gives it a workspace)
_gemm_split = triton.autotune(configs=SPLIT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                              restore_value=["out_ptr"], cache_results=True)(_gemm_kernel)
_gemm_no_split = triton.autotune(configs=NO_SPLIT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                                 restore_value=["out_ptr"], cache_results=True)(_gemm_kernel)
_gemm_tma_split = triton.autotune(configs=TMA_SPLIT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune},
                                  restore_value=["out_ptr"], cache_results=True)(_gemm_kernel)
_gemm_tma_no_split = triton.autotune(configs=TMA_NO_SPLIT_CONFIGS, key=_KEY,
                                     prune_configs_by={"early_config_prune": _prune},
                                     restore_value=["out_ptr"], cache_results=True)(_gemm_kernel)

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_prologue_outputs: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, rows: int, N: int):
    """The split-K partials and arrival counters for M <= rows (a power of two: one workspace per bucket of
    M; fusion.split_workspace)."""
    tiles = triton.cdiv(rows, MIN_BLOCK) * triton.cdiv(N, MIN_BLOCK)
    return split_workspace(_workspaces, device, WORKSPACE_SPLITS, rows, N, tiles)


def apply_prologue(x, gate, norm_weight, eps, pdl=False):
    """prologue(x) [M, K] in a workspace per (device, dtype, bucket of M, K), which the GEMM reads at once
    (calls on one stream may share it, calls on concurrent streams must not)."""
    M, K = x.shape
    key = (x.device, x.dtype, triton.next_power_of_2(M), K)
    if key not in _prologue_outputs:
        _prologue_outputs[key] = torch.empty(key[2], K, dtype=x.dtype, device=x.device)
    out = _prologue_outputs[key][:M]
    _prologue_kernel[(M,)](
        x, x if gate is None else gate, x if norm_weight is None else norm_weight, out,
        M, K, x.stride(0), 0 if gate is None else gate.stride(0), out.stride(0), eps,
        HAS_GATE=gate is not None, HAS_NORM=norm_weight is not None, BLOCK_K=min(triton.next_power_of_2(K), 1024),
        num_warps=4, USE_PDL=pdl, **launch_options(pdl),
    )
    return out


def tma_available(device) -> bool:
    """Whether the GEMM can load its tiles through tensor descriptors on `device`: Hopper or later, or the
    interpreter (which emulates them)."""
    return interpreting() or hopper_or_later(device)


def _describable(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can address: 16-byte aligned base and row stride, unit last stride."""
    return (t.data_ptr() % 16 == 0 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0)


def _described(t: torch.Tensor) -> TensorDescriptor:
    # the block shape is a placeholder: each config's pre-hook sets its own (_describe_blocks)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [16, 16])


def gemm(x, weight, out, *, residual=None, gate=None, norm_weight=None, eps=1e-6, activation=0, split_k=True,
         tma=None, pdl=False, norm_squares=None, squares_out=None, bucket_picks=False):
    """Launch the prologue pass (with gate or norm_weight) and the GEMM on checked arguments (see
    linear.linear, which checks them). split_k: allow splits of K for M <= MAX_SPLIT_ROWS (the autotuner
    chooses). tma: load the tiles through tensor descriptors (None: for 16-bit x from TMA_ROWS rows on, where
    the device has them); x and weight must then be describable (16-byte aligned rows), else the pointer
    loads serve. pdl: launch both with programmatic dependent launch (Hopper; operators/common.py).
    norm_squares [M, P] float32: x's rows' sums of squares, for the folded norm (no prologue pass);
    squares_out [M, cdiv(N, SQUARES_COLUMNS)] float32: the output rows' sums of squares, written.
    bucket_picks: a decode bucket with its own pick in the tuning table (gemm_decode_by_rows) takes it; a row's bits
    then depend on its bucket (the engine asks for it in decode steps without batch_invariant)."""
    if gate is not None or norm_weight is not None:
        x = apply_prologue(x, gate, norm_weight, eps, pdl)
    M, K = x.shape
    if tma is None:
        tma = M >= TMA_ROWS and x.element_size() == 2 and tma_available(x.device)  # measured in bf16 only
    tma = tma and _describable(x) and _describable(weight)
    N = out.shape[1]
    bucket = triton.next_power_of_2(M)
    split_allowed = bool(split_k) and bucket <= MAX_SPLIT_ROWS
    if split_allowed or (split_k and len(SPLIT_CONFIGS) == 1):
        partial, counters = _workspace(x.device, bucket, N)
    else:
        partial, counters = x, x  # never touched: every config kept has SPLIT_K = 1
    if tma:
        kernel = _gemm_tma_split if split_k else _gemm_tma_no_split
        x_operand, w_operand = _described(x), _described(weight)
    else:
        kernel = _gemm_split if split_k else _gemm_no_split
        x_operand, w_operand = x, weight
    # a decode bucket's own pick: the kernel launched with it, no autotuner
    pick = (bucket_pick(bucket, K, activation, squares_out is not None, x)
            if bucket_picks and split_allowed and not tma else None)
    if pick is not None:
        kernel = _gemm_kernel

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    parts = 1 if norm_squares is None else norm_squares.shape[1]
    (residual_operand, squares_in, squares_operand), strides = epilogue_operands(out, residual, norm_squares,
                                                                                  squares_out)
    kernel[grid](
        x_operand, w_operand, out, residual_operand, partial, counters, squares_in, squares_operand,
        M, N, K, bucket, parts,
        x.stride(0), weight.stride(0), out.stride(0), *strides,
        eps,
        ACTIVATION=activation, HAS_RESIDUAL=residual is not None, SPLIT_ALLOWED=split_allowed,
        FOLDED_NORM=norm_squares is not None, WRITE_SQUARES=squares_out is not None,
        BLOCK_PARTS=triton.next_power_of_2(parts), TMA=tma, USE_PDL=pdl,
        **(pick or {}), **launch_options(pdl),
    )
    return out
