"""The pieces a projection kernel fuses around its dot products, shared by the GEMV, the GEMM and the LM head.

Prologues (the GEMV and the LM head apply them to each x tile as it is loaded, so the transformed x never
goes to memory; the GEMM applies them in a pass of their own before its main loop, see gemm.py):
- norm: x <- rms_norm(x) * (1 + w), Qwen3.5's zero-centred RMSNorm over the whole row of K, in float32,
  rounded to x's dtype exactly where the reference rounds it. The row's 1/rms comes from `row_rstd`, a
  first pass over the row (K = 1024 elements: 2 KB from L2 per row, next to the 2*N*K bytes of weights).
- gate: x <- x * sigmoid(gate), float32, rounded to x's dtype (the attention output gate before o_proj).

Epilogues (applied to the float32 accumulators before the one store):
- folded norm: acc *= rstd of each row, from the row's sums of squares that the kernel which wrote x left
  (`load_row_squares`, `folded_rstd`): the zero-centred RMSNorm of x with its (1 + w) folded into the weight's
  columns, so no pass over x is needed (the GEMM; see linear.py);
- swiglu: out = silu(acc_gate) * acc_up, the gate and up rows of one [2I, K] weight accumulated side by side;
- residual: out = acc + residual (residual may be the output itself: an in-place add, safe because each
  output element is read and then written by the same program);
- squares: after the store, each tile writes the sum over its columns of the squares of its rounded outputs,
  one float32 a row per SQUARES_COLUMNS columns of the output (the tile's sum in its first such slot, zeros
  in the others), the row sums a folded norm of this output needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_ACTIVATION = tl.constexpr(0)
SWIGLU = tl.constexpr(1)
# the squares epilogue's slots: one float32 a row per this many output columns; a tile writing them spans a
# multiple of it (BLOCK_N >= SQUARES_COLUMNS, both powers of two). SQUARES_SLOT_COLUMNS: the same number for the
# kernels (a global a kernel reads must be a constexpr; the compiler rejects a plain int, the interpreter not)
SQUARES_COLUMNS = 32
SQUARES_SLOT_COLUMNS = tl.constexpr(SQUARES_COLUMNS)


@triton.jit
def dot(a, b, acc):
    """acc + a @ b, float32 inputs in full precision (Triton would otherwise round them to tf32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
             CACHE: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of rows offs_m of x [M, K], in float32: [BLOCK_M]. CACHE: the loads' cache
    modifier ("" the default; ".cg": from L2, for an x that other programs of the same launch wrote)."""
    rows = offs_m.to(tl.int64) * stride_xm
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] + offs_k[None, :], mask=mask, other=0.0,
                    cache_modifier=CACHE).to(tl.float32)
        squares += x * x
    return tl.math.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def load_row_squares(squares_ptr, stride_sm, offs_m, M, PARTS, BLOCK_PARTS: tl.constexpr):
    """The sums of squares of rows offs_m of an x whose squares [M, PARTS] hold PARTS float32 a row (the squares
    epilogue's, or `rms_norm.row_squares`'s): [BLOCK_M, BLOCK_PARTS], zeros past PARTS and M. The GEMM issues this
    load before its main loop and reduces it after (`folded_rstd`), so that the load's latency hides behind the
    loop instead of delaying either end of it."""
    parts = tl.arange(0, BLOCK_PARTS)
    mask = (offs_m < M)[:, None] & (parts < PARTS)[None, :]
    return tl.load(squares_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + parts[None, :], mask=mask, other=0.0)


@triton.jit
def folded_rstd(row_squares, K, eps):
    """1 / sqrt(mean(x^2) + eps) of rows of an x [M, K] from their partial sums of squares [BLOCK_M, BLOCK_PARTS]
    (`load_row_squares`), in float32: [BLOCK_M]."""
    return tl.math.rsqrt(tl.sum(row_squares, axis=1) / K + eps)


@triton.jit
def prologue(x, offs_m, offs_k, mask, K, gate_ptr, stride_gm, norm_ptr, rstd,
             HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr):
    """The x tile [BLOCK_M, BLOCK_K] as the projection sees it: normalised and/or gated, in x's dtype."""
    if HAS_NORM:
        weight = tl.load(norm_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd[:, None] * (1.0 + weight)[None, :]).to(x.dtype)
    if HAS_GATE:
        gate_rows = offs_m.to(tl.int64) * stride_gm
        gate = tl.load(gate_ptr + gate_rows[:, None] + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * tl.sigmoid(gate)).to(x.dtype)
    return x


@triton.jit
def accumulate(
    x_ptr, stride_xm, w_ptr, stride_wn, up_offset, offs_m, offs_n, M, N, k_start, k_end,
    PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x[offs_m, k_start:k_end] @ w[offs_n, k_start:k_end].T in float32 on the tensor cores (BLOCK_M >= 16):
    [BLOCK_M, BLOCK_N]. One token uses `accumulate_row` instead.

    Both tiles go from memory straight to the dot, so the compiler pipelines their loads (num_stages
    buffers in shared memory); a prologue that transformed x here would take x through registers every step
    and, on the H200, made the projections 1.6-2.6x slower (benchmarks/gemm_sweep.py): the GEMM's prologue
    runs as its own pass (gemm.py). Short prompts too (docs/decisions.md, D52: the engine's
    prefill of 128 tokens, benchmarks/prefill_options.py, commits 9f52f19 and 71d2f3b): 1,599 us with the pass,
    1,661 with only the attention gate in the main loop, 1,952-2,313 with the norms too (their rstd over the
    program's rows first).
    PAIR: also accumulate the rows offs_n + up_offset / stride_wn (the up half of a gate_up weight)
    from the same x tiles; returns (acc, acc_up), acc_up = acc when not PAIR.
    """
    x_rows = offs_m.to(tl.int64) * stride_xm
    w_rows = offs_n.to(tl.int64) * stride_wn
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # the weight tile is loaded K-major ([BLOCK_K, BLOCK_N] view of row-major [N, K])
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptr + w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0)
        acc = dot(x, w, acc)
        if PAIR:
            w_up = tl.load(w_ptr + up_offset + w_rows[None, :] + offs_k[:, None], mask=w_mask, other=0.0)
            acc_up = dot(x, w_up, acc_up)
    if not PAIR:
        acc_up = acc
    return acc, acc_up


@triton.jit
def load_weight_tile(w_ptr, w_rows, up_offset, n_mask, offs_k, k_end, PAIR: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at rows w_rows (offsets) and columns offs_k (masked at k_end),
    and with PAIR the up tile up_offset further on (else the same tile again)."""
    mask = n_mask[:, None] & (offs_k < k_end)[None, :]
    w = tl.load(w_ptr + w_rows[:, None] + offs_k[None, :], mask=mask, other=0.0)
    if PAIR:
        w_up = tl.load(w_ptr + up_offset + w_rows[:, None] + offs_k[None, :], mask=mask, other=0.0)
    else:
        w_up = w
    return w, w_up


@triton.jit
def accumulate_row(
    x_ptr, x_row, w_ptr, w_rows, up_offset, n_mask, gate_ptr, stride_gm, norm_ptr, rstd,
    offs_m, K, k_start, k_end, w, w_up,
    PAIR: tl.constexpr, HAS_GATE: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_CACHE: tl.constexpr,
):
    """One token's x[k_start:k_end] (the row at offset x_row; offs_m = [its row index]) against BLOCK_N weight
    rows, on the CUDA cores: (acc, acc_up) [1, BLOCK_N] float32, acc_up = acc when not PAIR.

    A padded tensor-core dot would waste 15/16 of its work at one token, so each step multiplies and adds
    into a [BLOCK_N, BLOCK_K] accumulator reduced once at the end. w, w_up: the first tile, which the caller
    loads with `load_weight_tile` (before its PDL wait, so the weights stream while the previous kernel
    drains); each step loads the next tile one step ahead. X_CACHE: the x loads' cache modifier (see row_rstd).
    """
    wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    wide_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + x_row + offs_k[None, :], mask=k_mask[None, :], other=0.0, cache_modifier=X_CACHE)
        x = prologue(x, offs_m, offs_k, k_mask[None, :], K, gate_ptr, stride_gm, norm_ptr, rstd,
                     HAS_GATE, HAS_NORM).to(tl.float32)
        w_next, w_up_next = load_weight_tile(w_ptr, w_rows, up_offset, n_mask, offs_k + BLOCK_K, k_end, PAIR)
        wide += w.to(tl.float32) * x
        if PAIR:
            wide_up += w_up.to(tl.float32) * x
        w, w_up = w_next, w_up_next
    acc = tl.sum(wide, axis=1)[None, :]
    if PAIR:
        acc_up = tl.sum(wide_up, axis=1)[None, :]
    else:
        acc_up = acc
    return acc, acc_up


@triton.jit
def store_output(acc, acc_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, N,
                 ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 rstd=None, squares_ptr=None, stride_sm=0,
                 FOLDED_NORM: tl.constexpr = False, WRITE_SQUARES: tl.constexpr = False):
    """Folded norm (acc and acc_up times rstd [BLOCK_M]), activation, residual add, rounding to out's dtype, the
    masked store of one [BLOCK_M, BLOCK_N] tile, and with WRITE_SQUARES the sums of squares of its rows to
    squares [M, cdiv(N, SQUARES_COLUMNS)] (row stride stride_sm; see the module docstring)."""
    if FOLDED_NORM:
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    if ACTIVATION == SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if HAS_RESIDUAL:
        residual_rows = offs_m.to(tl.int64) * stride_rm
        residual = tl.load(residual_ptr + residual_rows[:, None] + offs_n[None, :], mask=mask, other=0.0)
        acc = acc + residual.to(tl.float32)
    out_rows = offs_m.to(tl.int64) * stride_om
    rounded = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + out_rows[:, None] + offs_n[None, :], rounded, mask=mask)
    if WRITE_SQUARES:
        # rows past M and columns past N hold zeros here (their x rows, weight rows and residual load as zeros)
        value = rounded.to(tl.float32)
        row_sums = tl.sum(value * value, axis=1)
        # the tile's sums in the slot of its first column, zeros in its other slots: one [BLOCK_M, BLOCK_N /
        # SQUARES_COLUMNS] store (faster than a [BLOCK_M] store per slot: docs/decisions.md, D49)
        slots = tl.arange(0, offs_n.shape[0] // SQUARES_SLOT_COLUMNS)
        first_slot = tl.min(offs_n, axis=0) // SQUARES_SLOT_COLUMNS
        sums = tl.where((slots == 0)[None, :], row_sums[:, None], 0.0)
        slot_mask = (offs_m < M)[:, None] & ((first_slot + slots) * SQUARES_SLOT_COLUMNS < N)[None, :]
        tl.store(squares_ptr + offs_m.to(tl.int64)[:, None] * stride_sm + (first_slot + slots)[None, :], sums,
                 mask=slot_mask)


@triton.jit
def store_split_output(acc, acc_up, partial_ptr, counter_ptr, split_index, out_ptr, stride_om, residual_ptr,
                       stride_rm, offs_m, offs_n, M, N,
                       SPLIT_K: tl.constexpr, ACTIVATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                       rstd=None, squares_ptr=None, stride_sm=0,
                       FOLDED_NORM: tl.constexpr = False, WRITE_SQUARES: tl.constexpr = False):
    """`store_output` for a tile whose K is split over SPLIT_K programs (GEMV and GEMM): this program's
    float32 partials go to partial_ptr [MAX_SPLIT_K, 2, M, N] (gate and up accumulators with swiglu, else
    the first), it counts its arrival on the tile's int32 counter, and the last of the tile's programs to
    arrive sums the partials in split order (the same sum whichever arrives last), stores the output and
    resets the counter, so a CUDA graph can replay the launch."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile_offsets = offs_m[:, None] * N + offs_n[None, :]
    tl.store(partial_ptr + (2 * split_index) * M * N + tile_offsets, acc, mask=mask)
    if ACTIVATION == SWIGLU:
        tl.store(partial_ptr + (2 * split_index + 1) * M * N + tile_offsets, acc_up, mask=mask)
    # every thread's partial stores precede the release of the arrival count
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLIT_K - 1:
        total = tl.zeros_like(acc)
        total_up = tl.zeros_like(acc)
        for split in tl.static_range(SPLIT_K):
            # .cg: read the other programs' partials from L2, never a stale L1 line
            total += tl.load(partial_ptr + (2 * split) * M * N + tile_offsets, mask=mask, other=0.0,
                             cache_modifier=".cg")
            if ACTIVATION == SWIGLU:
                total_up += tl.load(partial_ptr + (2 * split + 1) * M * N + tile_offsets, mask=mask, other=0.0,
                                    cache_modifier=".cg")
        store_output(total, total_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, N,
                     ACTIVATION, HAS_RESIDUAL, rstd, squares_ptr, stride_sm, FOLDED_NORM, WRITE_SQUARES)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def store_tile(acc, acc_up, row_squares, K, eps, partial_ptr, counter_ptr, split_index, out_ptr, stride_om,
               residual_ptr, stride_rm, offs_m, offs_n, M, N, SPLIT_K: tl.constexpr, ACTIVATION: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr, squares_ptr, stride_sm, FOLDED_NORM: tl.constexpr,
               WRITE_SQUARES: tl.constexpr):
    """A GEMM tile's epilogue and store: with FOLDED_NORM the rows' 1/rms from row_squares (`load_row_squares`,
    else None), then `store_output`, or with SPLIT_K > 1 `store_split_output` on the tile's counter."""
    if FOLDED_NORM:
        rstd = folded_rstd(row_squares, K, eps)
    else:
        rstd = None
    if SPLIT_K == 1:
        store_output(acc, acc_up, out_ptr, stride_om, residual_ptr, stride_rm, offs_m, offs_n, M, N,
                     ACTIVATION, HAS_RESIDUAL, rstd, squares_ptr, stride_sm, FOLDED_NORM, WRITE_SQUARES)
    else:
        store_split_output(acc, acc_up, partial_ptr, counter_ptr, split_index, out_ptr, stride_om, residual_ptr,
                           stride_rm, offs_m, offs_n, M, N, SPLIT_K, ACTIVATION, HAS_RESIDUAL,
                           rstd, squares_ptr, stride_sm, FOLDED_NORM, WRITE_SQUARES)


def split_workspace(cache: dict, device: torch.device, split_k: int, rows: int, N: int, tiles: int):
    """What `store_split_output` needs for up to `rows` x N outputs split over at most split_k programs:
    float32 partials [split_k, 2, rows, N] and `tiles` zeroed int32 arrival counters (one per output tile,
    which the last program of each tile resets). Allocated once per (device, rows, N) in `cache`: calls on
    one stream may share it, calls on concurrent streams must not."""
    key = (device, rows, N)
    if key not in cache:
        cache[key] = (torch.empty(split_k * 2 * rows * N, dtype=torch.float32, device=device),
                      torch.zeros(tiles, dtype=torch.int32, device=device))
    return cache[key]


def epilogue_operands(out: torch.Tensor, residual, norm_squares, squares_out) -> tuple[tuple, tuple]:
    """The GEMMs' optional epilogue tensors as their kernels take them: the (residual, norm_squares, squares_out)
    pointers, `out` standing in for an absent one (its constexpr flag keeps it untouched), and their row strides,
    0 for an absent one."""
    given = (residual, norm_squares, squares_out)
    return (tuple(out if tensor is None else tensor for tensor in given),
            tuple(0 if tensor is None else tensor.stride(0) for tensor in given))
