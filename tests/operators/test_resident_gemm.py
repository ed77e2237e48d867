"""The resident-weights GEMM (`linear(..., resident=True)`, linear/resident_gemm.py) against the reference math.

CPU (interpreter): float16 and float32 (tl.dot on bfloat16 is wrong under the interpreter), sizes no multiple of
any block, 1 to 40 rows (several row blocks of 16), every fusion, K in one slice and split in 2 and 3 (the
last program of a tile reducing each row block's partials), a row's result equal in every row count.
GPU (bfloat16, the 0.8B's projections at 1-128 rows, with PDL in a CUDA graph): the reference within the GEMV's
bound, and batch invariance to the bit.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.linear import linear
from qwen_triton.operators.linear.resident_gemm import config_for, resident_gemm
from tests.operators.test_linear import (BENCHMARKS, GPU_BOUND, PROJECTIONS, assert_close,
                                         assert_folded_norm_chain_replays_with_pdl, folded_reference, gpu_inputs,
                                         inputs, reference, relative_norm_error, split_squares)
from tests.support import run_without_interpreter


def run(x, weight, kwargs, options, config=None, squares=None, norm_squares=None):
    out = kwargs["residual"] if "inplace" in options else torch.empty(
        x.shape[0], weight.shape[0] // (2 if "swiglu" in options else 1), dtype=x.dtype, device=x.device)
    arguments = dict(kwargs, activation=1 if "swiglu" in options else 0)
    return resident_gemm(x, weight, out, config=config, squares_out=squares, norm_squares=norm_squares, **arguments)


CONFIGS = [dict(BLOCK_N=16, SPLIT_K=1, num_warps=4), dict(BLOCK_N=32, SPLIT_K=2, num_warps=4),
           dict(BLOCK_N=32, SPLIT_K=3, num_warps=8)]


@pytest.mark.parametrize("config", CONFIGS, ids=["one-slice", "split-2", "split-3"])
@pytest.mark.parametrize("M, options", [
    (1, ()), (3, ("residual",)), (17, ("swiglu",)), (40, ("inplace",)), (17, ("gate",)), (3, ("norm",)),
    (33, ("norm", "swiglu", "residual")),
])
def test_resident_gemm_matches_reference(device, M, options, config):
    x, weight, kwargs = inputs(M, 300, 70, torch.float16, device, options, seed=M)
    ref = reference(x, weight, **kwargs)
    out = run(x, weight, kwargs, options, config)
    assert_close(out, ref, torch.float16)
    if "inplace" in options:
        assert out is kwargs["residual"]


@pytest.mark.parametrize("M", [2, 40])
def test_resident_gemm_float32_through_linear(device, M):
    x, weight, kwargs = inputs(M, 100, 70, torch.float32, device, ("norm", "swiglu", "residual"), seed=5)
    assert_close(linear(x, weight, gemv=False, resident=True, **kwargs), reference(x, weight, **kwargs),
                 torch.float32)


@pytest.mark.parametrize("config", CONFIGS[1:], ids=["split-2", "split-3"])
def test_resident_gemm_folded_norm_and_sums_of_squares(device, config):
    """The decode step's chain: the residual add writing the rows' sums of squares, then the folded norm reading
    them, K split."""
    M = 20
    x, weight, kwargs = inputs(M, 300, 96, torch.float16, device, ("residual",), seed=2)
    hidden = kwargs["residual"]
    ref = reference(x, weight, **kwargs)
    squares = torch.full((M, 3), float("nan"), device=device)
    run(x, weight, kwargs, ("inplace",), config, squares=squares)
    assert_close(hidden, ref, torch.float16)
    torch.testing.assert_close(squares.double().sum(dim=1), hidden.double().pow(2).sum(dim=1), rtol=1e-5, atol=0)
    norm_weight = torch.randn(96, generator=torch.Generator().manual_seed(3)).to(device, torch.float16) * 0.3
    up = (torch.randn(2 * 48, 96, generator=torch.Generator().manual_seed(4)) / 10).to(device, torch.float16)
    folded, expected = folded_reference(hidden, up, norm_weight, activation="swiglu")
    out = run(hidden, folded, {}, ("swiglu",), config, norm_squares=split_squares(hidden, 3))
    # the GEMV's rows (up to 16) round the normalised x first: compare with the GEMM's form for every row
    rstd = torch.rsqrt(hidden.double().pow(2).mean(dim=1, keepdim=True) + 1e-6)
    gate_up = rstd * (hidden.double() @ folded.double().T)
    gate_part, up_part = gate_up.chunk(2, dim=-1)
    assert_close(out, torch.nn.functional.silu(gate_part) * up_part, torch.float16)
    assert expected.shape == out.shape


@pytest.mark.parametrize("config", CONFIGS, ids=["one-slice", "split-2", "split-3"])
def test_resident_gemm_rows_do_not_depend_on_the_batch(device, config):
    """A row's result is the same bits in a call of 1, 5, 16, 17 or 40 rows (one dot a block of 16 rows; the
    split partials summed in split order)."""
    x, weight, kwargs = inputs(40, 300, 70, torch.float16, device, ("swiglu",), seed=9)
    full = run(x, weight, kwargs, ("swiglu",), config)
    for M in (1, 5, 16, 17):
        assert torch.equal(run(x[:M].contiguous(), weight, kwargs, ("swiglu",), config), full[:M]), M


def test_config_for_splits_long_k_and_gives_pairs_more_warps():
    assert config_for(1024, False) == dict(BLOCK_N=32, SPLIT_K=1, num_warps=4)
    assert config_for(3584, False)["SPLIT_K"] == 4
    assert config_for(1024, True)["num_warps"] == 8


def test_resident_gemm_refuses_what_it_cannot_serve(device):
    x = torch.zeros(129, 64, dtype=torch.float16, device=device)
    weight = torch.zeros(32, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="resident=True serves at most 128 rows, x has 129"):
        linear(x, weight, gemv=False, resident=True)
    with pytest.raises(ValueError, match="leaves a split of K=64 empty"):
        resident_gemm(x[:4], weight, torch.empty(4, 32, dtype=x.dtype, device=device),
                      config=dict(BLOCK_N=32, SPLIT_K=3, num_warps=4))
    with pytest.raises(ValueError, match="BLOCK_N >= 32"):
        resident_gemm(x[:4], weight, torch.empty(4, 32, dtype=x.dtype, device=device),
                      squares_out=torch.empty(4, 1, device=device), config=dict(BLOCK_N=16, SPLIT_K=1, num_warps=4))


RESIDENT_SASS = f"""
import runpy, sys
sys.argv = ["sass_counts.py", "resident"]
runpy.run_path({str(BENCHMARKS / "sass_counts.py")!r}, run_name="__main__")
"""


def test_resident_gemm_compiles_for_hopper_without_spills():
    """The engine's configs for the 0.8B's projections compile for sm_90 with tensor-core products, their weight
    slices in registers without spills, and at most two programs' shared memory an SM (one for gate/up's pair)."""
    results = run_without_interpreter(RESIDENT_SASS)
    assert set(results) == {"in-projection", "gate/up", "down", "out-projection"}, results
    for name, counts in results.items():
        assert counts["stack_bytes"] == 0 and counts["tensor_core"]["HMMA"] > 0, (name, counts)
        assert counts["shared_bytes"] <= 232_448 // (1 if name == "gate/up" else 2), (name, counts)


@pytest.mark.gpu
@pytest.mark.parametrize("name, rows, K, options", PROJECTIONS, ids=[p[0] for p in PROJECTIONS])
def test_gpu_resident_gemm_real_shapes_batch_invariant(name, rows, K, options):
    """The 0.8B's projections at 1-128 rows in bf16: within the GEMV's bound of the reference, and a row's bits the
    same in every row count."""
    x, weight, kwargs = gpu_inputs(128, rows, K, options, seed=13)
    results = {}
    for M in (1, 2, 16, 64, 128):
        rows_kwargs = {key: (value[:M].clone() if torch.is_tensor(value) and value.dim() == 2 else value)
                       for key, value in kwargs.items()}
        ref = reference(x[:M], weight, **rows_kwargs)
        out = linear(x[:M].clone(), weight, gemv=False, resident=True, **rows_kwargs)
        assert relative_norm_error(out, ref) < GPU_BOUND, M
        results[M] = out
    for M in (2, 16, 64, 128):
        assert torch.equal(results[M][:1], results[1]), M


@pytest.mark.gpu
@pytest.mark.parametrize("M", [3, 16, 100])
def test_gpu_resident_gemm_with_pdl_in_a_graph(M):
    """The folded-norm chain (test_linear.assert_folded_norm_chain_replays_with_pdl) through the resident-weights
    GEMM, the residual add's K = 3,584 split: with PDL in a CUDA graph, the bits of the launches without PDL."""
    assert_folded_norm_chain_replays_with_pdl(M, 3584, gemv=False, resident=True)
