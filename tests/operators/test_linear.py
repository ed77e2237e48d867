"""`linear` (split-K GEMV for M <= 16, tiled GEMM beyond) with its fusions, against the reference math.

CPU (interpreter): float16 and float32 (tl.dot on bfloat16 is wrong under the interpreter; the one-token
path does not use tl.dot, so bfloat16 is also tested there, with a tolerance of one truncation: the
interpreter rounds float32 -> bfloat16 toward zero), sizes that are no multiple of any block
(K 40 / 100, N 33 / 70), M = 1 (CUDA-core path), 3 (tensor-core GEMV tile), 17 (GEMM), with every
fusion on both sides of M = 16 and K split across programs (the interpreter's GEMV config splits K in 2).

The reference is computed from the same inputs in float64, with the prologue rounded to x's dtype where
the kernel (and the model) rounds it. Tolerances: float32 outputs agree to summation order (1e-5
relative); float16/bfloat16 outputs are one rounding of a float32 result (2^-11 / 2^-8 relative), plus
the prologue's own rounding when 1/rms differs by an ulp from torch's.

GPU (bfloat16, real Qwen3.5-0.8B shapes): ||out - ref|| / ||ref|| against a float64 reference from the
same bf16 inputs. The kernel accumulates in float32 and rounds once to bf16, so each element is within
half an ulp: |err_i| <= 2^-8 |ref_i| (+ float32 summation error, ~1e-6 relative): the relative norm
error is below 2^-8 = 3.9e-3; we allow 5e-3 (margin for the prologue's 1-ulp rounding flips).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qwen_triton.operators.linear import benchmark_cases, linear
from qwen_triton.operators.linear.gemv import MAX_ROWS
from tests.support import run_without_interpreter
from qwen_triton.reference import functional as fn

EPS = 1e-6


def make(shape, dtype, device, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def reference(x, weight, *, residual=None, activation=None, gate=None, norm_weight=None):
    """The math in float64, rounding the prologue to x's dtype as the model does."""
    if norm_weight is not None:
        x = fn.rms_norm(x, norm_weight, EPS)
    if gate is not None:
        x = (x.double() * torch.sigmoid(gate.double())).to(x.dtype)
    return epilogue(x.double() @ weight.double().T, activation, residual)


def epilogue(y, activation=None, residual=None):
    """SwiGLU of the paired halves, then the residual, in float64."""
    if activation == "swiglu":
        gate_part, up = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(gate_part) * up
    if residual is not None:
        y = y + residual.double()
    return y


def assert_close(out, ref, dtype):
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs()
    assert (err <= rtol * ref.abs() + rtol * 0.05 * scale).all(), f"max error {err.max().item()} (scale {scale})"


def inputs(M, K, N, dtype, device, options, seed=0):
    """x as a strided row view (a wider buffer), weight, and the tensors of the requested fusions."""
    rows = 2 * N if "swiglu" in options else N
    wide = make((M, K + 7), dtype, device, seed)
    x = wide[:, 3:3 + K]
    weight = make((rows, K), dtype, device, seed + 1, scale=K ** -0.5)
    kwargs = {}
    if "swiglu" in options:
        kwargs["activation"] = "swiglu"
    if "residual" in options or "inplace" in options:
        kwargs["residual"] = make((M, N), dtype, device, seed + 2)
    if "gate" in options:
        kwargs["gate"] = make((M, K), dtype, device, seed + 3, scale=2.0)
    if "norm" in options:
        kwargs["norm_weight"] = make((K,), dtype, device, seed + 4, scale=0.3)
    return x, weight, kwargs


CASES = (
    # every M on both sides of 16, both shapes, plain, split K
    [(M, K, N, (), True) for M in (1, 3, 17) for K, N in ((40, 33), (100, 70))]
    # each fusion at each M
    + [(M, 100, 70, (option,), True)
       for M in (1, 3, 17) for option in ("residual", "inplace", "swiglu", "gate", "norm")]
    # no split
    + [(M, 100, 70, options, False) for M in (1, 3, 17) for options in ((), ("swiglu", "residual"))]
    # fusions together: an MLP (norm -> gate_up -> swiglu, + residual) and an attention output
    + [(M, 40, 33, ("norm", "swiglu", "residual"), True) for M in (1, 17)]
    + [(M, 40, 33, ("gate", "inplace"), True) for M in (1, 17)]
)


@pytest.mark.parametrize("M, K, N, options, split_k", CASES)
def test_linear_matches_reference(device, M, K, N, options, split_k):
    dtype = torch.float16
    x, weight, kwargs = inputs(M, K, N, dtype, device, options)
    ref = reference(x, weight, **kwargs)
    if "inplace" in options:
        out = kwargs["residual"]
        result = linear(x, weight, out=out, split_k=split_k, **kwargs)
        assert result is out
    else:
        result = linear(x, weight, split_k=split_k, **kwargs)
    assert result.shape == ref.shape and result.dtype == dtype
    assert_close(result, ref, dtype)


@pytest.mark.parametrize("options", [(), ("norm", "swiglu", "residual"), ("gate", "inplace")])
def test_linear_runs_the_gemm_for_a_few_rows_when_asked(device, options):
    """gemv=False: 2-16 rows through the GEMM (the engine's decode step of several sequences), gemv=True past 16
    rows refused."""
    x, weight, kwargs = inputs(3, 100, 70, torch.float16, device, options, seed=8)
    ref = reference(x, weight, **kwargs)
    out = kwargs["residual"] if "inplace" in options else None
    assert_close(linear(x, weight, out=out, gemv=False, **kwargs), ref, torch.float16)
    with pytest.raises(ValueError, match="gemv=True serves at most 16 rows, x has 17"):
        linear(torch.zeros(17, 100, device=device, dtype=torch.float16), weight, gemv=True)


@pytest.mark.parametrize("M", [3, 17])
def test_linear_float32(device, M):
    x, weight, kwargs = inputs(M, 100, 70, torch.float32, device, ("norm", "swiglu", "residual"), seed=5)
    assert_close(linear(x, weight, **kwargs), reference(x, weight, **kwargs), torch.float32)


@pytest.mark.parametrize("options", [(), ("swiglu",), ("residual",)])
def test_linear_bfloat16_one_token(device, options):
    """bfloat16 without the prologues: the interpreter rounds float32 -> bfloat16 toward zero (the GPU to
    nearest), which biases a rounded prologue beyond one rounding; the GPU tests cover those."""
    x, weight, kwargs = inputs(1, 100, 70, torch.bfloat16, device, options, seed=6)
    assert_close(linear(x, weight, **kwargs), reference(x, weight, **kwargs), torch.bfloat16)


def test_linear_float32_output_and_strided_out(device):
    x, weight, _ = inputs(3, 40, 33, torch.float16, device, ())
    logits = linear(x, weight, out_dtype=torch.float32)
    assert logits.dtype == torch.float32
    assert_close(logits, reference(x, weight), torch.float32)
    wide = torch.zeros(17, 50, dtype=torch.float16, device=device)
    x17, weight17, _ = inputs(17, 40, 33, torch.float16, device, ())
    out = wide[:, 5:38]
    linear(x17, weight17, out=out)
    assert_close(out, reference(x17, weight17), torch.float16)
    assert (wide[:, :5] == 0).all() and (wide[:, 38:] == 0).all()


@pytest.mark.parametrize("M", [1, 17])
def test_linear_deterministic(device, M):
    x, weight, kwargs = inputs(M, 100, 70, torch.float16, device, ("swiglu", "residual"))
    first = linear(x, weight, **kwargs)
    second = linear(x, weight, **kwargs)
    assert torch.equal(first, second)


def test_linear_empty_batch(device):
    x = torch.empty(0, 40, dtype=torch.float16, device=device)
    weight = make((33, 40), torch.float16, device, 0)
    assert linear(x, weight).shape == (0, 33)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: linear(x.float(), w), "weight has dtype"),
    (lambda x, w: linear(x, w[:, :30]), "weight has shape"),
    (lambda x, w: linear(x.T, w), "x must have unit stride"),
    (lambda x, w: linear(x[:, ::2], w[:, :20]), "x must have unit stride"),
    (lambda x, w: linear(x, w.T.contiguous().T), "weight must have unit stride"),
    (lambda x, w: linear(x, w, residual=torch.zeros(3, 32, dtype=x.dtype)), "residual has shape"),
    (lambda x, w: linear(x, w, residual=torch.zeros(3, 66)), "residual has dtype"),
    (lambda x, w: linear(x, w, gate=torch.zeros(3, 41, dtype=x.dtype)), "gate has shape"),
    (lambda x, w: linear(x, w, norm_weight=torch.zeros(39)), "norm_weight has shape"),
    (lambda x, w: linear(x, w, out=torch.zeros(3, 66)), "out has dtype"),
    (lambda x, w: linear(x, w, out=torch.zeros(2, 33, dtype=x.dtype)), "out has shape"),
    (lambda x, w: linear(x, w[:33], activation="swiglu"), "weight has 33 rows"),
    (lambda x, w: linear(x, w, activation="gelu"), "activation must be"),
    (lambda x, w: linear(x, w, out_dtype=torch.float64), "out_dtype must be"),
    (lambda x, w: linear(x, w, gate=x, norm_weight=torch.zeros(40)), "gate and norm_weight"),
    (lambda x, w: linear(x.int(), w), "x has dtype"),
    (lambda x, w: linear(x, "weight"), "weight must be a torch.Tensor"),
    (lambda x, w: linear(x, w, norm_squares=torch.ones(3, 1, dtype=torch.float16)), "norm_squares has dtype"),
    (lambda x, w: linear(x, w, norm_squares=torch.ones(2, 1)), "norm_squares has shape"),
    (lambda x, w: linear(x, w, norm_squares=torch.ones(3, 0)), "norm_squares has no columns"),
    (lambda x, w: linear(x, w, norm_squares=torch.ones(3, 1), norm_weight=torch.zeros(40)), "takes neither"),
    (lambda x, w: linear(x, w, norm_squares=torch.ones(3, 1), gate=x), "takes neither"),
    (lambda x, w: linear(x, w, squares_out=torch.ones(3, 2)), "squares_out has shape"),
    (lambda x, w: linear(x, w, squares_out=torch.ones(3, 3, dtype=torch.float16)), "squares_out has dtype"),
])
def test_linear_rejects_bad_arguments(call, message):
    x = torch.zeros(3, 40, dtype=torch.float16)
    weight = torch.zeros(66, 40, dtype=torch.float16)
    with pytest.raises(ValueError, match=message):
        call(x, weight)


def test_linear_rejects_overlapping_out():
    buffer = torch.zeros(3, 80, dtype=torch.float16)
    x = buffer[:, :40]
    weight = torch.zeros(33, 40, dtype=torch.float16)
    with pytest.raises(ValueError, match="out overlaps x"):
        linear(x, weight, out=buffer[:, 40:73])
    residual = torch.zeros(3, 34, dtype=torch.float16)
    with pytest.raises(ValueError, match="residual overlaps out"):
        linear(x, weight, residual=residual[:, 1:], out=residual[:, :33])


# ---- the folded norm: the norm's (1 + w) in the weight, 1/rms from the rows' sums of squares -------------

def folded_reference(x, weight, norm_weight, *, residual=None, activation=None):
    """rms_norm(x) * (1 + w) @ W.T computed as the folded norm does, in float64: the weight folded and rounded to
    x's dtype (as the engine folds it at load), each row's accumulators times 1/rms (the GEMV, for up to 16
    rows, scales x in its prologue and rounds it to x's dtype, as for an unfolded norm)."""
    folded = (weight.double() * (1 + norm_weight.double())).to(weight.dtype)
    rstd = torch.rsqrt(x.double().pow(2).mean(dim=1, keepdim=True) + EPS)
    if x.shape[0] <= MAX_ROWS:
        y = (x.double() * rstd).to(x.dtype).double() @ folded.double().T
    else:
        y = rstd * (x.double() @ folded.double().T)
    return folded, epilogue(y, activation, residual)


def split_squares(x, parts):
    """x's rows' sums of squares in `parts` columns of unequal spans (any split sums to the row's)."""
    bounds = torch.linspace(0, x.shape[1], parts + 1).round().long().tolist()
    return torch.stack([x[:, a:b].double().pow(2).sum(dim=1) for a, b in zip(bounds, bounds[1:])], dim=1).float()


@pytest.mark.parametrize("M", [1, 3, 17, 40])
@pytest.mark.parametrize("options, parts, split_k", [
    (("swiglu",), 1, True), (("residual",), 3, True), (("swiglu", "residual"), 4, False), ((), 32, True),
])
def test_linear_folded_norm(device, M, options, parts, split_k):
    """norm_squares: the accumulators' rows scaled by the rows' 1/rms, from sums of squares in any number of
    parts, on both sides of M = 16 (the GEMV keeps its prologue with a unit weight)."""
    x, weight, kwargs = inputs(M, 100, 70, torch.float16, device, options + ("norm",), seed=M)
    norm_weight = kwargs.pop("norm_weight")
    folded, ref = folded_reference(x, weight, norm_weight, **kwargs)
    squares = split_squares(x, parts)
    out = linear(x, folded, norm_squares=squares, split_k=split_k, **kwargs)
    assert_close(out, ref, torch.float16)
    # the same as the norm in the prologue with the unfolded weight, to the roundings of x and of the weight
    prologue = linear(x, weight, norm_weight=norm_weight, split_k=split_k, **kwargs)
    assert (out.double() - prologue.double()).abs().max() <= 0.02 * prologue.double().abs().max()


@pytest.mark.parametrize("M", [1, 3, 17, 40])
@pytest.mark.parametrize("N, options, split_k", [(70, ("inplace",), True), (96, ("swiglu",), True),
                                                 (33, ("residual",), False)])
def test_linear_writes_the_output_rows_sums_of_squares(device, M, N, options, split_k):
    """squares_out: every one of its cdiv(N, 32) columns written (NaN before), their sum over a row that row's
    sum of squares of the output as stored (rounded to its dtype)."""
    x, weight, kwargs = inputs(M, 100, N, torch.float16, device, options, seed=M + N)
    squares = torch.full((M, -(-N // 32)), float("nan"), device=device)
    ref = reference(x, weight, **kwargs)
    if "inplace" in options:
        out = linear(x, weight, out=kwargs["residual"], squares_out=squares, split_k=split_k, **kwargs)
    else:
        out = linear(x, weight, squares_out=squares, split_k=split_k, **kwargs)
    assert_close(out, ref, torch.float16)
    assert not squares.isnan().any()
    expected = out.double().pow(2).sum(dim=1)
    torch.testing.assert_close(squares.double().sum(dim=1), expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("M", [3, 40])
def test_folded_norms_chain_like_the_prologue(device, M):
    """A residual add that writes the rows' sums of squares, then a projection with its norm folded: the
    pre-projection RMSNorm of a layer, as the engine's prefill runs it."""
    attended, out_weight, kwargs = inputs(M, 64, 48, torch.float16, device, ("residual",), seed=7)
    hidden = kwargs["residual"]
    norm_weight = make((48,), torch.float16, device, 8, scale=0.3)
    up = make((40, 48), torch.float16, device, 9, scale=48 ** -0.5)
    squares = torch.empty(M, 2, device=device)
    expected_hidden = linear(attended, out_weight, residual=hidden.clone())
    linear(attended, out_weight, residual=hidden, out=hidden, squares_out=squares)
    assert torch.equal(hidden, expected_hidden)
    folded, ref = folded_reference(hidden, up, norm_weight)
    assert_close(linear(hidden, folded, norm_squares=squares), ref, torch.float16)


def test_gemm_folded_norm_through_tensor_descriptors(device):
    """The TMA loads' kernel with both epilogues (the interpreter emulates the descriptors)."""
    from qwen_triton.operators.linear import gemm

    x, weight, kwargs = inputs(40, 64, 48, torch.float16, device, ("norm", "residual"), seed=3)
    x = x.contiguous()
    folded, ref = folded_reference(x, weight, kwargs["norm_weight"], residual=kwargs["residual"])
    out = torch.empty(40, 48, dtype=x.dtype, device=device)
    squares = torch.full((40, 2), float("nan"), device=device)
    gemm.gemm(x, folded, out, residual=kwargs["residual"], norm_squares=split_squares(x, 2), squares_out=squares,
              tma=True)
    assert_close(out, ref, torch.float16)
    torch.testing.assert_close(squares.double().sum(dim=1), out.double().pow(2).sum(dim=1), rtol=1e-5, atol=0)


def test_linear_rejects_squares_out_over_its_inputs():
    x = torch.zeros(3, 40, dtype=torch.float16)
    weight = torch.zeros(66, 40, dtype=torch.float16)
    squares = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="squares_out overlaps norm_squares"):
        linear(x, weight, norm_squares=squares[:, 5:], squares_out=squares[:, :3])


# The GEMM with the folded norm's epilogues compiled for sm_90 on the CPU: the interpreter runs what the compiler
# rejects (a kernel reading a global that is no constexpr, commit 0320225; docs/decisions.md), so this compiles the
# tiles the engine runs them with (benchmarks/sass_counts.py gemm-epilogues).
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
GEMM_EPILOGUE_SASS = f"""
import runpy, sys
sys.argv = ["sass_counts.py", "gemm-epilogues"]
runpy.run_path({str(BENCHMARKS / "sass_counts.py")!r}, run_name="__main__")
"""


def test_gemm_folded_norm_epilogues_compile_for_hopper():
    """gate/up and the in-projection with the folded norm, the residual adds writing sums of squares (TMA, and split
    K over pointers for short prompts) compile for sm_90 with tensor-core products; the 4096-token tiles of gate/up
    and the in-projection without spills, and the sums of squares adding no spills and at most a few shared-memory
    stores to the residual add's tile."""
    results = run_without_interpreter(GEMM_EPILOGUE_SASS)
    assert len(results) == 7 and all(result["tensor_core"]["HGMMA"] > 0 for result in results.values()), results
    assert results["gate/up folded"]["stack_bytes"] == 0 and results["in-projection folded"]["stack_bytes"] == 0
    plain, squares = results["down"], results["down squares"]
    assert squares["stack_bytes"] <= plain["stack_bytes"], results
    assert squares["shared_stores"] <= plain["shared_stores"] + 8, results


BUCKET_PICKS_SASS = f"""
import runpy, sys
sys.argv = ["sass_counts.py", "bucket-picks"]
runpy.run_path({str(BENCHMARKS / "sass_counts.py")!r}, run_name="__main__")
"""


def test_bucket_picks_compile_for_hopper():
    """The tuning table's own picks of a decode bucket (64 rows) compile for sm_90 at the 0.8B's projections: products
    on the tensor cores, the pipeline within a Hopper SM's shared memory, and no more stack a thread than the one
    pick per K already keeps somewhere (its gate/up tiles 24 bytes, its 32 x 256 tiles of K = 2048 16; the picks'
    32 x 256 tiles of K = 2048 and 3584 keep 16)."""
    results = run_without_interpreter(BUCKET_PICKS_SASS)
    assert len(results) == 8, results
    one_per_k_stack = max(r["stack_bytes"] for name, r in results.items() if name.endswith("one pick per K"))
    for name, result in results.items():
        assert result["tensor_core"]["HGMMA"] > 0 and result["shared_bytes"] <= 227 * 1024, (name, result)
        assert result["stack_bytes"] <= one_per_k_stack, (name, results)


# The GEMM's tiles through tensor descriptors (gemm(tma=True); the interpreter emulates TMA): K and the
# row strides 16-byte aligned (K 64 / 96 / 128 in float16, 40 in float32), M and N no multiple of a block.
TMA_CASES = [
    (17, 64, 70, (), True, torch.float16),
    (40, 96, 48, ("norm", "swiglu", "residual"), True, torch.float16),
    (33, 128, 40, ("gate", "inplace"), False, torch.float16),
    (20, 40, 33, ("swiglu",), True, torch.float32),
]


def run_gemm(x, weight, kwargs, split_k, tma):
    """gemm() as linear calls it (out allocated, or the residual for "inplace"), with the tma choice."""
    from qwen_triton.operators.linear import gemm

    residual = kwargs.get("residual")
    rows = weight.shape[0] // (2 if "activation" in kwargs else 1)
    out = residual if kwargs.get("inplace") else torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    return gemm.gemm(x, weight, out, residual=residual, gate=kwargs.get("gate"),
                     norm_weight=kwargs.get("norm_weight"), activation=1 if "activation" in kwargs else 0,
                     split_k=split_k, tma=tma)


def described_operands(monkeypatch) -> list:
    """The shapes of the tensors gemm() makes descriptors of, from now on."""
    from qwen_triton.operators.linear import gemm

    shapes, describe = [], gemm._described
    monkeypatch.setattr(gemm, "_described", lambda t: shapes.append(tuple(t.shape)) or describe(t))
    return shapes


@pytest.mark.parametrize("M, K, N, options, split_k, dtype", TMA_CASES)
def test_gemm_tensor_descriptor_loads(device, monkeypatch, M, K, N, options, split_k, dtype):
    x, weight, kwargs = inputs(M, K, N, dtype, device, options)
    x = x.contiguous()
    kwargs["inplace"] = "inplace" in options
    ref = reference(x, weight, **{k: v for k, v in kwargs.items() if k != "inplace"})
    described = described_operands(monkeypatch)
    result = run_gemm(x, weight, kwargs, split_k, tma=True)
    assert described == [(M, K), tuple(weight.shape)]
    if kwargs["inplace"]:
        assert result is kwargs["residual"]
    assert_close(result, ref, dtype)


def test_gemm_loads_long_prompts_through_descriptors(device, monkeypatch):
    """gemm(tma=None), as linear calls it: descriptors for 16-bit x from TMA_ROWS rows on (the interpreter has
    them), pointer loads below and for float32."""
    from qwen_triton.operators.linear import gemm

    described = described_operands(monkeypatch)
    cases = ((gemm.TMA_ROWS - 1, torch.float16, []), (gemm.TMA_ROWS, torch.float16, [(gemm.TMA_ROWS, 64), (40, 64)]),
             (gemm.TMA_ROWS, torch.float32, []))  # float32: pointer loads unless asked (TMA measured in bf16)
    for M, dtype, expected in cases:
        x, weight, kwargs = inputs(M, 64, 40, dtype, device, ("residual",), seed=M)
        x = x.contiguous()
        assert_close(linear(x, weight, **kwargs), reference(x, weight, **kwargs), dtype)
        assert described == expected
        described.clear()


def test_gemm_tensor_descriptors_need_aligned_rows(device, monkeypatch):
    """x rows of 100 float16 (200 bytes) cannot be described: the pointer loads serve, with the same result."""
    x, weight, kwargs = inputs(17, 100, 70, torch.float16, device, ("residual",))
    described = described_operands(monkeypatch)
    result = run_gemm(x.contiguous(), weight, kwargs, True, tma=True)
    assert described == []
    assert_close(result, reference(x, weight, **kwargs), torch.float16)


# ---- GPU: the real shapes of Qwen3.5-0.8B, bfloat16 ----------------------------------------------------

HIDDEN = 1024
# (name, N rows of the weight, K, fusions) of every projection of a layer
PROJECTIONS = [
    ("deltanet_in_proj", 8224, HIDDEN, ("norm",)),
    ("attention_in_proj", 5120, HIDDEN, ("norm",)),
    ("mlp_gate_up", 7168, HIDDEN, ("norm", "swiglu")),
    ("mlp_down", HIDDEN, 3584, ("residual",)),
    ("attention_out_proj", HIDDEN, 2048, ("gate", "residual")),
    ("deltanet_out_proj", HIDDEN, 2048, ("residual",)),
]
GPU_BOUND = 5e-3


def gpu_inputs(M, rows, K, options, seed=0):
    torch.manual_seed(seed)
    device, dtype = "cuda", torch.bfloat16
    N = rows // 2 if "swiglu" in options else rows
    x = torch.randn(M, K, device=device, dtype=dtype)
    weight = (torch.randn(rows, K, device=device) * K ** -0.5).to(dtype)
    kwargs = {}
    if "swiglu" in options:
        kwargs["activation"] = "swiglu"
    if "residual" in options:
        kwargs["residual"] = torch.randn(M, N, device=device, dtype=dtype)
    if "gate" in options:
        kwargs["gate"] = torch.randn(M, K, device=device, dtype=dtype) * 2
    if "norm" in options:
        kwargs["norm_weight"] = (torch.randn(K, device=device) * 0.3).to(dtype)
    return x, weight, kwargs


def relative_norm_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_gpu_decode_projections(name, rows, K, options):
    x, weight, kwargs = gpu_inputs(1, rows, K, options)
    ref = reference(x, weight, **kwargs)
    out = linear(x, weight, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    for _ in range(3):  # split-K reduced in a fixed order: bit-identical
        assert torch.equal(linear(x, weight, **kwargs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("M, split_k, projection", [
    (4, True, PROJECTIONS[2]), (4, True, PROJECTIONS[4]), (16, True, PROJECTIONS[3]),
    (1, False, PROJECTIONS[2]), (1, False, PROJECTIONS[3]),
])
def test_gpu_decode_batch_and_no_split(M, split_k, projection):
    """2..16 tokens (the tensor-core GEMV tile) and split_k=False."""
    name, rows, K, options = projection
    x, weight, kwargs = gpu_inputs(M, rows, K, options, seed=M)
    ref = reference(x, weight, **kwargs)
    out = linear(x, weight, split_k=split_k, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(linear(x, weight, split_k=split_k, **kwargs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_gpu_decode_rows_through_the_gemm_are_batch_invariant(name, rows, K, options):
    """A decode step of 2-128 rows runs the GEMM: each row as accurate as the GEMV's, and a row's result does not
    depend on how many rows share the call (the configs of every bucket split K alike)."""
    x, weight, kwargs = gpu_inputs(128, rows, K, options, seed=11)
    results = {}
    for M in (2, 16, 64, 128):
        rows_kwargs = {name: (value[:M].clone() if torch.is_tensor(value) and value.dim() == 2 else value)
                       for name, value in kwargs.items()}
        ref = reference(x[:M], weight, **rows_kwargs)
        out = linear(x[:M].clone(), weight, gemv=False, **rows_kwargs)
        assert relative_norm_error(out, ref) < GPU_BOUND
        results[M] = out
    for M in (16, 64, 128):
        assert torch.equal(results[M][:2], results[2]), M


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_gpu_decode_rows_with_the_tables_bucket_picks(monkeypatch, name, rows, K, options):
    """A decode step of 64 rows through the tuning table's picks for that bucket (gemm_decode_by_rows), in bf16: as
    accurate as the one pick per K, the same bits from call to call."""
    from qwen_triton.operators.linear import gemm

    x, weight, kwargs = gpu_inputs(64, rows, K, options, seed=17)
    ref = reference(x, weight, **kwargs)
    assert gemm.bucket_pick(64, K, int("swiglu" in options), "residual" in options, x) is not None
    _one_pick_per_k_refused(monkeypatch)
    out = linear(x.clone(), weight, gemv=False, bucket_picks=True, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(linear(x.clone(), weight, gemv=False, bucket_picks=True, **kwargs), out)


# a decode bucket's own picks (gemm(bucket_picks=True)): (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages),
# the wider tiles of benchmarks/decode_gemm_sweep.py --wide among them
BUCKET_PICKS = [(128, 64, 128, 1, 8, 3), (128, 128, 64, 2, 8, 3), (64, 128, 128, 4, 8, 3), (128, 64, 128, 4, 8, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("pick", BUCKET_PICKS, ids=[str(p) for p in BUCKET_PICKS])
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_gpu_decode_bucket_picks(monkeypatch, name, rows, K, options, pick):
    """A 128-row decode bucket's own pick, in bf16 on the tensor cores: as accurate as the one pick per K, and the
    same bits from call to call (split-K reduced in a fixed order). A pick the shape cannot take falls back."""
    from qwen_triton.operators.linear import gemm

    monkeypatch.setattr(gemm, "PREFERRED_DECODE_BY_ROWS", {128: ((None, pick),)})
    x, weight, kwargs = gpu_inputs(128, rows, K, options, seed=13)
    ref = reference(x, weight, **kwargs)
    if gemm.bucket_pick(128, K, int("swiglu" in options), False, x) is not None:
        _one_pick_per_k_refused(monkeypatch)  # the pick itself runs, whatever QWEN_TRITON_AUTOTUNE says
    out = linear(x.clone(), weight, gemv=False, bucket_picks=True, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(linear(x.clone(), weight, gemv=False, bucket_picks=True, **kwargs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options, M", [
    ("mlp_gate_up", 7168, HIDDEN, ("norm", "swiglu"), 4096),
    ("mlp_down", HIDDEN, 3584, ("residual",), 4096),
    ("attention_out_proj", HIDDEN, 2048, ("gate", "residual"), 128),
    ("mlp_down_short_prompt", HIDDEN, 3584, ("residual",), 128),
    ("mlp_gate_up_short_prompt", 7168, HIDDEN, ("norm", "swiglu"), 100),
    ("plain_odd", 1000, 1000, (), 77),
])
def test_gpu_prefill_projections(name, rows, K, options, M):
    x, weight, kwargs = gpu_inputs(M, rows, K, options)
    ref = reference(x, weight, **kwargs)
    out = linear(x, weight, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(linear(x, weight, **kwargs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
@pytest.mark.parametrize("M", [100, 128, 1000, 4096])
def test_gpu_prefill_projections_tensor_descriptors(monkeypatch, name, rows, K, options, M):
    """Every projection with its tiles through TMA (gemm(tma=True)), short, medium (the 1024 bucket's pinned
    tiles) and long prompts, bf16."""
    x, weight, kwargs = gpu_inputs(M, rows, K, options, seed=M)
    ref = reference(x, weight, **kwargs)
    described = described_operands(monkeypatch)
    out = run_gemm(x, weight, kwargs, True, tma=True)
    assert len(described) == 2
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(run_gemm(x, weight, kwargs, True, tma=True), out)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
@pytest.mark.parametrize("M", [100, 128, 320])
def test_gpu_prefill_projections_with_pdl(name, rows, K, options, M):
    """The GEMM (and its prologue pass) launched with programmatic dependent launch, alone and in a CUDA graph
    behind a kernel that writes x: the bits of the launch without it."""
    from qwen_triton.operators.common import pdl_available

    if not pdl_available("cuda"):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    x, weight, kwargs = gpu_inputs(M, rows, K, options, seed=M)
    expected = linear(x, weight, **kwargs)
    assert torch.equal(linear(x, weight, pdl=True, **kwargs), expected)
    # behind a kernel that writes x: the wait must order the reads after it
    source = x.clone()
    x.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(source)
        out = linear(x, weight, pdl=True, **kwargs)
    for _ in range(3):
        x.zero_()
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", [p for p in PROJECTIONS if "norm" in p[3]],
                         ids=[p[0] for p in PROJECTIONS if "norm" in p[3]])
@pytest.mark.parametrize("M", [100, 320, 1000, 4096])
def test_gpu_prefill_projections_with_folded_norm(name, rows, K, options, M):
    """The normed projections with the norm folded (norm_squares from `row_squares`), bf16: split-K GEMMs (100),
    the TMA loads (320 on), the pinned tiles of 1024 and 4096."""
    from qwen_triton.operators.norm import row_squares

    x, weight, kwargs = gpu_inputs(M, rows, K, options, seed=M)
    norm_weight = kwargs.pop("norm_weight")
    folded, ref = folded_reference(x, weight, norm_weight, **kwargs)
    squares = row_squares(x)
    out = linear(x, folded, norm_squares=squares, **kwargs)
    assert relative_norm_error(out, ref) < GPU_BOUND
    assert torch.equal(linear(x, folded, norm_squares=squares, **kwargs), out)


@pytest.mark.gpu
@pytest.mark.parametrize("M, K, gate", [(100, 3584, False), (128, 2048, True), (320, 2048, False), (4096, 3584, False),
                                        (4096, 2048, True)])
def test_gpu_residual_add_writes_sums_of_squares(M, K, gate):
    """The N = 1024 projections with the residual in place and squares_out (what the engine's prefill runs): the
    output against the reference, the rows' sums of squares of the stored output."""
    x, weight, kwargs = gpu_inputs(M, HIDDEN, K, ("residual", "gate") if gate else ("residual",), seed=K)
    ref = reference(x, weight, **kwargs)
    hidden = kwargs.pop("residual")
    squares = torch.full((M, HIDDEN // 32), float("nan"), device="cuda")
    linear(x, weight, residual=hidden, out=hidden, squares_out=squares, **kwargs)
    assert relative_norm_error(hidden, ref) < GPU_BOUND
    torch.testing.assert_close(squares.double().sum(dim=1), hidden.double().pow(2).sum(dim=1), rtol=1e-5, atol=0)


def assert_folded_norm_chain_replays_with_pdl(M, K, **options):
    """A residual add (K columns in) writing the sums of squares, then gate/up with its norm folded, each `linear`
    with `options`, in a CUDA graph with PDL behind a kernel that writes the inputs: the bits of the launches
    without PDL."""
    from qwen_triton.operators.common import pdl_available

    if not pdl_available("cuda"):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    attended, out_weight, kwargs = gpu_inputs(M, HIDDEN, K, ("residual",), seed=M)
    source = kwargs["residual"]
    _, gate_up, _ = gpu_inputs(M, 7168, HIDDEN, (), seed=M + 1)
    hidden, squares = source.clone(), torch.empty(M, HIDDEN // 32, device="cuda")

    def chain(pdl):
        hidden.copy_(source)
        linear(attended, out_weight, residual=hidden, out=hidden, squares_out=squares, pdl=pdl, **options)
        return linear(hidden, gate_up, activation="swiglu", norm_squares=squares, pdl=pdl, **options)

    expected = chain(False).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        hidden.zero_()
        squares.zero_()
        graph.replay()
        assert torch.equal(out, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [100, 128, 320])
def test_gpu_folded_norm_chain_with_pdl(M):
    """The chain through the GEMM (assert_folded_norm_chain_replays_with_pdl)."""
    assert_folded_norm_chain_replays_with_pdl(M, 2048)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4096])
def test_gpu_inplace_residual(M):
    x, weight, kwargs = gpu_inputs(M, HIDDEN, 3584, ("residual",), seed=3)
    ref = reference(x, weight, **kwargs)
    hidden = kwargs["residual"].clone()
    linear(x, weight, residual=hidden, out=hidden)
    assert relative_norm_error(hidden, ref) < GPU_BOUND


@pytest.mark.gpu
def test_gpu_decode_cuda_graph():
    """A split-K GEMV chain captured once and replayed on new inputs: the counters reset themselves."""
    x, weight, kwargs = gpu_inputs(1, 7168, HIDDEN, ("norm", "swiglu"), seed=4)
    down = (torch.randn(HIDDEN, 3584, device="cuda") * 3584 ** -0.5).to(torch.bfloat16)
    hidden = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step():
        mlp = linear(hidden, weight, activation="swiglu", norm_weight=kwargs["norm_weight"], out=buffer)
        linear(mlp, down, residual=hidden, out=hidden)

    buffer = torch.empty(1, 3584, device="cuda", dtype=torch.bfloat16)
    start = hidden.clone()
    step()  # warm-up: autotuning and workspaces
    expected = [hidden.clone()]
    for _ in range(2):
        step()
        expected.append(hidden.clone())
    hidden.copy_(start)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    hidden.copy_(start)
    with torch.cuda.graph(graph):
        step()
    hidden.copy_(start)
    for want in expected:
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(hidden, want)


@pytest.mark.gpu
def test_gpu_autotune_cached_on_disk(tmp_path):
    """A second process reads the tuned config from TRITON_CACHE_DIR instead of benchmarking again."""
    script = textwrap.dedent("""
        import torch
        from qwen_triton.operators.linear import linear
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
        linear(x, w)
        torch.cuda.synchronize()
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), TRITON_PRINT_AUTOTUNING="1", PYTHONPATH=path,
               QWEN_TRITON_AUTOTUNE="2")  # a real tuning (two configs) whatever the caller set
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
            for _ in range(2)]
    assert "Triton autotuning for function _gemv_kernel" in runs[0].stdout
    assert "Triton autotuning" not in runs[1].stdout
    assert list(tmp_path.rglob("_gemv_kernel.autotune.json"))


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    cases = benchmark_cases(tokens=(1,))  # the prefill cases tune many more kernels: left to the benchmark
    assert {"name", "fn", "bytes", "flops"} <= set(cases[0])
    for case in cases:
        case["fn"]()
    torch.cuda.synchronize()


def test_decode_gemv_keeps_the_in_graph_winner_for_its_K():
    import triton

    from qwen_triton.operators.linear import gemv

    def config(split, rows, block):
        return triton.Config({"BLOCK_N": rows, "BLOCK_K": block, "SPLIT_K": split}, num_warps=4)

    configs = [config(2, 64, 64), config(1, 16, 256), config(1, 8, 1024), config(4, 16, 512), config(7, 8, 512)]

    def kept(K, candidates=configs):
        return [(c.kwargs["SPLIT_K"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"])
                for c in gemv._prune(candidates, {"K": K})]

    assert kept(1024) == [(1, 16, 256)]
    assert kept(2048) == [(1, 8, 1024)]
    assert kept(3584) == [(4, 16, 512)]
    # the winner not among the candidates: the autotuner chooses among the valid ones
    assert kept(1024, [configs[0], configs[2], configs[3]]) == [(2, 64, 64), (1, 8, 1024)]  # 4 x 512 > K
    # nothing valid (K under every block): the first config, which masks what it overshoots
    assert kept(96) == [(2, 64, 64)]


def test_prefill_gemm_splits_k_only_for_short_prompts():
    import triton

    from qwen_triton.operators.linear import gemm

    def config(block_m, split):
        return triton.Config({"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": split},
                             num_warps=4)

    configs = [config(64, 1), config(64, 4), config(128, 2)]

    def kept(bucket, allowed, candidates=configs):
        pruned = gemm._prune(candidates, {"M_BUCKET": bucket}, ACTIVATION=0, SPLIT_ALLOWED=allowed)
        return [(c.kwargs["BLOCK_M"], c.kwargs["SPLIT_K"]) for c in pruned]

    assert kept(128, True) == [(64, 1), (64, 4), (128, 2)]
    assert kept(32, True) == [(64, 1), (64, 4)]  # tiles taller than max(bucket, 64) dropped
    assert kept(512, True) == [(64, 1)]  # a long prompt has enough tiles: no split
    assert kept(128, False) == [(64, 1)]  # the caller's split_k=False
    assert kept(4096, True, [config(64, 4)]) == [(64, 1)]  # nothing left: the first config, unsplit


def test_prefill_gemm_keeps_the_in_graph_winner_for_short_prompts():
    import triton

    from qwen_triton.operators.linear import gemm

    def config(block_n, block_k, split):
        return triton.Config({"BLOCK_M": 64, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8, "SPLIT_K": split},
                             num_warps=4)

    configs = [config(128, 64, 1), config(64, 64, 1), config(64, 128, 4), config(128, 64, 2)]

    def kept(bucket, K, allowed=True, candidates=configs):
        pruned = gemm._prune(candidates, {"M_BUCKET": bucket, "K": K}, ACTIVATION=0, SPLIT_ALLOWED=allowed)
        return [(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]) for c in pruned]

    assert kept(256, 1024) == [(64, 64, 1)]  # (up to 128 rows: the decode table, below)
    assert kept(256, 3584) == [(64, 128, 4)]
    assert kept(256, 2048, allowed=False) == [(128, 64, 1), (64, 64, 1)]  # the winner's split not allowed
    assert kept(4096, 1024) == [(128, 64, 1), (64, 64, 1)]  # long prompts: the autotuner chooses
    assert kept(256, 1024, candidates=[configs[0], configs[3]]) == [(128, 64, 1), (128, 64, 2)]  # not among them


def test_gemm_drops_configs_whose_pipeline_overflows_shared_memory(monkeypatch):
    """The tables' pins were chosen in bf16; in float32 a gate/up config of 3 stages of a 64 x 128 x tile and two
    64 x 128 weight tiles takes 294,912 bytes, over an H100's 232,448: dropped before the pins are applied, so a
    float32 model on a GPU (which failed its first prefill with OutOfResources) autotunes among the rest."""
    import triton

    from qwen_triton.operators.linear import gemm

    monkeypatch.setattr(gemm, "shared_memory_limit", lambda device: 232448)
    configs = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 8, "SPLIT_K": 1}, num_warps=4,
                             num_stages=3),
               triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1}, num_warps=4,
                             num_stages=3)]
    assert gemm.pipeline_bytes(configs[0], 4, 2) == 294912

    def kept(dtype, activation):
        x = torch.empty(2, 1024, dtype=dtype)
        pruned = gemm._prune(configs, {"M_BUCKET": 4096, "x_ptr": x}, ACTIVATION=activation, SPLIT_ALLOWED=False)
        return [c.kwargs["BLOCK_K"] for c in pruned]

    assert kept(torch.bfloat16, 1) == [128, 64]  # 147,456 bytes: both fit
    assert kept(torch.float32, 1) == [64]  # over the limit: the other config alone
    assert kept(torch.float32, 0) == [128, 64]  # without SwiGLU's second weight tile: 196,608 bytes


def test_decode_gemm_keeps_one_pick_per_K_with_the_buckets_rows():
    """A decode step of 2-128 rows: the decode table's tiles, splits, warps and stages for its K at every bucket,
    BLOCK_M the bucket's rows from 16 to 64 (the H200 table's GEMM_DECODE_BY_K)."""
    import triton

    from qwen_triton.operators.linear import gemm

    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8, "SPLIT_K": split},
                             num_warps=4, num_stages=stages)
               for m in (16, 32, 64) for n, k, split, stages in ((64, 128, 1, 4), (32, 256, 2, 3), (32, 128, 4, 4),
                                                                 (64, 64, 1, 4))]

    def kept(bucket, K):
        pruned = gemm._prune(configs, {"M_BUCKET": bucket, "K": K}, ACTIVATION=0, SPLIT_ALLOWED=True)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]) for c in pruned]

    for bucket, block_m in ((2, 16), (16, 16), (32, 32), (64, 64), (128, 64)):
        assert kept(bucket, 1024) == [(block_m, 64, 128, 1)], bucket
        assert kept(bucket, 2048) == [(block_m, 32, 256, 2)], bucket
        assert kept(bucket, 3584) == [(block_m, 32, 128, 4)], bucket
    assert len(kept(256, 1024)) == 1 and kept(256, 1024)[0][0] == 64  # past 128 rows: the short prompts' table


def test_prefill_gemm_keeps_the_in_graph_winner_for_long_prompts():
    import triton

    from qwen_triton.operators.linear import gemm

    def config(block_n, warps, stages):
        return triton.Config({"BLOCK_M": 128, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1},
                             num_warps=warps, num_stages=stages)

    configs = [config(64, 4, 4), config(128, 8, 3), config(256, 8, 3), config(128, 4, 4)]

    def kept(bucket, N, candidates=configs):
        pruned = gemm._prune(candidates, {"M_BUCKET": bucket, "K": 2048, "N": N}, ACTIVATION=0, SPLIT_ALLOWED=False)
        return [(c.kwargs["BLOCK_N"], c.num_warps) for c in pruned]

    assert kept(4096, 1024) == [(256, 8)]  # the out-projections and down
    assert kept(8192, 8224) == [(128, 8)]  # the wide ones, and longer prompts
    assert kept(2048, 1024) == [(64, 4), (128, 8), (256, 8), (128, 4)]  # shorter: the autotuner chooses
    assert kept(4096, 1024, candidates=[configs[0], configs[1]]) == [(64, 4), (128, 8)]  # not among them


def test_prefill_gemm_keeps_the_in_graph_winner_for_medium_prompts_on_tma():
    """Prompts of 513-1024 tokens (bucket 1024) on the TMA loads: the tiles measured fastest there, by N;
    the pointer loads and other buckets: the autotuner chooses."""
    import triton

    from qwen_triton.operators.linear import gemm

    def config(block_m, block_n, warps, stages):
        return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8, "SPLIT_K": 1},
                             num_warps=warps, num_stages=stages)

    configs = [config(64, 128, 4, 4), config(128, 128, 8, 3), config(128, 64, 4, 4)]

    def kept(bucket, N, tma=True):
        pruned = gemm._prune(configs, {"M_BUCKET": bucket, "K": 2048, "N": N}, ACTIVATION=0, SPLIT_ALLOWED=False,
                             TMA=tma)
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in pruned]

    assert kept(1024, 1024) == [(64, 128)]  # down, out-projections
    assert kept(1024, 8224) == [(128, 128)]  # in-projections, gate/up
    assert kept(1024, 1024, tma=False) == [(64, 128), (128, 128), (128, 64)]
    assert kept(2048, 1024) == [(64, 128), (128, 128), (128, 64)]


def test_decode_bucket_takes_its_own_pick_where_the_table_has_one(monkeypatch):
    """gemm(bucket_picks=True) in a bucket of gemm_decode_by_rows: that bucket's pick for its K, where the shape
    takes it; otherwise none (the one pick per K serves)."""
    from qwen_triton.operators.linear import gemm

    monkeypatch.setattr(gemm, "PREFERRED_DECODE_BY_ROWS", {128: ((1024, (128, 128, 64, 1, 4, 3)),
                                                                 (2048, (64, 16, 256, 4, 8, 3)),
                                                                 (3584, (64, 32, 256, 64, 8, 3)))})

    def pick(bucket, K, activation=0, write_squares=False):
        settings = gemm.bucket_pick(bucket, K, activation, write_squares)
        return settings and tuple(settings[name] for name in gemm.BUCKET_FIELDS)

    assert pick(128, 1024) == (128, 128, 64, 1, 4, 3)
    assert pick(128, 1000) == (128, 128, 64, 1, 4, 3)  # the first entry that serves K
    assert pick(64, 1024) is None  # a bucket without its own picks
    assert pick(128, 4096) is None  # a K the bucket's picks do not serve
    assert pick(128, 3584) is None  # 64 splits: more than the workspace holds
    assert pick(128, 1024, activation=1) is None  # two 128 x 128 accumulators: 4 warps too few
    assert pick(128, 2048) == (64, 16, 256, 4, 8, 3)
    assert pick(128, 2048, write_squares=True) is None  # 16 columns: no sums of squares


def _one_pick_per_k_refused(monkeypatch):
    """The autotuned launchers made to fail: a call that runs must have taken a bucket's own pick."""
    from qwen_triton.operators.linear import gemm

    def refused(*args, **kwargs):
        raise AssertionError("the one pick per K ran, not the bucket's own")

    monkeypatch.setattr(gemm, "_gemm_split", type("Refused", (), {"__getitem__": refused})())


@pytest.mark.parametrize("options", [("norm", "swiglu"), ("residual",)])
def test_gemm_bucket_pick_matches_the_reference(device, monkeypatch, options):
    """A decode bucket's own pick runs (32 rows, K split in two) and agrees with the reference."""
    from qwen_triton.operators.linear import gemm

    monkeypatch.setattr(gemm, "PREFERRED_DECODE_BY_ROWS", {32: ((None, (32, 32, 32, 2, 4, 2)),)})
    x, weight, kwargs = inputs(20, 100, 70, torch.float16, device, options, seed=3)
    ref = reference(x, weight, **kwargs)
    _one_pick_per_k_refused(monkeypatch)
    assert_close(linear(x, weight, gemv=False, bucket_picks=True, **kwargs), ref, torch.float16)


@pytest.mark.parametrize("K", [1024, 2048, 3584])
def test_gemm_the_tables_bucket_picks_match_the_reference(device, monkeypatch, K):
    """The H200 table's own picks for 64-row decode steps (the table the interpreter takes), at the 0.8B's K (split
    in four past 1024), against the reference, in float16 (the interpreter's bf16 products are wrong)."""
    from qwen_triton.operators.linear import gemm

    assert gemm.bucket_pick(64, K, 0, True) is not None
    x, weight, kwargs = inputs(64, K, 64, torch.float16, device, ("residual",), seed=K)
    ref = reference(x, weight, **kwargs)
    _one_pick_per_k_refused(monkeypatch)
    assert_close(linear(x, weight, gemv=False, bucket_picks=True, **kwargs), ref, torch.float16)
