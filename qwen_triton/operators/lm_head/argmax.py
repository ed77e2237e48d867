"""Fused LM head + argmax: ids[m] = argmax_v (x[m] @ W[v].T) without writing the logits; optionally a
Gumbel-max draw at a temperature (sampling without top-k / top-p, fused the same way).

x [M, H], W [V, H] (Qwen3.5-0.8B: V = 248320, H = 1024, bf16, tied to the embedding). Two kernels:
1. grid (cdiv(V, BLOCK_V), M): each program computes a [1, BLOCK_V] tile of logits of one row
   over the whole of K (the final norm fused as the prologue with norm_weight=), scores it
   (score = logit, or logit / T + Gumbel noise for rows with temperature T > 0) and stores the tile's
   (max, lowest index of the max) per row;
2. one program per row reduces the tiles' (max, index) pairs in a fixed order, ties to the lowest index
   (torch.argmax's rule); it reads the number of tiles from the device, written by kernel 1, because
   that number follows the autotuned BLOCK_V.
Deterministic: no atomics; every reduction has a fixed order.

Many rows (`tiled=True`, a decode step of 32-128 sequences): kernel 1 becomes `_lm_head_argmax_tiled_kernel`,
grid (cdiv(V, BLOCK_V), cdiv(M, BLOCK_M)), BLOCK_M the rows' bucket up to 128: each program multiplies BLOCK_M rows of
x against BLOCK_V rows of W on the tensor cores (the GEMM's pipelined `accumulate`), so W is read once for all the
rows, and scores and stores its tile's (max, index) per row as above. The final norm then runs as the GEMM's
prologue pass (gemm.apply_prologue: x normed and rounded as the logits GEMM sees it). It replaces the float32 logits
GEMM and the sampler's pass over those logits: at 128 rows 127 MB of logits written and read again.

Floor at M = 1: the 508.6 MB of weights (106 us at 4.8 TB/s), 0.51 GFLOP; the partials are
8 bytes per tile per row (31 KB at BLOCK_V = 64) instead of 1 MB of float32 logits.

Autotuning: BLOCK_V, BLOCK_K, num_warps, num_stages per (V, K, fusions, dtypes), cached on disk like
the projections (see linear/linear.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tuning import active
from ..common import (
    allow_next_kernel,
    autotune_configs,
    check_same_device,
    check_tensor,
    interpreting,
    keep_preferred,
    launch_options,
    preferred_entry,
    wait_for_previous_kernel,
)
from ..linear.fusion import accumulate, accumulate_row, load_weight_tile, row_rstd
from ..linear.gemm import apply_prologue
from ..sampling.noise import check_noise_keys, gumbel_noise

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT32_MAX = tl.constexpr(2147483647)


def _configs() -> list[triton.Config]:
    configs = [triton.Config({"BLOCK_V": 32, "BLOCK_K": 32}, num_warps=4, num_stages=2)]  # the interpreter's
    for block_v, block_k, warps, stages in [
        (32, 256, 4, 3), (64, 128, 4, 3), (16, 512, 4, 3), (32, 512, 8, 2), (64, 256, 8, 3), (128, 128, 8, 3),
    ]:
        configs.append(triton.Config({"BLOCK_V": block_v, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages))
    return autotune_configs(configs)


CONFIGS = _configs()
MIN_BLOCK_V = min(c.kwargs["BLOCK_V"] for c in CONFIGS)


@triton.jit
def store_tile_best(logits, offs_m, m_mask, offs_v, v_mask, pid_v, temperature_ptr, seed_ptr, step_ptr, value_ptr,
                    index_ptr, MAX_TILES, SAMPLE: tl.constexpr, SEED_PER_ROW: tl.constexpr, BLOCK_V: tl.constexpr):
    """Kernel 1's epilogue: a tile's logits [rows, BLOCK_V] scored (the logit, or with SAMPLE logit / T + Gumbel
    noise for rows at T > 0), each row's (max, lowest index of the max) stored at its tile's slot."""
    score = logits
    if SAMPLE:
        temperature = tl.load(temperature_ptr + offs_m, mask=m_mask, other=0.0)
        sampling = temperature > 0
        scale = tl.where(sampling, temperature, 1.0)
        if SEED_PER_ROW:
            seed = tl.load(seed_ptr + offs_m, mask=m_mask, other=0)
            stream = offs_m * 0
        else:
            seed = tl.load(seed_ptr + offs_m * 0)
            stream = offs_m
        step = tl.load(step_ptr + offs_m, mask=m_mask, other=0)
        noise = gumbel_noise(seed[:, None], step[:, None], stream[:, None], offs_v[None, :])
        score = tl.where(sampling[:, None], logits / scale[:, None] + noise, logits)
    score = tl.where(v_mask[None, :], score, float("-inf"))
    best = tl.max(score, axis=1)
    best_index = tl.argmax(score, axis=1, tie_break_left=True) + pid_v * BLOCK_V
    slots = offs_m * MAX_TILES + pid_v
    tl.store(value_ptr + slots, best, mask=m_mask)
    tl.store(index_ptr + slots, best_index.to(tl.int32), mask=m_mask)


@triton.autotune(configs=CONFIGS, key=["V", "K", "HAS_NORM", "SAMPLE"], cache_results=True)
@triton.jit
def _lm_head_argmax_kernel(
    x_ptr, w_ptr, norm_ptr, temperature_ptr, seed_ptr, step_ptr, value_ptr, index_ptr, tiles_ptr,
    M, V, K, stride_xm, stride_wv, eps, MAX_TILES,
    HAS_NORM: tl.constexpr, SAMPLE: tl.constexpr, SEED_PER_ROW: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    allow_next_kernel(USE_PDL)
    pid_v = tl.program_id(0)
    row = tl.program_id(1)
    offs_m = row + tl.arange(0, 1)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    w_rows = offs_v.to(tl.int64) * stride_wv
    # the first weight tile before the wait: no kernel writes the weights
    w, _ = load_weight_tile(w_ptr, w_rows, 0, v_mask, tl.arange(0, BLOCK_K), K, False)
    wait_for_previous_kernel(USE_PDL)
    m_mask = offs_m < M
    if HAS_NORM:
        rstd = row_rstd(x_ptr, stride_xm, offs_m, M, K, eps, 1, BLOCK_K, "")
    else:
        rstd = tl.zeros([1], dtype=tl.float32)
    logits, _ = accumulate_row(
        x_ptr, row.to(tl.int64) * stride_xm, w_ptr, w_rows, 0, v_mask, x_ptr, 0, norm_ptr, rstd,
        offs_m, K, 0, K, w, w, False, False, HAS_NORM, BLOCK_V, BLOCK_K, "",
    )
    store_tile_best(logits, offs_m, m_mask, offs_v, v_mask, pid_v, temperature_ptr, seed_ptr, step_ptr, value_ptr,
                    index_ptr, MAX_TILES, SAMPLE, SEED_PER_ROW, BLOCK_V)
    if (pid_v == 0) & (row == 0):
        tl.store(tiles_ptr, tl.num_programs(0))


def _tiled_configs() -> list[triton.Config]:
    # (BLOCK_V, BLOCK_K, warps, stages); BLOCK_M is the launch's (the rows' bucket)
    return autotune_configs([
        triton.Config({"BLOCK_V": block_v, "BLOCK_K": block_k}, num_warps=warps, num_stages=stages)
        for block_v, block_k, warps, stages in [
            (64, 64, 4, 4), (128, 64, 8, 4), (64, 128, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3), (32, 128, 4, 4),
        ]])


TILED_CONFIGS = _tiled_configs()
MIN_BLOCK_V = min(MIN_BLOCK_V, *(c.kwargs["BLOCK_V"] for c in TILED_CONFIGS))
TILED_MAX_ROWS = 128  # BLOCK_M's largest: more rows take more row blocks
TILED_FIELDS = ("BLOCK_V", "BLOCK_K", "num_warps", "num_stages")


def _prune_tiled(configs, named_args, **kwargs):
    """The tuning table's pin for the bucket of rows where it is a candidate (tuning: lm_head_tiled_by_rows)."""
    return keep_preferred(configs, preferred_entry(active().lm_head_tiled_by_rows, named_args["M_BUCKET"],
                                                   TILED_FIELDS))


@triton.autotune(configs=TILED_CONFIGS, key=["M_BUCKET", "V", "K", "SAMPLE"],
                 prune_configs_by={"early_config_prune": _prune_tiled}, cache_results=True)
@triton.jit
def _lm_head_argmax_tiled_kernel(
    x_ptr, w_ptr, temperature_ptr, seed_ptr, step_ptr, value_ptr, index_ptr, tiles_ptr,
    M, V, K, M_BUCKET, stride_xm, stride_wv, MAX_TILES,
    SAMPLE: tl.constexpr, SEED_PER_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Kernel 1 for BLOCK_M rows a program: their logits against BLOCK_V rows of W on the tensor cores, scored as
    `_lm_head_argmax_kernel` scores them, each row's (max, lowest index of the max) stored. M_BUCKET keys the
    autotuning only."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid_v = tl.program_id(0)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_mask = offs_m < M
    v_mask = offs_v < V
    logits, _ = accumulate(x_ptr, stride_xm, w_ptr, stride_wv, 0, offs_m, offs_v, M, V, 0, K, False,
                           BLOCK_M, BLOCK_V, BLOCK_K)
    store_tile_best(logits, offs_m, m_mask, offs_v, v_mask, pid_v, temperature_ptr, seed_ptr, step_ptr, value_ptr,
                    index_ptr, MAX_TILES, SAMPLE, SEED_PER_ROW, BLOCK_V)
    if (pid_v == 0) & (tl.program_id(1) == 0):
        tl.store(tiles_ptr, tl.num_programs(0))


@triton.jit
def _argmax_reduce_kernel(value_ptr, index_ptr, tiles_ptr, out_ptr, MAX_TILES, reset_ptr, kept_ptr,
                          BLOCK_T: tl.constexpr, RESET: tl.constexpr, USE_PDL: tl.constexpr):
    """One program per row: the tiles' (max, index) pairs folded in order, ties to the lowest index. RESET: the
    row's float at reset_ptr copied to kept_ptr and set to -inf (screened.py's threshold)."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    tiles = tl.load(tiles_ptr)
    best = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
    best_index = tl.full([BLOCK_T], INT32_MAX, dtype=tl.int32)
    for t0 in range(0, tiles, BLOCK_T):
        offs = t0 + tl.arange(0, BLOCK_T)
        mask = offs < tiles
        value = tl.load(value_ptr + row * MAX_TILES + offs, mask=mask, other=float("-inf"))
        index = tl.load(index_ptr + row * MAX_TILES + offs, mask=mask, other=INT32_MAX)
        better = (value > best) | ((value == best) & (index < best_index))
        best = tl.where(better, value, best)
        best_index = tl.where(better, index, best_index)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, best_index, INT32_MAX), axis=0).to(tl.int64))
    if RESET:
        tl.store(kept_ptr + row, tl.load(reset_ptr + row))
        tl.store(reset_ptr + row, float("-inf"))


# one or two passes over the partials of a 248320-token row (3880-15520 tiles)
BLOCK_T = 2 if interpreting() else 8192
# the interpreter pays per operation: a row of more than INTERPRETER_WIDE_TILES partials is reduced there in
# a few passes (the tests' few tiles keep BLOCK_T 2, several passes)
INTERPRETER_WIDE_TILES = 256


def reduce_block(max_tiles: int) -> int:
    """The reduction's BLOCK_T over up to max_tiles partials a row: BLOCK_T, or under the interpreter, for many
    partials, a quarter of them (a power of two)."""
    if interpreting() and max_tiles > INTERPRETER_WIDE_TILES:
        return triton.next_power_of_2(triton.cdiv(max_tiles, 4))
    return BLOCK_T


_workspaces: dict[tuple, tuple] = {}


def _workspace(device, M: int, V: int):
    key = (device, M, V)
    if key not in _workspaces:
        max_tiles = triton.cdiv(V, MIN_BLOCK_V)
        _workspaces[key] = (
            max_tiles,
            torch.empty(M * max_tiles, dtype=torch.float32, device=device),
            torch.empty(M * max_tiles, dtype=torch.int32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device),
        )
    return _workspaces[key]


def lm_head_argmax(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    temperature: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    pdl: bool = False,
    tiled: bool = False,
) -> torch.Tensor:
    """int64 ids [M]: the argmax over the vocabulary of x [M, H] @ weight[V, H].T, lowest id on ties.

    norm_weight [H]: apply the zero-centred RMSNorm to x first (the final norm, fused).
    temperature float32 [M], seed int64 [1] or [M], step int64 [M] (all three or none): rows with T > 0
    draw from softmax(logits / T) by the Gumbel-max trick with sampling.gumbel_noise (the same noise as
    sampling.sample for the same seed, step and row); rows with T = 0 stay greedy.
    pdl: launch both kernels with programmatic dependent launch (Hopper; operators/common.py).
    tiled: the rows as tiles of one tensor-core product (W read once for all rows; the norm as a pass first)
    instead of a row a program (W read once a row).
    """
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, K = x.shape
    check_tensor("weight", weight, shape=(None, K), dtype=x.dtype)
    V = weight.shape[0]
    if V == 0 or V >= 2**31:
        raise ValueError(f"weight has {V} rows, expected 1 to 2**31 - 1")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,), dtype=FLOAT_DTYPES)
    sample = temperature is not None or seed is not None or step is not None
    if sample:
        if temperature is None or seed is None or step is None:
            raise ValueError("temperature, seed and step come together: pass all three to sample, none for argmax")
        check_tensor("temperature", temperature, shape=(M,), dtype=torch.float32)
        check_noise_keys(seed, step, M)
    if out is None:
        out = torch.empty(M, dtype=torch.int64, device=x.device)
    else:
        check_tensor("out", out, shape=(M,), dtype=torch.int64)
    check_same_device(x=x, weight=weight, norm_weight=norm_weight, temperature=temperature, seed=seed, step=step,
                      out=out)
    if M == 0:
        return out
    max_tiles, values, indices, tiles = _workspace(x.device, M, V)
    noise_keys = (temperature, seed, step) if sample else (x, x, x)
    options = dict(SAMPLE=sample, SEED_PER_ROW=sample and seed.shape[0] == M and M > 1, USE_PDL=pdl,
                   **launch_options(pdl))
    kernel = _lm_head_argmax_tiled_kernel if tiled else _lm_head_argmax_kernel
    if interpreting() and V > 4096:
        # the interpreter pays per program: wide vocabulary blocks there (at most 16 programs a row block)
        kernel = kernel.fn
        options.update(BLOCK_V=max(1024, triton.next_power_of_2(triton.cdiv(V, 16))), BLOCK_K=64)
    if tiled:  # the rows in blocks of their bucket (up to TILED_MAX_ROWS), the final norm as a pass first
        if norm_weight is not None:
            x = apply_prologue(x, None, norm_weight, eps, pdl)
        block_m = min(TILED_MAX_ROWS, max(16, triton.next_power_of_2(M)))
        kernel[lambda meta: (triton.cdiv(V, meta["BLOCK_V"]), triton.cdiv(M, block_m))](
            x, weight, *noise_keys, values, indices, tiles,
            M, V, K, triton.next_power_of_2(M), x.stride(0), weight.stride(0), max_tiles, BLOCK_M=block_m, **options,
        )
    else:  # one row per program whatever M: a row's choice does not depend on its batch
        kernel[lambda meta: (triton.cdiv(V, meta["BLOCK_V"]), M)](
            x, weight, x if norm_weight is None else norm_weight, *noise_keys, values, indices, tiles,
            M, V, K, x.stride(0), weight.stride(0), eps, max_tiles, HAS_NORM=norm_weight is not None, **options,
        )
    _argmax_reduce_kernel[(M,)](values, indices, tiles, out, max_tiles, values, values,
                                BLOCK_T=reduce_block(max_tiles), RESET=False,
                                USE_PDL=pdl, num_warps=8, **launch_options(pdl))
    return out
