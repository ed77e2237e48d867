"""Zero-centred RMSNorm against the reference (x / rms(x) * (1 + w), float32 math, x's dtype out).

CPU: float32, float16 and bfloat16 (the interpreter rounds float32 -> bfloat16 toward zero, the GPU to
nearest: one bf16 ulp, 2^-7 relative, is allowed there), row lengths that are no power of two (33, 100)
and one longer than a block (9000 > 8192: the two-pass path), strided rows, out= and in place.
GPU: bfloat16 at the real shape (hidden 1024; M = 1 and 4096): one rounding from the float32
reference: within 2^-8 relative, plus the 1-ulp float32 difference of 1/rms that can flip a rounding
(we allow one bf16 ulp: 2^-7 relative).
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.norm import benchmark_cases, rms_norm, row_squares
from qwen_triton.reference import functional as fn

EPS = 1e-6
ULP = {torch.float32: 2e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def make(shape, dtype, device, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def assert_within_ulp(out, ref):
    tolerance = ULP[ref.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, N", [(1, 33), (3, 100), (2, 9000)])
def test_rms_norm_matches_reference(device, dtype, M, N):
    wide = make((M, N + 5), dtype, device, seed=N, scale=3.0)
    x = wide[:, 2:2 + N]  # strided rows
    weight = make((N,), dtype, device, seed=1, scale=0.3)
    assert_within_ulp(rms_norm(x, weight, EPS), fn.rms_norm(x, weight, EPS))


def test_rms_norm_out_and_in_place(device):
    x = make((3, 100), torch.float16, device, seed=2)
    weight = make((100,), torch.float32, device, seed=3, scale=0.3)
    ref = fn.rms_norm(x, weight, EPS)
    out = torch.empty_like(x)
    assert rms_norm(x, weight, EPS, out=out) is out
    assert_within_ulp(out, ref)
    rms_norm(x, weight, EPS, out=x)
    assert torch.equal(x, out)


def test_rms_norm_deterministic(device):
    x = make((3, 100), torch.float32, device, seed=4)
    weight = make((100,), torch.float32, device, seed=5)
    assert torch.equal(rms_norm(x, weight, EPS), rms_norm(x, weight, EPS))


@pytest.mark.parametrize("call, message", [
    (lambda x, w: rms_norm(x, w[:10]), "weight has shape"),
    (lambda x, w: rms_norm(x, w.int()), "weight has dtype"),
    (lambda x, w: rms_norm(x[0], w), "x has shape"),
    (lambda x, w: rms_norm(x.int(), w), "x has dtype"),
    (lambda x, w: rms_norm(x, w, out=torch.zeros(3, 40, dtype=torch.float16)), "out has dtype"),
    (lambda x, w: rms_norm(x, w, out=torch.zeros(2, 40)), "out has shape"),
    (lambda x, w: rms_norm(x.T.contiguous().T, w), "x must have unit stride"),
])
def test_rms_norm_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(3, 40), torch.zeros(40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, N, parts", [(1, 33, 1), (3, 100, 4), (2, 9000, 32)])
def test_row_squares(device, dtype, M, N, parts):
    """Each row's sum of squares in float32 in the first column, zeros in the others; strided rows."""
    wide = make((M, N + 5), dtype, device, M + N)
    x = wide[:, 2:2 + N]
    out = torch.full((M, parts), float("nan"), device=device)
    assert row_squares(x, out=out) is out
    expected = x.double().pow(2).sum(dim=1)
    torch.testing.assert_close(out[:, 0].double(), expected, rtol=1e-5, atol=0)
    assert (out[:, 1:] == 0).all()
    torch.testing.assert_close(row_squares(x)[:, 0].double(), expected, rtol=1e-5, atol=0)


def test_row_squares_rejects_bad_arguments():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="out has no columns"):
        row_squares(x, out=torch.zeros(3, 0))
    with pytest.raises(ValueError, match="out has dtype"):
        row_squares(x, out=torch.zeros(3, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has shape"):
        row_squares(x, out=torch.zeros(2, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4096])
def test_gpu_rms_norm(M):
    torch.manual_seed(0)
    x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16) * 3
    weight = (torch.randn(1024, device="cuda") * 0.3).to(torch.bfloat16)
    out = rms_norm(x, weight, EPS)
    assert_within_ulp(out, fn.rms_norm(x, weight, EPS))
    assert torch.equal(out, rms_norm(x, weight, EPS))


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
    torch.cuda.synchronize()
