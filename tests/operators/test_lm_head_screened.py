"""The screened greedy LM head (lm_head/screened.py): the exact argmax, through an int8 screen and a check of the
candidate rows.

What must hold: the ids are the argmax of the exact logits of the row x_n the kernels formed (float64 here),
lowest id on ties; every row's upper bound is at least its exact logit and tau at most the greatest (the bound is
rigorous, checked row by row); the candidates are few on random data, all rows where the screen cannot tell
them apart; the threshold is left at -inf for the next call. CPU (interpreter): float32 / float16 / bfloat16
inputs (the screen's product is int8, its other arithmetic float32), a vocabulary of 3000 (not a multiple of the
tiles), hidden sizes 64 and 200, up to 17 rows (two groups of the screen's 16). GPU: the real shape (248320 x 1024,
bf16) against lm_head_argmax and float64.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.lm_head import lm_head_argmax
from qwen_triton.operators.lm_head import screened
from qwen_triton.operators.lm_head.screened import build_screen, candidate_counts, lm_head_argmax_screened
from tests.operators.test_lm_head import EPS, assert_argmax, make, reference_logits

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def exact_logits(x, weight):
    """float64 logits of the x_n the last call formed (its workspace) against weight: what the check computes
    in float32."""
    M, K = x.shape
    normed = screened._workspaces[(x.device, M, weight.shape[0], K)].normed
    return normed.double() @ weight.double().T


def run_and_check(x, weight, norm_weight=None):
    """ids, and the bound's rigour and the ids' exactness asserted; returns (ids, candidates per row)."""
    screen = build_screen(weight)
    ids = lm_head_argmax_screened(x, weight, screen, norm_weight=norm_weight, eps=EPS)
    exact = exact_logits(x, weight)
    M, K = x.shape
    work = screened._workspaces[(x.device, M, weight.shape[0], K)]
    upper, threshold, last_threshold = work.upper, work.threshold, work.kept
    slack = 1e-12 * exact.abs().max()
    assert (upper.double() >= exact - slack).all(), "an upper bound below its exact logit"
    assert (last_threshold.double() <= exact.max(dim=1).values + slack).all(), "tau above the greatest logit"
    assert torch.isinf(threshold).all() and (threshold < 0).all(), "tau not reset for the next call"
    best = exact.max(dim=1, keepdim=True).values
    assert ((exact == best).long().argmax(dim=1) == ids.to(exact.device)).all(), \
        "not the exact argmax (lowest id on ties)"
    return ids, candidate_counts(x, weight.shape[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M, V, K, norm", [(1, 3000, 64, True), (3, 3000, 200, False), (2, 3000, 64, False),
                                           (2, 600, 5000, True)])  # 600 rows at 5,000 columns: the interpreter's time
def test_screened_argmax_is_exact(device, dtype, M, V, K, norm):
    x = make((M, K), dtype, device, seed=10 + M)
    weight = make((V, K), dtype, device, seed=11, scale=0.5)
    norm_weight = make((K,), dtype, device, seed=12, scale=0.3) if norm else None
    ids, candidates = run_and_check(x, weight, norm_weight)
    assert_argmax(ids, reference_logits(x, weight, norm_weight), 1e-2)  # and the reference's choice
    # a handful of the rows (5%); at 5,000 columns about a third of them: the bound grows as K, random logits
    # spread as sqrt(K) (a trained head's margins are wider)
    assert all(1 <= count <= (V // 20 if K <= 1024 else V // 2) for count in candidates), candidates
    # the same ids again (the threshold was reset), into out
    out = torch.empty(M, dtype=torch.int64, device=device)
    screen = build_screen(weight)
    assert lm_head_argmax_screened(x, weight, screen, out, norm_weight=norm_weight, eps=EPS) is out
    assert torch.equal(out, ids)
    assert torch.equal(ids, lm_head_argmax(x, weight, norm_weight=norm_weight, eps=EPS))


def test_a_row_does_not_depend_on_its_batch(device):
    """17 rows (two groups of 16 in the screen's product): each row's id as when it runs alone (through the
    one-row epilogue), its upper bounds and tau within a float32 rounding (the two epilogues' arithmetic is the
    same, the compiler's contractions of it may differ)."""
    K = 64
    x = make((17, K), torch.float16, device, seed=15)
    weight = make((2000, K), torch.float16, device, seed=16, scale=0.5)
    norm_weight = make((K,), torch.float16, device, seed=17, scale=0.3)
    ids, _ = run_and_check(x, weight, norm_weight)
    batch = screened._workspaces[(x.device, 17, 2000, K)]
    upper, kept = batch.upper.clone(), batch.kept.clone()
    screen = build_screen(weight)
    for row in (0, 5, 15, 16):
        alone = lm_head_argmax_screened(x[row:row + 1], weight, screen, norm_weight=norm_weight, eps=EPS)
        work = screened._workspaces[(x.device, 1, 2000, K)]
        assert alone.item() == ids[row].item()
        scale = upper[row].abs().max().item()
        torch.testing.assert_close(work.upper[0], upper[row], rtol=1e-6, atol=1e-6 * scale)
        torch.testing.assert_close(work.kept[0], kept[row], rtol=1e-6, atol=1e-6 * scale)


def test_rows_the_screen_cannot_tell_apart(device):
    """Rows that round to the same int8 row: all candidates, and the check's exact logits decide; equal rows go
    to the lowest id."""
    K = 64
    base = make((1, K), torch.float32, device, seed=20)
    weight = make((600, K), torch.float32, device, seed=21, scale=0.1)
    close = base + make((8, K), torch.float32, device, seed=22, scale=1e-6)  # far below an int8 step
    weight[100:108] = close
    weight[300] = close[5]  # equal to row 105: 105 must win a tie
    x = base.clone()
    ids, candidates = run_and_check(x, weight)
    assert 100 <= ids.item() < 108 or ids.item() == 300
    assert candidates[0] >= 9
    exact = exact_logits(x, weight)
    assert ids.item() == exact[0, 100:108].argmax().item() + 100


def test_every_row_a_candidate_when_the_logits_are_equal(device):
    weight = torch.ones(700, 32, device=device)
    x = torch.ones(1, 32, device=device)
    ids, candidates = run_and_check(x, weight)
    assert ids.tolist() == [0] and candidates == [700]


def test_build_screen(device):
    weight = make((300, 48), torch.bfloat16, device, seed=30)
    weight[7] = 0  # a zero row: scale 1, q = 0
    screen = build_screen(weight, rows_per_piece=128)
    w = weight.double()
    assert screen.quantized.dtype == torch.int8 and screen.quantized.abs().max() <= 127
    dequantized = screen.scales.double()[:, None] * screen.quantized.double()
    residual = (w - dequantized).norm(dim=1)
    assert (screen.residual_bounds.double() >= residual + screened.summation_bound(48) * w.norm(dim=1)).all()
    assert (residual <= 0.6 * screen.scales.double() * 48**0.5).all()  # half a step an element at most
    assert (screen.quantized_norms.double() >= dequantized.norm(dim=1)).all()
    assert screen.scales[7].item() == 1.0 and screen.quantized[7].abs().max().item() == 0


def test_the_summation_bound_grows_with_the_columns(device):
    # h_i covers the float32 summation of a row of K terms (K u / (1 - K u), u = 2^-24, with a factor of 2 to
    # spare): SUMMATION_BOUND up to 1024 columns (the 0.8B), in proportion beyond (the 4B's 2560, the 9B's 4096)
    unit = 2.0**-24
    assert screened.summation_bound(48) == screened.summation_bound(1024) == screened.SUMMATION_BOUND
    for columns in (1024, 2560, 4096):
        assert screened.summation_bound(columns) >= 1.96 * columns * unit / (1 - columns * unit)
    weight = make((40, 2560), torch.float32, device, seed=31)
    screen = build_screen(weight)
    residual = (weight.double() - screen.scales.double()[:, None] * screen.quantized.double()).norm(dim=1)
    assert (screen.residual_bounds.double() >= residual + screened.summation_bound(2560)
            * weight.double().norm(dim=1)).all()


def test_errors_name_the_argument(device):
    x = make((1, 32), torch.float32, device, seed=40)
    weight = make((100, 32), torch.float32, device, seed=41)
    screen = build_screen(weight)
    with pytest.raises(ValueError, match="weight has shape"):
        lm_head_argmax_screened(x, weight[:, :16], screen)
    with pytest.raises(ValueError, match="screen.quantized"):
        lm_head_argmax_screened(x, weight, build_screen(weight[:50]))
    with pytest.raises(ValueError, match="out has dtype"):
        lm_head_argmax_screened(x, weight, screen, torch.zeros(1, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="norm_weight"):
        lm_head_argmax_screened(x, weight, screen, norm_weight=torch.zeros(31, device=device))
    with pytest.raises(ValueError, match="columns"):
        build_screen(torch.zeros(4, screened.MAX_COLUMNS + 1, device=device))
    with pytest.raises(ValueError, match="no call"):
        candidate_counts(torch.zeros(5, 32, device=device), 100)


# ---- GPU, the real shape ----------------------------------------------------------------------------

VOCAB, HIDDEN = 248320, 1024


def test_the_check_takes_more_rows_a_program_for_more_rows_of_x():
    """Kernel 2's BLOCK_R: CHECK_ROWS for one row of x, doubling with the rows' power of two up to CHECK_ROWS_MOST,
    so that 16 rows launch as many programs as one (the real vocabulary's 1,940 a row at one row, 122 at 16)."""
    assert [screened.check_rows(M) for M in (1, 2, 3, 4, 16, 17, 128)] == [128, 256, 512, 512, 2048, 2048, 2048]
    programs = {M: -(-VOCAB // screened.check_rows(M)) * M for M in (1, 16)}
    assert programs == {1: 1940, 16: 1952}


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 16])
def test_gpu_screened_argmax_real_shape(M):
    x = make((M, HIDDEN), torch.bfloat16, "cuda", seed=50 + M)
    weight = make((VOCAB, HIDDEN), torch.bfloat16, "cuda", seed=51, scale=0.05)
    norm_weight = make((HIDDEN,), torch.bfloat16, "cuda", seed=52, scale=0.3)
    ids, candidates = run_and_check(x, weight, norm_weight)
    print(f"screened LM head, M = {M}: candidates {candidates} of {VOCAB} rows")
    assert all(count <= 2000 for count in candidates)
    assert torch.equal(ids, lm_head_argmax(x, weight, norm_weight=norm_weight, eps=EPS))


@pytest.mark.gpu
def test_gpu_screened_argmax_cuda_graph():
    """Captured with PDL, replayed on new inputs: the eager ids each time (the threshold reset by every replay)."""
    from tests.support import graph_replays_as_eager

    weight = make((VOCAB, HIDDEN), torch.bfloat16, "cuda", seed=60, scale=0.05)
    norm_weight = make((HIDDEN,), torch.bfloat16, "cuda", seed=61, scale=0.3)
    screen = build_screen(weight)
    x = make((1, HIDDEN), torch.bfloat16, "cuda", seed=62)
    out = torch.empty(1, dtype=torch.int64, device="cuda")
    lm_head_argmax_screened(x, weight, screen, out, norm_weight=norm_weight, eps=EPS, pdl=True)  # warm-up
    for seed in (63, 64, 65):
        x.copy_(make((1, HIDDEN), torch.bfloat16, "cuda", seed=seed))
        eager = graph_replays_as_eager(
            lambda: lm_head_argmax_screened(x, weight, screen, out, norm_weight=norm_weight, eps=EPS, pdl=True), out)
        assert torch.equal(eager, lm_head_argmax(x, weight, norm_weight=norm_weight, eps=EPS))
