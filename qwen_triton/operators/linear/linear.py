"""`linear`: every projection of the model, one launch each, with its neighbours fused in.

    out[M, N] = epilogue( prologue(x)[M, K] @ weight[N, K].T )

    prologue:  norm_weight -> rms_norm(x) * (1 + norm_weight)   (the pre-projection zero-centred RMSNorm)
               gate        -> x * sigmoid(gate)                  (the attention output gate before o_proj)
    epilogue:  norm_squares -> * rstd of each row               (the same norm, folded: see below)
               activation="swiglu" -> silu(x @ Wg.T) * (x @ Wu.T), weight = [Wg; Wu] of [2I, K], out [M, I]
               residual    -> + residual                         (out may be residual itself: in place)
               squares_out <- the output rows' sums of squares  (what the next projection's folded norm reads)

The folded norm. rms_norm(x) * (1 + w) @ W.T = rstd * (x @ (W * (1 + w)).T) for each row, rstd = 1 /
sqrt(mean(x^2) + eps): with the norm's weight folded into the projection's (the engine does it at load,
TritonModel.fold_norms), only each row's rstd is left, a scale of the accumulators' rows in the epilogue. The
rows' sums of squares come in norm_squares [M, P] float32 (their sum over P is the row's), written by the kernel
that wrote x: the epilogue of the projection before it (squares_out, one float32 a row per SQUARES_COLUMNS of its
output columns), or `norm.row_squares`. So a prefill's GEMMs need no prologue pass for their norms (gemm.py).
The GEMV (M <= 16) keeps its prologue for a folded norm, with a zero norm weight (the scale 1 + 0), and writes
squares_out with `row_squares` after it.

Dispatch: M <= 16 tokens -> split-K GEMV (gemv.py); more -> tiled GEMM (gemm.py), whose tiles come through TMA
descriptors from 257 tokens on (Hopper); `resident=True` (a decode step's rows) -> the resident-weights GEMM
(resident_gemm.py). `gemv=` overrides it: the GEMV reads the weights once a row (a row is then
reduced as it is alone), the GEMM once for all rows, so the engine runs the GEMV for one row only (engine/plan.py).
Accumulation is float32; the output is rounded once to x's dtype (or float32 with out_dtype, for logits).

Autotuning and its disk cache. Both kernels are `triton.autotune`d with `cache_results=True`: the first
call with a new tuning key (the key arguments' values plus the dtype of every tensor argument) benchmarks
each config (after `early_config_prune`) and keeps the fastest; with cache_results Triton also writes the
timings as `<kernel>.autotune.json` in its cache directory ($TRITON_CACHE_DIR, default ~/.triton/cache),
under a hash of Triton's version, the GPU target, the kernel's source (with the functions it calls), the
cache-invalidating environment, the tuning key and the config list. A later process finds that file and
takes its best config without benchmarking (triton/runtime/autotuner.py, Autotuner.check_disk_cache);
the compiled binaries sit in the same directory. Setting TRITON_CACHE_AUTOTUNING=1 is not needed.
Tuning runs the kernel many times, so it must happen at warm-up, never inside CUDA-graph capture; the
in-place residual is protected during tuning by `restore_value` (the output is copied and restored around
each benchmark run; tuned calls do not copy).
"""

from __future__ import annotations

import torch

from ..common import check_same_device, check_tensor
from ..norm import row_squares
from .fusion import SQUARES_COLUMNS
from .gemm import gemm
from .gemv import MAX_ROWS
from .gemv import gemv as gemv_kernel
from .resident_gemm import MAX_ROWS as RESIDENT_ROWS
from .resident_gemm import resident_gemm

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = {None: 0, "swiglu": 1}


def _memory_range(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


_unit_norms: dict[tuple, torch.Tensor] = {}


def _unit_norm(x: torch.Tensor) -> torch.Tensor:
    """A zero norm weight for x's rows (the norm's (1 + w) = 1): the GEMV's prologue for a folded norm."""
    key = (x.device, x.dtype, x.shape[1])
    if key not in _unit_norms:
        _unit_norms[key] = torch.zeros(x.shape[1], dtype=x.dtype, device=x.device)
    return _unit_norms[key]


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors intersect (conservative for interleaved views)."""
    (a0, a1), (b0, b1) = _memory_range(a), _memory_range(b)
    return a0 < b1 and b0 < a1


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    gate: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    split_k: bool = True,
    out_dtype: torch.dtype | None = None,
    pdl: bool = False,
    norm_squares: torch.Tensor | None = None,
    squares_out: torch.Tensor | None = None,
    gemv: bool | None = None,
    resident: bool = False,
    bucket_picks: bool = False,
) -> torch.Tensor:
    """out[M, N] = x @ weight.T with the fusions above. See the module docstring.

    x [M, K] (rows may be strided, unit last stride); weight [N, K] (or [2I, K] for swiglu), x's dtype;
    residual [M, N] in the output dtype; gate [M, K] in x's dtype; norm_weight [K] (any float dtype);
    out [M, N] (rows may be strided); out_dtype: x's dtype (default) or torch.float32.
    split_k: let the GEMV split K across programs (autotuned); False keeps one program per output tile.
    pdl: launch the kernels with programmatic dependent launch (Hopper; see operators/common.py).
    norm_squares [M, P] float32: x's rows' sums of squares (summed over P) for the folded norm (the weight holds
    the norm's (1 + w); see the module docstring); squares_out [M, cdiv(N, SQUARES_COLUMNS)] float32: filled with
    the output rows' sums of squares (each row's over its columns: what the next folded norm reads).
    gemv: run the GEMV (True; M <= 16) or the GEMM (False); None: the GEMV for M <= 16. The engine's plan says
    which (`Plan.gemv_rows`): the GEMV reads each weight once a row, the GEMM once for all rows.
    resident: where the GEMM runs, its resident-weights form (resident_gemm.py; M <= 128: a decode step's rows).
    bucket_picks: where the tiled GEMM runs, its bucket's own pick if the tuning table has one (gemm.py).
    """
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, K = x.shape
    check_tensor("weight", weight, shape=(None, K), dtype=x.dtype)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or 'swiglu', got {activation!r}")
    rows = weight.shape[0]
    if activation == "swiglu":
        if rows % 2:
            raise ValueError(f"weight has {rows} rows: swiglu needs the gate rows then the up rows (an even count)")
        N = rows // 2
    else:
        N = rows
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    if residual is not None:
        check_tensor("residual", residual, shape=(M, N), dtype=out_dtype)
    if gate is not None:
        check_tensor("gate", gate, shape=(M, K), dtype=x.dtype)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,), dtype=FLOAT_DTYPES)
    if gate is not None and norm_weight is not None:
        raise ValueError("gate and norm_weight are two different prologues: pass one of them")
    if norm_squares is not None:
        check_tensor("norm_squares", norm_squares, shape=(M, None), dtype=torch.float32)
        if norm_squares.shape[1] == 0:
            raise ValueError("norm_squares has no columns: it needs at least one, the rows' sums of squares")
        if norm_weight is not None or gate is not None:
            raise ValueError("norm_squares (the folded norm) takes neither norm_weight nor gate: pass one of them")
    if squares_out is not None:
        check_tensor("squares_out", squares_out, shape=(M, -(-N // SQUARES_COLUMNS)), dtype=torch.float32)
    if out is None:
        out = torch.empty(M, N, dtype=out_dtype, device=x.device)
    else:
        check_tensor("out", out, shape=(M, N), dtype=out_dtype)
    check_same_device(x=x, weight=weight, residual=residual, gate=gate, norm_weight=norm_weight, out=out,
                      norm_squares=norm_squares, squares_out=squares_out)
    for name, other in (("x", x), ("weight", weight), ("gate", gate), ("norm_squares", norm_squares)):
        if other is not None and overlaps(out, other):
            raise ValueError(f"out overlaps {name}: the kernel reads {name} while other programs write out")
        if other is not None and squares_out is not None and overlaps(squares_out, other):
            raise ValueError(f"squares_out overlaps {name}: the kernel reads {name} while other programs write "
                             "squares_out")
    if squares_out is not None and (overlaps(squares_out, out) or (residual is not None
                                                                    and overlaps(squares_out, residual))):
        raise ValueError("squares_out overlaps out or residual")
    if residual is not None and overlaps(out, residual) and (
        out.data_ptr() != residual.data_ptr() or out.stride() != residual.stride()
    ):
        raise ValueError("residual overlaps out without being out itself: pass the same tensor for an in-place add")
    if M == 0 or N == 0:
        return out
    options = dict(residual=residual, gate=gate, norm_weight=norm_weight, eps=eps, activation=ACTIVATIONS[activation])
    if gemv is None:
        gemv = M <= MAX_ROWS
    elif gemv and M > MAX_ROWS:
        raise ValueError(f"gemv=True serves at most {MAX_ROWS} rows, x has {M}")
    if gemv:
        if norm_squares is not None:
            options["norm_weight"] = _unit_norm(x)
        gemv_kernel(x, weight, out, split_k=split_k, pdl=pdl, **options)
        if squares_out is not None:
            row_squares(out, out=squares_out)
        return out
    if resident:
        if M > RESIDENT_ROWS:
            raise ValueError(f"resident=True serves at most {RESIDENT_ROWS} rows, x has {M}")
        return resident_gemm(x, weight, out, pdl=pdl, norm_squares=norm_squares, squares_out=squares_out, **options)
    return gemm(x, weight, out, split_k=split_k, pdl=pdl, norm_squares=norm_squares, squares_out=squares_out,
                bucket_picks=bucket_picks, **options)
