"""Top-k sampling's LM head through the int8 screen: logits that carry, exactly, every token top-k sampling can keep,
reading the head's int8 copy and the few rows of W that can reach the row's top k.

Top-k sampling (0 < top_k <= K_MAX: sampling/sample.py's top-k path, Qwen's recommended settings) reads only the
tokens whose scaled logit reaches the row's k-th largest; the screen of screened.py (its kernels 0 and 1 and its
notation: c_i, B_i and E_i, the float32 logit the check computes, |E_i - c_i| <= B_i) bounds every logit for half
the bytes of W, and that is enough to find them. Per row of x, with T its temperature (the sampler's s = L / T; 1
for a greedy row), k = top_k_rounds(...) (sample.py: top_k at most V and the candidate width; 1 for a greedy row),
and the penalties (sampling/penalties.py: L_i = penalized_logit(E_i, ...) for the tokens they touch, the set P:
counted, or in the prompt under a repetition penalty; L_i = E_i for the others):

    tau    = the k-th largest of the lower bounds c_i - B_i over the tokens not in P, through maxima of disjoint
             groups of GROUP tokens: the k-th largest group maximum (-inf when fewer than k groups have one);
    cut    = tau - (2e-6 |tau| + 1e-20);
    the candidates: P, and every other token whose upper bound u_i = c_i + B_i reaches cut;
    logits[i] = L_i exactly for a candidate (its row of W read whole, E_i formed as screened.py's check forms it,
             the penalties applied by penalized_logit, the penalties kernel's arithmetic); u_i for the others.

Why the sampler then chooses exactly what it chooses from the full penalised logits. The k groups of the k largest
maxima each hold a token outside P with a lower bound >= tau, so at least k tokens have L_i = E_i >= c_i - B_i >=
tau, and t_L, the k-th largest L over all tokens, is >= tau. A token j that is no candidate is outside P, and its
written value u_j and its true L_j = E_j <= u_j both lie below cut. The sampler compares s = fl(L / T), T > 0 (its
division, div.full.f32 on the GPU: within 2 ulp, a relative 2.4e-7; correctly rounded under the interpreter), and
a value a below cut against b = t_L >= tau: of opposite signs they stay ordered; both positive, b / a >= tau / a >
1 + 2e-6; both negative, |a| / |b| > (|tau| + 2e-6 |tau|) / |tau|: either way further apart than two roundings of
2.4e-7 can close, so fl(a / T) < fl(t_L / T) = t_s, the k-th largest s (the rounding of a division by T > 0 never
reverses an order, only ties it). So every token whose s reaches t_s, in either row, is a candidate written exactly;
every other value of either row has s < t_s. The two rows have the same k-th largest s, the same tokens at or above
it with the same values (ties included), hence the same min-p cut (from the same maximum), the same top-p mass over
the kept tokens, the same Gumbel-max draw over them (noise keyed by token id): the same id, for every seed. (The
full path's logits come from lm_head_logits' GEMV, whose float32 sums run in another order than the check's: a
last-bit difference, which changes an id only where two scaled logits or a top-p boundary lie within float32
rounding.) Writing u_j rather than -inf leaves the sampler's chunks distinct values, so no chunk of a long row of
non-candidates falls into its rounds of ties; P's tokens get u = +inf, so the check takes them whatever tau.

The check costs a row of W (2 KB at the 0.8B) a candidate: at the 0.8B shape with random weights (normal, 0.05),
top_k 20 leaves 446 to 776 candidates of 248,320 a row, 64 1,431 to 1,801 (greedy: 31 to 50); groups of 128
tokens give within 7% of the exact k-th lower bound's candidates (a PyTorch simulation of the bounds, three rows;
`top_k_candidate_counts` reports a call's). Every token the penalties touch is a candidate too: a long
generation's distinct ids (and the prompt's under a repetition penalty) are read from W, one row each.

Four kernels, each a row's work its own (its ids do not depend on its batch):
0. screened.py's `_quantize_kernel`: x_n, q_x and the row statistics.
1. `_screen_top_k_kernel`, grid (V / BLOCK_V, M / 16): screened.py's int8 product for up to 16 rows of x (the
   int8 head read once for them); its epilogue reads the tile's penalty histories (counts, prompt mask) of the
   penalised rows, writes u_i (+inf in P) into the logits and each group's greatest lower bound outside P.
2. `_threshold_kernel`, grid (M,): a row's cut from its group maxima (k rounds of max-and-mask); zeroes the row's
   candidate count.
3. `_check_top_k_kernel`, grid (V / BLOCK_R, M): the tokens of its BLOCK_R whose written u_i reaches cut, one after
   the other: E_i, the penalties, the logit written in place; their number added to the row's count.
Then sample(..., top_k_bound=) draws from the logits, as from the full head's (sample.py), and count_tokens counts.

Floor at M = 1 (Qwen3.5-0.8B): screened.py's 254.3 MB of int8 weights and 3 MB of per-row floats, 1 MB of logits
written by the screen and read by the check, and, in a penalised row, its counts and prompt mask (1.2 MB), plus the
candidates' rows: ~62 us at the H200's 4.2 TB/s against lm_head_logits' 508.6 MB (~120 us). At M = 16 the int8
head is still read once; the logits, penalty histories and candidates grow with M.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import (allow_next_kernel, check_same_device, check_slots, check_tensor, interpreting, launch_options,
                      sequence_slot, wait_for_previous_kernel)
from ..sampling.penalties import penalized_logit, penalized_row
from ..sampling.sample import EMPTY, INT32_MAX, K_MAX, _key32, _unkey, candidate_width, top_k_rounds
from .argmax import FLOAT_DTYPES
from . import screened
from .screened import (MAX_COLUMNS, LmHeadScreen, _exact_logit, _quantize_kernel, _quantized_products,
                       _screen_bounds, _tiles)

# tokens a lower-bound maximum covers: one a screen tile on the GPU (1,940 maxima a row at the 0.8B); the
# interpreter's tests' small heads get several a tile, so that a top_k of a few tens still leaves few candidates
GROUP = 16 if interpreting() else 128
THRESHOLD_WARPS = 4
# cut = tau - (CUT_RELATIVE |tau| + CUT_ABSOLUTE): room for the sampler's division by T (the module docstring)
CUT_RELATIVE = tl.constexpr(2e-6)
CUT_ABSOLUTE = tl.constexpr(1e-20)


@triton.jit
def _touched(tokens, token_mask, slot, penalised, repetition, counts_ptr, stride_cm, prompt_ptr, stride_pm):
    """Whether the penalties change each token's logit (broadcast over tokens and rows): in a penalised row, a token
    counted in its slot's history, or in its prompt under a repetition penalty."""
    history = tl.maximum(slot, 0).to(tl.int64)  # a padding row (slot -1) is never penalised: nothing is read
    read = token_mask & penalised
    count = tl.load(counts_ptr + history * stride_cm + tokens, mask=read, other=0)
    in_prompt = tl.load(prompt_ptr + history * stride_pm + tokens, mask=token_mask & (penalised & (repetition != 1.0)),
                        other=0) != 0
    return read & ((count > 0) | in_prompt)


@triton.jit
def _screen_top_k_kernel(
    quantized_ptr, scale_ptr, residual_bound_ptr, quantized_norm_ptr, quantized_x_ptr, statistics_ptr,
    logits_ptr, stride_lm, maxima_ptr,
    slots_ptr, counts_ptr, stride_cm, prompt_ptr, stride_pm, repetition_ptr, frequency_ptr, presence_ptr,
    M, V, K, stride_qv, GROUPS_PER_ROW,
    SINGLE: tl.constexpr, HAS_PENALTIES: tl.constexpr, HAS_SLOTS: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr,
):
    """BLOCK_V rows of q against the q_x of 16 rows of x (screened.py's product and bounds): for each row of x, u_i
    written into its logits (+inf for a token the penalties touch) and the greatest c_i - B_i of each GROUP tokens
    the penalties leave alone (-inf where there is none) into its maxima."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    group = tl.program_id(1)
    offs_v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    rows = group * 16 + tl.arange(0, 16)
    row_mask = rows < M
    dot = _quantized_products(quantized_ptr, quantized_x_ptr, offs_v, v_mask, group, K, stride_qv, BLOCK_V, BLOCK_K)
    approximate, bound = _screen_bounds(dot, offs_v, v_mask, rows, row_mask, scale_ptr, residual_bound_ptr,
                                        quantized_norm_ptr, statistics_ptr, SINGLE)
    offs_group = pid * (BLOCK_V // GROUP) + tl.arange(0, BLOCK_V // GROUP)
    if SINGLE:
        touched = offs_v < 0
        if HAS_PENALTIES:
            row = group * 16  # 0
            slot = sequence_slot(slots_ptr, row, HAS_SLOTS)
            repetition = tl.load(repetition_ptr + row)
            penalised = penalized_row(slot, repetition, tl.load(frequency_ptr + row), tl.load(presence_ptr + row))
            touched = _touched(offs_v, v_mask, slot, penalised, repetition, counts_ptr, stride_cm, prompt_ptr,
                               stride_pm)
        tl.store(logits_ptr + offs_v, tl.where(touched, float("inf"), approximate + bound), mask=v_mask)
        lower = tl.where(v_mask & ~touched, approximate - bound, float("-inf"))
        tl.store(maxima_ptr + offs_group, tl.max(tl.reshape(lower, [BLOCK_V // GROUP, GROUP]), axis=1))
    else:
        touched = (offs_v[:, None] < 0) & (rows[None, :] < 0)
        if HAS_PENALTIES:
            if HAS_SLOTS:
                slot = tl.load(slots_ptr + rows, mask=row_mask, other=-1)
            else:
                slot = tl.where(row_mask, rows, -1)
            repetition = tl.load(repetition_ptr + rows, mask=row_mask, other=1.0)
            penalised = penalized_row(slot, repetition, tl.load(frequency_ptr + rows, mask=row_mask, other=0.0),
                                      tl.load(presence_ptr + rows, mask=row_mask, other=0.0))
            touched = _touched(offs_v[:, None], v_mask[:, None], slot[None, :], penalised[None, :],
                               repetition[None, :], counts_ptr, stride_cm, prompt_ptr, stride_pm)
        tl.store(logits_ptr + rows.to(tl.int64)[None, :] * stride_lm + offs_v[:, None],
                 tl.where(touched, float("inf"), approximate + bound), mask=v_mask[:, None] & row_mask[None, :])
        lower = tl.where(v_mask[:, None] & ~touched, approximate - bound, float("-inf"))
        maxima = tl.max(tl.reshape(lower, [BLOCK_V // GROUP, GROUP, 16]), axis=1)
        tl.store(maxima_ptr + rows[None, :] * GROUPS_PER_ROW + offs_group[:, None], maxima, mask=row_mask[None, :])


@triton.jit
def _threshold_kernel(
    maxima_ptr, temperature_ptr, top_k_ptr, threshold_ptr, candidates_ptr, GROUPS_PER_ROW, V,
    WIDTH: tl.constexpr, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per row: tau, the k-th largest of its group maxima (k rounds of max-and-mask over maxima packed
    with their group, so each round removes one), and the cut below it; the row's candidate count zeroed."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    row = tl.program_id(0)
    rounds = top_k_rounds(tl.load(temperature_ptr + row) > 0, tl.load(top_k_ptr + row), V, WIDTH)
    offs = tl.arange(0, BLOCK_G)
    mask = offs < GROUPS_PER_ROW
    maxima = tl.load(maxima_ptr + row * GROUPS_PER_ROW + offs, mask=mask, other=float("-inf"))
    packed = tl.where(mask, (_key32(maxima).to(tl.int64) << 32) | (-offs + INT32_MAX).to(tl.int64), EMPTY)
    best = tl.max(packed, axis=0)
    taken = 1
    while taken < rounds:
        packed = tl.where(packed == best, EMPTY, packed)
        best = tl.max(packed, axis=0)
        taken += 1
    tau = tl.where(best == EMPTY, float("-inf"), _unkey((best >> 32).to(tl.int32)))
    tl.store(threshold_ptr + row, tau - (CUT_RELATIVE * tl.abs(tau) + CUT_ABSOLUTE))
    tl.store(candidates_ptr + row, 0)


@triton.jit
def _check_top_k_kernel(
    w_ptr, normed_ptr, logits_ptr, stride_lm, threshold_ptr, candidates_ptr,
    slots_ptr, counts_ptr, stride_cm, prompt_ptr, stride_pm, repetition_ptr, frequency_ptr, presence_ptr,
    V, K, stride_wv,
    HAS_PENALTIES: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_X: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """BLOCK_R tokens of a row against its cut: each candidate, in increasing order, E_i from its row of W
    (screened.py's check arithmetic), penalised as the penalties kernel would, written over its bound (a loop over
    the candidates, as screened.py's check, since a tile holds few)."""
    allow_next_kernel(USE_PDL)
    wait_for_previous_kernel(USE_PDL)
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = tl.arange(0, BLOCK_R)
    offs_v = pid * BLOCK_R + offs
    logits_row = logits_ptr + row.to(tl.int64) * stride_lm
    upper = tl.load(logits_row + offs_v, mask=offs_v < V, other=float("-inf"))
    remaining = (offs_v < V) & (upper >= tl.load(threshold_ptr + row))
    found = tl.sum(remaining.to(tl.int32), axis=0)
    if found > 0:
        tl.atomic_add(candidates_ptr + row, found, sem="relaxed")
        columns = tl.arange(0, BLOCK_X)
        normed = tl.load(normed_ptr + row * K + columns, mask=columns < K, other=0.0)
        penalised = False
        if HAS_PENALTIES:
            slot = sequence_slot(slots_ptr, row, HAS_SLOTS)
            history = tl.maximum(slot, 0).to(tl.int64)
            repetition = tl.load(repetition_ptr + row)
            frequency = tl.load(frequency_ptr + row)
            presence = tl.load(presence_ptr + row)
            penalised = penalized_row(slot, repetition, frequency, presence)
        while tl.max(remaining.to(tl.int32), axis=0) > 0:
            first = tl.argmax(remaining.to(tl.int32), axis=0, tie_break_left=True)  # the lowest candidate left
            token = pid * BLOCK_R + first
            logit = _exact_logit(w_ptr, token, stride_wv, normed, columns, K)
            if HAS_PENALTIES:
                if penalised:  # every token of a penalised row through the formula, as the penalties kernel
                    count = tl.load(counts_ptr + history * stride_cm + token)
                    in_prompt = tl.load(prompt_ptr + history * stride_pm + token) != 0
                    logit = penalized_logit(logit, count, in_prompt, repetition, frequency, presence)
            tl.store(logits_row + token, logit)
            remaining = remaining & (offs != first)


class _Workspace(NamedTuple):
    """A call's buffers, per (device, M, V, K)."""

    normed: torch.Tensor  # x_n [M, K] float32
    quantized_x: torch.Tensor  # q_x [16 cdiv(M, 16), K] int8, zero past M
    statistics: torch.Tensor  # s_x, ||x_n||, ||r_x|| [M, 3]
    groups: int  # group maxima a row
    maxima: torch.Tensor  # [M, groups] float32
    threshold: torch.Tensor  # the cut [M]
    candidates: torch.Tensor  # int32 [M]: the last call's candidates a row


_workspaces: dict[tuple, _Workspace] = {}


def _workspace(device, M: int, V: int, K: int) -> _Workspace:
    key = (device, M, V, K)
    if key not in _workspaces:
        screen_rows = _tiles(V, K)[0]
        groups = triton.cdiv(V, screen_rows) * (screen_rows // GROUP)
        _workspaces[key] = _Workspace(
            normed=torch.empty(M, K, dtype=torch.float32, device=device),
            quantized_x=torch.zeros(triton.cdiv(M, 16) * 16, K, dtype=torch.int8, device=device),
            statistics=torch.empty(M, 3, dtype=torch.float32, device=device),
            groups=groups,
            maxima=torch.empty(M, groups, dtype=torch.float32, device=device),
            threshold=torch.empty(M, dtype=torch.float32, device=device),
            candidates=torch.zeros(M, dtype=torch.int32, device=device),
        )
    return _workspaces[key]


def screened_top_k_bytes(vocabulary: int, hidden: int, rows: int, penalized: bool) -> int:
    """The bytes a call must move besides the candidates' rows: the screen's (screened.py: the int8 copy, three
    floats a row of W), the logits written and read back (4 bytes a token a row), and a penalised call's counts and
    prompt masks (5 bytes a token a row)."""
    return vocabulary * hidden + 3 * 4 * vocabulary + rows * vocabulary * (8 + 5 * penalized)


def lm_head_screened_top_k(
    x: torch.Tensor,
    weight: torch.Tensor,
    screen: LmHeadScreen,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    *,
    top_k_bound: int = K_MAX,
    counts: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    repetition: torch.Tensor | None = None,
    frequency: torch.Tensor | None = None,
    presence: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: bool = False,
) -> torch.Tensor:
    """Logits [M, V] of x [M, H] @ weight[V, H].T, written into `logits` (float32, rows may be strided) and
    returned, for sample(logits, temperature, top_k, ..., top_k_bound=top_k_bound): every token top-k sampling can
    keep holds its exact (penalised) logit, every other a value below what it keeps (the module docstring), read
    from screen = build_screen(weight) and the candidates' rows of weight.

    temperature float32 [M] (0: a greedy row), top_k int32 [M] (every sampled row 1 to top_k_bound, as sample's
    top-k path needs; top_k_bound 1 to K_MAX). The penalties (all five or none): counts int32 [S, V], prompt_mask
    bool [S, V], repetition / frequency / presence float32 [M], row r's history at slots[r] (int32 [M], negative: a
    padding row; None: slot r), as apply_penalties takes them: applied here, to the candidates, instead of by it.
    norm_weight [H]: the final norm, fused. Capturable in a CUDA graph after a warm-up call at the same shapes.
    pdl: programmatic dependent launch of the four kernels (Hopper).
    """
    check_tensor("x", x, shape=(None, None), dtype=FLOAT_DTYPES)
    M, K = x.shape
    if K > MAX_COLUMNS:
        raise ValueError(f"x has {K} columns, at most {MAX_COLUMNS} supported")
    check_tensor("weight", weight, shape=(None, K), dtype=x.dtype)
    V = weight.shape[0]
    if V == 0 or V >= 2**31:
        raise ValueError(f"weight has {V} rows, expected 1 to 2**31 - 1")
    check_tensor("screen.quantized", screen.quantized, shape=(V, K), dtype=torch.int8)
    for name in ("scales", "residual_bounds", "quantized_norms"):
        check_tensor(f"screen.{name}", getattr(screen, name), shape=(V,), dtype=torch.float32, contiguous=True)
    check_tensor("logits", logits, shape=(M, V), dtype=torch.float32)
    check_tensor("temperature", temperature, shape=(M,), dtype=torch.float32, contiguous=True)
    check_tensor("top_k", top_k, shape=(M,), dtype=torch.int32, contiguous=True)
    if isinstance(top_k_bound, bool) or not isinstance(top_k_bound, int) or not 1 <= top_k_bound <= K_MAX:
        raise ValueError(f"top_k_bound must be an int from 1 to {K_MAX}, got {top_k_bound!r}")
    penalties = (counts, prompt_mask, repetition, frequency, presence)
    has_penalties = counts is not None
    if any((tensor is None) == has_penalties for tensor in penalties):
        raise ValueError("counts, prompt_mask, repetition, frequency and presence come together: all five for the "
                         "penalties, none without")
    if has_penalties:
        check_tensor("counts", counts, shape=(None, V), dtype=torch.int32)
        if counts.shape[0] < M:
            raise ValueError(f"counts has shape {list(counts.shape)}: fewer rows than x's {M}")
        check_tensor("prompt_mask", prompt_mask, shape=tuple(counts.shape), dtype=torch.bool)
        for name, tensor in (("repetition", repetition), ("frequency", frequency), ("presence", presence)):
            check_tensor(name, tensor, shape=(M,), dtype=torch.float32, contiguous=True)
    elif slots is not None:
        raise ValueError("slots locate the rows' penalty histories: pass them with the penalties")
    slots, has_slots = check_slots(slots, M, x)
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, shape=(K,), dtype=FLOAT_DTYPES)
    check_same_device(x=x, weight=weight, quantized=screen.quantized, scales=screen.scales, logits=logits,
                      temperature=temperature, top_k=top_k, counts=counts, prompt_mask=prompt_mask,
                      repetition=repetition, frequency=frequency, presence=presence, slots=slots,
                      norm_weight=norm_weight)
    if M == 0:
        return logits
    work = _workspace(x.device, M, V, K)
    screen_rows, screen_columns, check_rows = _tiles(V, K)
    block_x = max(16, triton.next_power_of_2(K))
    history = (counts, counts.stride(0), prompt_mask.view(torch.uint8), prompt_mask.stride(0), repetition, frequency,
               presence) if has_penalties else (x, 0, x, 0, temperature, temperature, temperature)
    _quantize_kernel[(M,)](
        x, x if norm_weight is None else norm_weight, work.normed, work.quantized_x, work.statistics, K, x.stride(0),
        eps,
        HAS_NORM=norm_weight is not None, BLOCK_X=block_x, USE_PDL=pdl, num_warps=screened.row_warps(block_x),
        **launch_options(pdl),
    )
    _screen_top_k_kernel[(triton.cdiv(V, screen_rows), triton.cdiv(M, 16))](
        screen.quantized, screen.scales, screen.residual_bounds, screen.quantized_norms, work.quantized_x,
        work.statistics, logits, logits.stride(0), work.maxima, slots, *history, M, V, K, screen.quantized.stride(0),
        work.groups,
        SINGLE=M == 1, HAS_PENALTIES=has_penalties, HAS_SLOTS=has_slots, BLOCK_V=screen_rows,
        BLOCK_K=screen_columns, GROUP=GROUP, USE_PDL=pdl, num_warps=screened.SCREEN_WARPS,
        num_stages=screened.SCREEN_STAGES, **launch_options(pdl),
    )
    _threshold_kernel[(M,)](
        work.maxima, temperature, top_k, work.threshold, work.candidates, work.groups, V,
        WIDTH=candidate_width(top_k_bound), BLOCK_G=triton.next_power_of_2(work.groups), USE_PDL=pdl,
        num_warps=THRESHOLD_WARPS, **launch_options(pdl),
    )
    _check_top_k_kernel[(triton.cdiv(V, check_rows), M)](
        weight, work.normed, logits, logits.stride(0), work.threshold, work.candidates, slots, *history, V, K,
        weight.stride(0),
        HAS_PENALTIES=has_penalties, HAS_SLOTS=has_slots, BLOCK_R=check_rows, BLOCK_X=block_x, USE_PDL=pdl,
        num_warps=screened.row_warps(block_x), **launch_options(pdl),
    )
    return logits


def top_k_candidate_counts(x: torch.Tensor, vocabulary: int) -> list[int]:
    """The candidates of each row of x in the last call at x's shape (the rows the check read from weight): a
    diagnostic for tests and benchmarks."""
    M, K = x.shape
    key = (x.device, M, vocabulary, K)
    if key not in _workspaces:
        raise ValueError(f"no call at M = {M}, V = {vocabulary}, K = {K} on {x.device} yet")
    return _workspaces[key].candidates.tolist()


__all__ = ["lm_head_screened_top_k", "screened_top_k_bytes", "top_k_candidate_counts"]
