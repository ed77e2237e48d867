"""The LM head: float32 logits, and the fused argmax (greedy, or Gumbel-sampled at a temperature).

CPU: float16 / float32 inputs, a vocabulary (101) that is no multiple of the interpreter's 32-token
tiles (4 tiles, reduced 2 at a time), M = 1, 3 and 17, the final norm fused; ties across and within tiles
go to the lowest id; the Gumbel path is checked token for token against argmax(logits / T + G) with G
from gumbel_noise_reference (allowing a float32 near-tie); each also with the rows as tensor-core tiles
(`tiled=True`; 2-130 rows: one row block of the bucket, and two of 128).
GPU: bfloat16 at the real shape (248320 x 1024). Logits: the kernel computes in float32 from the same
bf16 values as a float64 reference, so the relative error is float32 summation (~1e-6); we allow 1e-4
(the fused norm can flip the bf16 rounding of an element of x when 1/rms differs by an ulp).
Argmax: equal to the reference argmax wherever the top two reference logits are more than 1e-2 apart,
and always within 1e-2 of the maximum.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.lm_head import benchmark_cases, lm_head_argmax, lm_head_logits
from qwen_triton.operators.sampling import gumbel_noise_reference
from qwen_triton.reference import functional as fn
from tests.operators.test_linear import BENCHMARKS
from tests.support import run_without_interpreter

EPS = 1e-6


def make(shape, dtype, device, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def reference_logits(x, weight, norm_weight=None):
    if norm_weight is not None:
        x = fn.rms_norm(x, norm_weight, EPS)
    return x.double() @ weight.double().T


def assert_argmax(ids, scores, near_tie):
    """ids [M] against float64 scores [M, V]: within near_tie of each row's max, equal when no near-tie."""
    ids = ids.cpu()
    scores = scores.cpu()
    best = scores.max(dim=1).values
    assert (scores.gather(1, ids[:, None])[:, 0] >= best - near_tie).all()
    clear = (scores >= best[:, None] - near_tie).sum(1) == 1
    assert torch.equal(ids[clear], scores.argmax(1)[clear])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("norm", [False, True])
def test_lm_head_logits_and_argmax(device, dtype, M, norm):
    x = make((M, 40), dtype, device, seed=M)
    weight = make((101, 40), dtype, device, seed=1, scale=0.5)
    norm_weight = make((40,), dtype, device, seed=2, scale=0.3) if norm else None
    ref = reference_logits(x, weight, norm_weight)
    logits = lm_head_logits(x, weight, norm_weight=norm_weight)
    assert logits.dtype == torch.float32 and logits.shape == (M, 101)
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-4)
    ids = lm_head_argmax(x, weight, norm_weight=norm_weight)
    assert ids.dtype == torch.int64
    assert_argmax(ids, ref, 1e-3)
    tiled = lm_head_argmax(x, weight, norm_weight=norm_weight, tiled=True)
    assert_argmax(tiled, ref, 1e-3)


@pytest.mark.parametrize("M", [2, 17, 40, 130])
def test_lm_head_argmax_tiled_rows(device, M):
    """The tiled kernel over several row blocks (130 rows: two blocks of 128), the norm in its pass: each row's id
    the argmax of its own logits, the same whichever rows share the call."""
    x = make((M, 40), torch.float16, device, seed=M)
    weight = make((101, 40), torch.float16, device, seed=1, scale=0.5)
    norm_weight = make((40,), torch.float16, device, seed=2, scale=0.3)
    ids = lm_head_argmax(x, weight, norm_weight=norm_weight, tiled=True)
    assert_argmax(ids, reference_logits(x, weight, norm_weight), 1e-2)
    assert torch.equal(lm_head_argmax(x[:1], weight, norm_weight=norm_weight, tiled=True), ids[:1])


@pytest.mark.parametrize("K", [4160, 5120])  # past the screened head's 4,096 columns (the 27B: 5,120)
def test_lm_head_logits_and_argmax_at_hidden_sizes_past_4096(device, K):
    x = make((2, K), torch.float32, device, seed=K)
    weight = make((37, K), torch.float32, device, seed=3, scale=K**-0.5)
    norm_weight = make((K,), torch.float32, device, seed=4, scale=0.3)
    ref = reference_logits(x, weight, norm_weight)
    torch.testing.assert_close(lm_head_logits(x, weight, norm_weight=norm_weight).double(), ref, rtol=1e-5,
                               atol=1e-4)
    assert_argmax(lm_head_argmax(x, weight, norm_weight=norm_weight), ref, 1e-3)


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("tiled", [False, True])
def test_lm_head_argmax_ties_take_the_lowest_id(device, M, tiled):
    weight = make((101, 40), torch.float32, device, seed=3, scale=0.1)
    x = torch.ones(M, 40, device=device)
    weight[[5, 6, 40, 90]] = 1.0  # within the first tile (5, 6) and across tiles (40, 90)
    assert lm_head_argmax(x, weight, tiled=tiled).tolist() == [5] * M


def test_lm_head_argmax_deterministic_and_out(device):
    x = make((3, 40), torch.float16, device, seed=4)
    weight = make((101, 40), torch.float16, device, seed=5)
    out = torch.empty(3, dtype=torch.int64, device=device)
    assert lm_head_argmax(x, weight, out=out) is out
    assert torch.equal(out, lm_head_argmax(x, weight))


@pytest.mark.parametrize("M, per_row_seed", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("tiled", [False, True])
def test_lm_head_argmax_gumbel_sampling(device, M, per_row_seed, tiled):
    x = make((M, 40), torch.float32, device, seed=6)
    weight = make((101, 40), torch.float32, device, seed=7, scale=0.2)
    temperature = torch.tensor([0.7, 0.0, 1.5][:M], device=device)
    seed = torch.tensor([11, 12, 13][:M] if per_row_seed else [11], dtype=torch.int64, device=device)
    step = torch.tensor([4, 5, 6][:M], dtype=torch.int64, device=device)
    ids = lm_head_argmax(x, weight, temperature=temperature, seed=seed, step=step, tiled=tiled)
    logits = reference_logits(x, weight).float().cpu()
    stream = torch.zeros(M, dtype=torch.int64) if per_row_seed and M > 1 else torch.arange(M)
    seeds = seed.cpu().expand(M)
    noise = gumbel_noise_reference(seeds[:, None], step.cpu()[:, None], stream[:, None], torch.arange(101)[None, :])
    t = temperature.cpu()[:, None]
    scores = torch.where(t > 0, logits / torch.where(t > 0, t, 1.0) + noise, logits).double()
    assert_argmax(ids, scores, 1e-4)
    assert torch.equal(ids, lm_head_argmax(x, weight, temperature=temperature, seed=seed, step=step, tiled=tiled))


TILED_SASS = f"""
import runpy, sys
sys.argv = ["sass_counts.py", "argmax-tiled"]
runpy.run_path({str(BENCHMARKS / "sass_counts.py")!r}, run_name="__main__")
"""


def test_tiled_head_compiles_for_hopper():
    """The tiled kernel with the tuning table's pin of each bucket of 16-128 rows compiles for sm_90 with tensor-core
    products; greedy without spills (sampling at 128 rows, 128 x 256 float32 scores and their Gumbel noise, spills a
    little: 1,912 bytes a thread with triton 3.6)."""
    results = run_without_interpreter(TILED_SASS)
    assert len(results) == 8, results
    for name, counts in results.items():
        assert sum(counts["tensor_core"].values()) > 0, (name, counts)
        if "sampling" not in name:
            assert counts["stack_bytes"] == 0, (name, counts)


@pytest.mark.parametrize("call, message", [
    (lambda x, w: lm_head_argmax(x, w.half()), "weight has dtype"),
    (lambda x, w: lm_head_argmax(x, w[:, :30]), "weight has shape"),
    (lambda x, w: lm_head_argmax(x, w, temperature=torch.ones(3)), "temperature, seed and step"),
    (lambda x, w: lm_head_argmax(x, w, temperature=torch.ones(2), seed=torch.zeros(1, dtype=torch.int64),
                                 step=torch.zeros(3, dtype=torch.int64)), "temperature has shape"),
    (lambda x, w: lm_head_argmax(x, w, temperature=torch.ones(3), seed=torch.zeros(2, dtype=torch.int64),
                                 step=torch.zeros(3, dtype=torch.int64)), "seed has shape"),
    (lambda x, w: lm_head_argmax(x, w, out=torch.zeros(3, dtype=torch.int32)), "out has dtype"),
    (lambda x, w: lm_head_argmax(x, w, norm_weight=torch.zeros(41)), "norm_weight has shape"),
    (lambda x, w: lm_head_logits(x, w, out=torch.zeros(3, 101, dtype=torch.float16)), "out has dtype"),
])
def test_lm_head_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.zeros(3, 40), torch.zeros(101, 40))


# ---- GPU: Qwen3.5-0.8B's head, 248320 x 1024 bf16 --------------------------------------------------------

VOCAB, HIDDEN = 248320, 1024


def gpu_head(M, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(M, HIDDEN, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(VOCAB, HIDDEN, device="cuda") * 0.05).to(torch.bfloat16)
    norm_weight = (torch.randn(HIDDEN, device="cuda") * 0.3).to(torch.bfloat16)
    return x, weight, norm_weight


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4, 32, 128])
def test_gpu_lm_head(M):
    x, weight, norm_weight = gpu_head(M)
    ref = reference_logits(x, weight, norm_weight)
    logits = lm_head_logits(x, weight, norm_weight=norm_weight)
    assert ((logits.double() - ref).norm() / ref.norm()).item() < 1e-4
    ids = lm_head_argmax(x, weight, norm_weight=norm_weight)
    assert_argmax(ids, ref, 1e-2)
    assert torch.equal(ids, lm_head_argmax(x, weight, norm_weight=norm_weight))
    tiled = lm_head_argmax(x, weight, norm_weight=norm_weight, tiled=True)
    assert_argmax(tiled, ref, 1e-2)
    assert torch.equal(tiled, lm_head_argmax(x, weight, norm_weight=norm_weight, tiled=True))
    assert torch.equal(tiled[:1], lm_head_argmax(x[:1], weight, norm_weight=norm_weight, tiled=True))


@pytest.mark.gpu
def test_gpu_lm_head_at_the_27b_shape():
    # 248320 x 5120: the head greedy decode runs at the 27B (the screened one takes at most 4,096 columns)
    torch.manual_seed(3)
    x = torch.randn(1, 5120, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(VOCAB, 5120, device="cuda") * 5120**-0.5).to(torch.bfloat16)
    norm_weight = (torch.randn(5120, device="cuda") * 0.3).to(torch.bfloat16)
    ref = reference_logits(x, weight, norm_weight)
    logits = lm_head_logits(x, weight, norm_weight=norm_weight)
    assert ((logits.double() - ref).norm() / ref.norm()).item() < 1e-4
    assert_argmax(lm_head_argmax(x, weight, norm_weight=norm_weight), ref, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiled", [False, True])
def test_gpu_lm_head_argmax_sampling(tiled):
    M = 4
    x, weight, norm_weight = gpu_head(M, seed=1)
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.4], device="cuda")
    seed = torch.tensor([42], dtype=torch.int64, device="cuda")
    step = torch.tensor([0, 1, 2, 3], dtype=torch.int64, device="cuda")
    ids = lm_head_argmax(x, weight, norm_weight=norm_weight, temperature=temperature, seed=seed, step=step,
                         tiled=tiled)
    logits = lm_head_logits(x, weight, norm_weight=norm_weight).cpu()
    noise = gumbel_noise_reference(42, step.cpu()[:, None], torch.arange(M)[:, None], torch.arange(VOCAB)[None, :])
    t = temperature.cpu()[:, None]
    scores = torch.where(t > 0, logits / torch.where(t > 0, t, 1.0) + noise, logits).double()
    assert_argmax(ids, scores, 1e-2)


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
    torch.cuda.synchronize()
