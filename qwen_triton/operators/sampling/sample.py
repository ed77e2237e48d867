"""Token sampling on the device: temperature, min-p, top-k, top-p, then a seeded draw; no sort of the row, no host sync.

logits [M, V] float32 -> ids [M] int64. Per row: temperature T (0 = greedy: argmax, lowest id on ties),
min_p (0 = off), top_k (0 = off), top_p (1.0 = off), a seed and a step (device tensors). The distribution is
the one of qwen_triton/engine/sampling.py: s = logits / T; keep the tokens with s >= max(s) + ln(min_p);
of those, the tokens with s >= the k-th largest s (ties kept); then the smallest set of most likely tokens
whose probability (renormalised over what min-p and top-k kept) reaches top_p (ties at the boundary kept);
draw one token in proportion to exp(s). Every filter is a threshold on the order-preserving integer key of
the float32 s (monotone, so "s >= t" is "key >= key(t)"; -0.0 has +0.0's key: they compare equal), and the draw is the
Gumbel-max trick on the kept tokens: argmax(s + G), G from noise.gumbel_noise keyed by the token id, the
lowest id on an exact tie. Two ways to find the thresholds, both exact, choosing the same ids:

The search (any top_k, top_p): each search pass splits the current key interval [lo, hi) into 63 equal bins
and counts, in one read of the row, how many tokens (and how much unnormalised mass exp(s - max)) fall in
each bin or above hi; the new interval is the bin where the count reaches k (the mass reaches top_p * the
mass top-k kept). 63^6 > 2^32, so 6 passes pin each threshold exactly: 12 search passes at most (top-k
first, then top-p inside what top-k kept). min-p's threshold is known once the row's max is: the stats
kernel starts the search interval there (so top-k counts only what min-p kept; with neither top-k nor top-p
it is the draw's threshold, and the search passes are not needed), and the first top-p pass takes the mass at
or above it as the mass kept. Tiles with no token inside [lo, hi) skip the bin counting, so late passes
cost little more than a read.

The top-k candidates (top_k_bound: every sampled row has 0 < top_k <= top_k_bound <= K_MAX): top-k keeps
few tokens, so every filter and the draw run over a short sorted list of candidates. A candidate is (key, id)
packed in an int64, key << 32 | (2^31 - 1 - id): the larger of two has the larger key, then the lower id (the
order of the greedy and Gumbel-max ties).
  Chunk (one register tile of 4096 tokens): a bound b with at least k tokens at or above it: the k-th largest
  of the maxima of 128 groups of 32 (distinct tokens; by their ranks, a [128, 128] comparison). Every token
  of the chunk's top k, and every token tied with them, has key >= b; those tokens (usually k plus a few)
  are compacted (a prefix sum) into the chunk's K slots, K = next_power_of_2(top_k_bound). When more than K
  qualify (k near K, or ties), the chunk takes its top k by k rounds of max-and-mask instead (and any more
  tied with the k-th, up to K), and counts the tokens it leaves tied with its last.
  Merge (the row's last program, over the chunks x K slots): the same bound from the chunks' maxima (when
  there are at least k chunks), the candidates at or above it compacted (at most 2K, else k rounds over all
  the slots), their K largest in order by their ranks: the row's largest keys, sorted. t = the k-th. Every
  token with key > t is a candidate; the tokens tied with t that no candidate holds (more than K in a
  chunk, or beyond the K largest) are counted, and all share s(t), so their mass is that count * exp(s(t) -
  max(s)).
  Then, over the <= K candidates: min-p's threshold, key(max(s) + ln(min_p)), computed as the stats kernel
  does (kept: key >= max(that, t)); the kept mass at or above each candidate's key (a [K, K] comparison),
  plus the tied mass at t; top-p's threshold is the largest kept key whose mass at or above reaches top_p *
  the mass kept; the draw is the Gumbel-max over the kept candidates, the noise keyed by their ids.
  Only when the final threshold is t and some token tied with t is not a candidate does the row leave its
  threshold to the draw kernel, which then draws over the whole row as the search path does; the other rows'
  draw programs see their row DRAWN and return at once.
The launch list depends only on top_k_bound (known on the host), never on device values, so a CUDA graph
replays it. The paths find the same thresholds and draw with the same noise, so they choose the same ids,
except where a top-p boundary lies within float32 rounding of top_p * the mass kept: the paths sum the
masses in different orders.

K_MAX = 64: Qwen3.5's recommended top_k is 20, and 40 or 50 are common. The width K sets the slots a chunk
compacts into and the merge's sizes (61 x 64 slots at V = 248320, the ranks of 128, a [64, 64] comparison:
one program's registers). For normal logits (torch.randn(248320) * 3, 61 chunks; a PyTorch simulation of
the bounds, five seeds) about 22 tokens a chunk pass its bound at k = 20 and 48 at k = 40, and 22-25 (55-64)
pass the merge's; at k = 50 about a third of the chunks take the rounds, and from k = 62 (more than the 61
chunks) the merge does. Larger top_k use the search.

Kernels, each over a grid (chunks of the vocabulary, rows), each chunk reduced by "the last program":
partial results go to a workspace, an int32 arrival counter per row counts the chunks, and the program
that arrives last combines all chunks in chunk order (deterministic), updates the row's state and resets
the counter (so a CUDA graph can replay the launches):
  search path:  1. stats: max, min and sum of exp(s - max) of the row; the search state for the row's filters.
                2. search (x 12, or 0 with filtering=False): the binned counts, the narrowed interval.
                3. draw: the Gumbel-max (or greedy) choice among kept tokens.
  top-k path:   1. top-k: the chunks' candidates; the merge, the thresholds and the draw (the row DRAWN).
                2. draw: the rows the top-k kernel did not draw (the whole row past its threshold).
Rows with nothing left to search skip the search kernels' work; drawn rows skip the draw kernel's.

Floor: the draw reads the logits once: 4*V bytes per row (V = 248320: 1 MB, ~0.2 us of HBM, the
logits sit in L2), plus ~10 Philox rounds per token. Each search pass reads the row again from L2; in
practice the cost is the 14 launches (a few microseconds each), which is why the engine samples
temperature-only requests inside the LM head (lm_head_argmax(temperature=...)) and greedy ones there too.
The top-k path reads the row once (4*V bytes) and computes noise for <= K candidates, not V tokens. Its
work is a fixed number of passes over a chunk's registers (pack, group maxima, count, prefix sum: about 20
integer operations a token, no per-k rounds) and, in the row's last program, one over the chunks x K slots,
the ranks of 2K and the [K, K] mass comparison: 122 registers a thread at 8 warps, no spills (K = 64, sm_90:
triton.compile for GPUTarget("cuda", 90, 32), then cuobjdump --dump-resource-usage). Estimated for the H200,
not yet measured (`qwen-triton bench --ops` times benchmark_cases below): ~2-3 us for the chunks and ~2 us
for the merge at batch 1, a few more at batch 16 (976 chunk programs, 2 resident a SM), ~2 us for the draw
launch whose programs all return; a round of max-and-mask, where one runs, ~0.3 us (10 integer operations
for each of 4096 slots).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_same_device, check_tensor, interpreting, sm_count
from .noise import check_noise_keys, gumbel_noise

TOP_K = tl.constexpr(0)
TOP_P = tl.constexpr(1)
DONE = tl.constexpr(2)  # the threshold found: the draw kernel draws
DRAWN = tl.constexpr(3)  # the top-k kernel drew the row: the draw kernel skips it
BINS = tl.constexpr(63)  # bins of [lo, hi) per pass; slot 63 counts the tokens at or above hi
SLOTS = tl.constexpr(64)
PASSES_PER_FILTER = 6  # 63**6 > 2**32: enough to pin a threshold in the 32-bit key space
# state_int [M, 4]: the interval [lo, hi) of keys, the phase, and the key just above the row's max
LO, HI, PHASE, KEY_END = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
# state_float [M, 4]: the row's max of s, sum of exp(s - max), the mass at or above lo, the top-p target
S_MAX, S_SUM, MASS_LO, TARGET = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)

INT32_MAX = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)
K_MAX = 64  # the largest top_k of the candidate path (the module docstring says why)
# a candidate: key << 32 | (INT32_MAX - id), so the larger of two is the larger key, then the lower id;
# EMPTY (key INT32_MIN, id INT32_MAX) is below every token's
EMPTY = tl.constexpr(-9223372036854775808)


@triton.jit
def _key32(s):
    """An int32 key of float32 s with the order of s: s >= t exactly when key(s) >= key(t) (NaN aside), so -0.0 has
    +0.0's key (a tie, as the float comparison has it, whichever zero a maximum returns)."""
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == INT32_MIN, 0, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key(s):
    """An int64 key of float32 s with the order of s (_key32)."""
    return _key32(s).to(tl.int64)


@triton.jit
def _unkey(key):
    """The float32 s of an int32 key (_key32's inverse; +0.0 for a zero)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _scaled(logits_row, offs, mask, scale):
    return tl.load(logits_row + offs, mask=mask, other=float("-inf")) / scale


@triton.jit
def _settle(phase, lo, hi, key_end, mass_lo, top_p, target):
    """The next phase once an interval is pinned: top-k done -> top-p inside it (or done); top-p done -> done."""
    k_done = (phase == TOP_K) & (hi - lo <= 1)
    phase = tl.where(k_done, tl.where(top_p < 1.0, TOP_P, DONE), phase)
    hi = tl.where(k_done, key_end, hi)
    target = tl.where(k_done, top_p * mass_lo, target)
    phase = tl.where((phase == TOP_P) & (hi - lo <= 1), DONE, phase)
    return phase, hi, target


@triton.jit
def _arrive(counter_ptr, row, NUM_CHUNKS):
    """True in the last of the row's programs to arrive (after every program's stores are released)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
    return arrived == NUM_CHUNKS - 1


@triton.jit
def _stats_kernel(
    logits_ptr, stride_lm, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    chunk_ptr, state_int_ptr, state_float_ptr, counter_ptr,
    V, CHUNK, NUM_CHUNKS,
    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr, HAS_MIN_P: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    scale = tl.where(temperature > 0, temperature, 1.0)
    logits_row = logits_ptr + row.to(tl.int64) * stride_lm
    start = chunk * CHUNK
    high = tl.full([BLOCK_V], -3.4e38, dtype=tl.float32)  # finite: exp(high - new_high) stays defined
    low = tl.full([BLOCK_V], float("inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_V], dtype=tl.float32)
    for v0 in range(start, tl.minimum(start + CHUNK, V), BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        s = _scaled(logits_row, offs, mask, scale)
        new_high = tl.maximum(high, s)
        total = total * tl.exp(high - new_high) + tl.exp(s - new_high)
        high = new_high
        low = tl.minimum(low, tl.where(mask, s, float("inf")))
    chunk_high = tl.max(high, axis=0)
    slot = chunk_ptr + (row * NUM_CHUNKS + chunk) * 3
    tl.store(slot, chunk_high)
    tl.store(slot + 1, tl.sum(total * tl.exp(high - chunk_high), axis=0))
    tl.store(slot + 2, tl.min(low, axis=0))
    if _arrive(counter_ptr, row, NUM_CHUNKS):
        offs_p = tl.arange(0, BLOCK_P)
        p_mask = offs_p < NUM_CHUNKS
        slots = chunk_ptr + (row * NUM_CHUNKS + offs_p) * 3
        highs = tl.load(slots, mask=p_mask, other=-3.4e38, cache_modifier=".cg")
        totals = tl.load(slots + 1, mask=p_mask, other=0.0, cache_modifier=".cg")
        lows = tl.load(slots + 2, mask=p_mask, other=float("inf"), cache_modifier=".cg")
        s_max = tl.max(highs, axis=0)
        s_sum = tl.sum(totals * tl.exp(highs - s_max), axis=0)
        lo = _key(tl.min(lows, axis=0))
        key_end = _key(s_max) + 1
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        phase = tl.where((top_k > 0) & (top_k < V), TOP_K, tl.where(top_p < 1.0, TOP_P, DONE))
        phase = tl.where(temperature > 0, phase, DONE)
        # the whole row is at or above lo: its mass is s_sum; min-p raises lo, and the mass at or above the new lo
        # is then unknown (-1: the first top-p pass counts it)
        mass_lo = s_sum
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row)
            floor = _key((s_max + tl.log(tl.maximum(min_p, 1e-38))).to(tl.float32))
            cut = (min_p > 0) & (temperature > 0) & (floor > lo)
            lo = tl.where(cut, floor, lo)
            mass_lo = tl.where(cut, -1.0, s_sum)
        phase, hi, target = _settle(phase, lo, key_end, key_end, mass_lo, top_p, top_p * mass_lo)
        state_int = state_int_ptr + row * 4
        tl.store(state_int + LO, lo)
        tl.store(state_int + HI, hi)
        tl.store(state_int + PHASE, phase.to(tl.int64))
        tl.store(state_int + KEY_END, key_end)
        state_float = state_float_ptr + row * 4
        tl.store(state_float + S_MAX, s_max)
        tl.store(state_float + S_SUM, s_sum)
        tl.store(state_float + MASS_LO, s_sum)
        tl.store(state_float + TARGET, target)
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _search_kernel(
    logits_ptr, stride_lm, temperature_ptr, top_k_ptr, top_p_ptr,
    count_ptr, mass_ptr, state_int_ptr, state_float_ptr, counter_ptr,
    V, CHUNK, NUM_CHUNKS,
    BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    state_int = state_int_ptr + row * 4
    state_float = state_float_ptr + row * 4
    phase = tl.load(state_int + PHASE)
    if phase != DONE:
        lo = tl.load(state_int + LO)
        hi = tl.load(state_int + HI)
        width = hi - lo
        s_max = tl.load(state_float + S_MAX)
        temperature = tl.load(temperature_ptr + row)
        scale = tl.where(temperature > 0, temperature, 1.0)
        logits_row = logits_ptr + row.to(tl.int64) * stride_lm
        slots = tl.arange(0, SLOTS)
        counts = tl.zeros([SLOTS], dtype=tl.int32)
        masses = tl.zeros([SLOTS], dtype=tl.float32)
        start = chunk * CHUNK
        for v0 in range(start, tl.minimum(start + CHUNK, V), BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < V
            s = _scaled(logits_row, offs, mask, scale)
            key = _key(s)
            inside = tl.where(key >= lo, key - lo, 0)
            bin = tl.where(key >= hi, BINS, tl.where(key >= lo, (inside * BINS) // width, -1))
            bin = tl.where(mask, bin, -1)
            if tl.max(bin, axis=0) >= 0:
                hit = bin[:, None] == slots[None, :]
                counts += tl.sum(hit.to(tl.int32), axis=0)
                masses += tl.sum(tl.where(hit, tl.exp(s - s_max)[:, None], 0.0), axis=0)
        partial = (row * NUM_CHUNKS + chunk) * SLOTS + slots
        tl.store(count_ptr + partial, counts)
        tl.store(mass_ptr + partial, masses)
        if _arrive(counter_ptr, row, NUM_CHUNKS):
            offs_p = tl.arange(0, BLOCK_P)
            partials = (row * NUM_CHUNKS + offs_p)[:, None] * SLOTS + slots[None, :]
            p_mask = (offs_p < NUM_CHUNKS)[:, None]
            count = tl.sum(tl.load(count_ptr + partials, mask=p_mask, other=0, cache_modifier=".cg"), axis=0)
            mass = tl.sum(tl.load(mass_ptr + partials, mask=p_mask, other=0.0, cache_modifier=".cg"), axis=0)
            # at_or_above[j] = tokens (mass) with key >= pivot j = lo + ceil(j * width / BINS)
            later = slots[None, :] >= slots[:, None]
            at_or_above_count = tl.sum(tl.where(later, count[None, :], 0), axis=1)
            at_or_above_mass = tl.sum(tl.where(later, mass[None, :], 0.0), axis=1)
            top_k = tl.load(top_k_ptr + row)
            top_p = tl.load(top_p_ptr + row)
            target = tl.load(state_float + TARGET)
            # negative: min-p raised lo in the stats kernel; the mass kept is the mass at or above lo
            target = tl.where(target < 0, top_p * tl.sum(mass, axis=0), target)
            meets = tl.where(phase == TOP_K, at_or_above_count >= top_k, at_or_above_mass >= target)
            # the last pivot meeting the target; pivot 0 (lo) meets it by construction, but for top-k inside a
            # min-p cut that kept fewer than k tokens, when none does and lo stays
            best = tl.max(tl.where(meets & (slots < BINS), slots, 0), axis=0).to(tl.int64)
            new_lo = lo + (best * width + BINS - 1) // BINS
            new_hi = lo + ((best + 1) * width + BINS - 1) // BINS
            mass_lo = tl.sum(tl.where(slots == best, at_or_above_mass, 0.0), axis=0)
            key_end = tl.load(state_int + KEY_END)
            phase, new_hi, target = _settle(phase, new_lo, new_hi, key_end, mass_lo, top_p, target)
            tl.store(state_int + LO, new_lo)
            tl.store(state_int + HI, new_hi)
            tl.store(state_int + PHASE, phase.to(tl.int64))
            tl.store(state_float + MASS_LO, mass_lo)
            tl.store(state_float + TARGET, target)
            tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _seed_and_stream(seed_ptr, row, SEED_PER_ROW: tl.constexpr):
    if SEED_PER_ROW:
        return tl.load(seed_ptr + row), row * 0
    return tl.load(seed_ptr), row  # one seed for the batch: rows draw from their own streams


@triton.jit
def _take_largest(packed, rounds, K: tl.constexpr):
    """The `rounds` largest of the packed candidates, largest first, then those tied in key with the last of them,
    at most K in all, by rounds of max-and-mask: (the taken [K], padded with EMPTY; what is left of packed; the
    key of the last taken)."""
    slots = tl.arange(0, K)
    taken = tl.full([K], EMPTY, dtype=tl.int64)
    count = 0
    best = tl.max(packed, axis=0)
    last = best
    more = best != EMPTY
    while more:
        taken = tl.where(slots == count, best, taken)
        packed = tl.where(packed == best, EMPTY, packed)  # a candidate is unique: its id is in it
        count += 1
        last = best
        best = tl.max(packed, axis=0)
        more = (count < K) & (best != EMPTY) & ((count < rounds) | ((best >> 32) == (last >> 32)))
    return taken, packed, (last >> 32).to(tl.int32)


@triton.jit
def _bound(maxima, rounds, GROUPS: tl.constexpr):
    """The key of the rounds-th largest of the packed maxima [GROUPS] of disjoint groups of candidates (INT32_MIN
    when fewer than `rounds` are candidates): at least `rounds` candidates have a key at or above it, so the
    rounds-th largest key of them all is too. By ranks (how many maxima are larger), not by rounds."""
    above = tl.sum((maxima[None, :] > maxima[:, None]).to(tl.int32), axis=1)
    return (tl.max(tl.where(above >= rounds - 1, maxima, EMPTY), axis=0) >> 32).to(tl.int32)


@triton.jit
def _compact(packed, selected, scratch_ptr):
    """Store the selected entries of packed at scratch_ptr[0, 1, ...], in order: their number."""
    position = tl.cumsum(selected.to(tl.int32), axis=0) - 1
    tl.store(scratch_ptr + position, packed, mask=selected)
    return tl.sum(selected.to(tl.int32), axis=0)


@triton.jit
def top_k_rounds(sampling, top_k, V, K: tl.constexpr):
    """A row's k on the top-k path at candidate width K: its top_k, at most V and K; 1 for a greedy row, which needs
    the argmax alone (top_k >= V keeps every token, as top-k off does)."""
    rounds = tl.where(sampling, tl.minimum(top_k, V), 1)
    return tl.minimum(tl.maximum(rounds, 1), K)


@triton.jit
def _top_k_kernel(
    logits_ptr, stride_lm, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr,
    candidate_ptr, tie_ptr, merge_ptr, state_int_ptr, counter_ptr, out_ptr,
    V, NUM_CHUNKS,
    K: tl.constexpr, BLOCK_V: tl.constexpr, GROUPS: tl.constexpr, BLOCK_P: tl.constexpr, MERGE: tl.constexpr,
    RANK_BLOCK: tl.constexpr, HAS_MIN_P: tl.constexpr, SEED_PER_ROW: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    sampling = temperature > 0
    scale = tl.where(sampling, temperature, 1.0)
    rounds = top_k_rounds(sampling, tl.load(top_k_ptr + row), V, K)
    offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = offs < V
    s = tl.load(logits_ptr + row.to(tl.int64) * stride_lm + offs, mask=mask, other=0.0) / scale
    packed = (_key32(s).to(tl.int64) << 32) | (-offs + INT32_MAX).to(tl.int64)
    packed = tl.where(mask & (s == s), packed, EMPTY)  # (NaN is never kept)
    # the chunk's candidates: every token with a key at or above the bound of its GROUPS group maxima (a superset
    # of its top k and their ties, usually a few more than k), when they fit in the K slots; else its top k by rounds
    bound = _bound(tl.max(tl.reshape(packed, [GROUPS, BLOCK_V // GROUPS]), axis=1), rounds, GROUPS)
    selected = ((packed >> 32).to(tl.int32) >= bound) & (packed != EMPTY)
    slots = tl.arange(0, K)
    cell = row * NUM_CHUNKS + chunk
    if tl.sum(selected.to(tl.int32), axis=0) <= K:
        count = _compact(packed, selected, candidate_ptr + cell * K)
        tl.store(candidate_ptr + cell * K + slots, EMPTY, mask=slots >= count)
        tl.store(tie_ptr + cell * 2, INT32_MIN)
        tl.store(tie_ptr + cell * 2 + 1, 0)
    else:
        taken, rest, last_key = _take_largest(packed, rounds, K)
        tl.store(candidate_ptr + cell * K + slots, taken)
        # tokens tied with the last taken that did not fit in the K slots
        tl.store(tie_ptr + cell * 2, last_key)
        tl.store(tie_ptr + cell * 2 + 1,
                 tl.sum((((rest >> 32).to(tl.int32) == last_key) & (rest != EMPTY)).to(tl.int32), axis=0))
    if _arrive(counter_ptr, row, NUM_CHUNKS):
        offs_pool = tl.arange(0, BLOCK_P * K)
        pool = tl.load(candidate_ptr + row * NUM_CHUNKS * K + offs_pool, mask=offs_pool < NUM_CHUNKS * K, other=EMPTY,
                       cache_modifier=".cg")
        # the same bound from the chunks' maxima; the row's candidates above it compacted, then their K largest, sorted
        merge_bound = _bound(tl.max(tl.reshape(pool, [BLOCK_P, K]), axis=1), rounds, BLOCK_P)
        above_bound = ((pool >> 32).to(tl.int32) >= merge_bound) & (pool != EMPTY)
        if tl.sum(above_bound.to(tl.int32), axis=0) <= MERGE:
            scratch = merge_ptr + row * (MERGE + K)  # MERGE compacted candidates, then the K largest in order
            merge_count = _compact(pool, above_bound, scratch)
            tl.debug_barrier()  # what all the program's threads stored, read back
            offs_merge = tl.arange(0, MERGE)
            compact = tl.load(scratch + offs_merge, mask=offs_merge < merge_count, other=EMPTY, cache_modifier=".cg")
            # each one's rank (how many are larger), against RANK_BLOCK of them at a time; stored at its rank
            rank = tl.zeros([MERGE], dtype=tl.int32)
            for start in tl.static_range(0, MERGE, RANK_BLOCK):
                offs_other = start + tl.arange(0, RANK_BLOCK)
                others = tl.load(scratch + offs_other, mask=offs_other < merge_count, other=EMPTY,
                                 cache_modifier=".cg")
                rank += tl.sum((others[None, :] > compact[:, None]).to(tl.int32), axis=1)
            tl.store(scratch + MERGE + rank, compact, mask=rank < K)
            tl.debug_barrier()
            merged = tl.load(scratch + MERGE + slots, mask=slots < merge_count, other=EMPTY, cache_modifier=".cg")
            kth = tl.max(tl.where(slots == rounds - 1, (merged >> 32).to(tl.int32), INT32_MIN), axis=0)
            missing = (tl.sum((((compact >> 32).to(tl.int32) == kth) & (compact != EMPTY)).to(tl.int32), axis=0)
                       - tl.sum((((merged >> 32).to(tl.int32) == kth) & (merged != EMPTY)).to(tl.int32), axis=0))
        else:
            merged, unmerged, _ = _take_largest(pool, rounds, K)
            kth = tl.max(tl.where(slots == rounds - 1, (merged >> 32).to(tl.int32), INT32_MIN), axis=0)
            missing = tl.sum((((unmerged >> 32).to(tl.int32) == kth) & (unmerged != EMPTY)).to(tl.int32), axis=0)
        # merged: the row's largest keys, sorted; kth = t, the k-th largest key
        keys = (merged >> 32).to(tl.int32)
        tokens = -(merged & 0xFFFFFFFF) + INT32_MAX
        values = _unkey(keys)
        s_max = tl.max(tl.where(slots == 0, values, float("-inf")), axis=0)
        # tokens tied with t that no candidate holds: left out of the merge (missing, above), or in a chunk
        offs_p = tl.arange(0, BLOCK_P)
        p_mask = offs_p < NUM_CHUNKS
        chunk_last = tl.load(tie_ptr + (row * NUM_CHUNKS + offs_p) * 2, mask=p_mask, other=INT32_MIN,
                             cache_modifier=".cg")
        chunk_left = tl.load(tie_ptr + (row * NUM_CHUNKS + offs_p) * 2 + 1, mask=p_mask, other=0,
                             cache_modifier=".cg")
        missing += tl.sum(tl.where(chunk_last == kth, chunk_left, 0), axis=0)
        threshold = kth
        if HAS_MIN_P:
            min_p = tl.load(min_p_ptr + row)
            floor = _key32((s_max + tl.log(tl.maximum(min_p, 1e-38))).to(tl.float32))
            threshold = tl.where((min_p > 0) & sampling & (floor > kth), floor, kth)
        kept = (merged != EMPTY) & (keys >= threshold)
        mass = tl.where(kept, tl.exp(values - s_max), 0.0)
        tied_mass = tl.where(threshold == kth, missing, 0).to(tl.float32) * tl.exp(_unkey(kth) - s_max)
        # top-p: the largest kept key whose mass at or above (a tie at t counting the missing ones) reaches its target
        at_or_above = (tl.sum(tl.where(keys[None, :] >= keys[:, None], mass[None, :], 0.0), axis=1)
                       + tl.where(keys == kth, tied_mass, 0.0))
        top_p = tl.load(top_p_ptr + row)
        target = top_p * (tl.sum(mass, axis=0) + tied_mass)
        nucleus = tl.max(tl.where(kept & (at_or_above >= target), keys, threshold), axis=0)
        threshold = tl.where(sampling & (top_p < 1.0), nucleus, threshold)
        seed, stream = _seed_and_stream(seed_ptr, row, SEED_PER_ROW)
        step = tl.load(step_ptr + row)
        noisy = tl.where(kept & (keys >= threshold), values + gumbel_noise(seed, step, stream, tokens), float("-inf"))
        score = tl.where(sampling, noisy, tl.where(slots == 0, values, float("-inf")))
        top = tl.max(score, axis=0)
        token = tl.min(tl.where((score == top) & (score > float("-inf")), tokens, INT32_MAX), axis=0)
        # a kept token outside the candidates: the draw kernel draws over the whole row past the threshold
        drawn = ~(sampling & (threshold == kth) & (missing > 0))
        tl.store(out_ptr + row, tl.minimum(token, V - 1).to(tl.int64), mask=drawn)
        state_int = state_int_ptr + row * 4
        tl.store(state_int + LO, threshold.to(tl.int64))
        tl.store(state_int + PHASE, tl.where(drawn, DRAWN, DONE).to(tl.int64))
        tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


@triton.jit
def _draw_kernel(
    logits_ptr, stride_lm, temperature_ptr, seed_ptr, step_ptr,
    best_value_ptr, best_index_ptr, state_int_ptr, counter_ptr, out_ptr,
    V, CHUNK, NUM_CHUNKS,
    SEED_PER_ROW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    # a row the top-k kernel drew is done (the stats kernel never leaves a row DRAWN)
    if tl.load(state_int_ptr + row * 4 + PHASE) != DRAWN:
        temperature = tl.load(temperature_ptr + row)
        sampling = temperature > 0
        scale = tl.where(sampling, temperature, 1.0)
        threshold = tl.load(state_int_ptr + row * 4 + LO)
        seed, stream = _seed_and_stream(seed_ptr, row, SEED_PER_ROW)
        step = tl.load(step_ptr + row)
        logits_row = logits_ptr + row.to(tl.int64) * stride_lm
        best = tl.full([BLOCK_V], float("-inf"), dtype=tl.float32)
        best_index = tl.full([BLOCK_V], INT32_MAX, dtype=tl.int32)
        start = chunk * CHUNK
        for v0 in range(start, tl.minimum(start + CHUNK, V), BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            mask = offs < V
            logit = tl.load(logits_row + offs, mask=mask, other=float("-inf"))
            s = logit / scale
            noisy = tl.where(_key(s) >= threshold, s + gumbel_noise(seed, step, stream, offs), float("-inf"))
            score = tl.where(mask, tl.where(sampling, noisy, logit), float("-inf"))
            better = score > best  # strict: the earlier token keeps a tie
            best = tl.where(better, score, best)
            best_index = tl.where(better, offs, best_index)
        chunk_best = tl.max(best, axis=0)
        slot = row * NUM_CHUNKS + chunk
        tl.store(best_value_ptr + slot, chunk_best)
        tl.store(best_index_ptr + slot, tl.min(tl.where(best == chunk_best, best_index, INT32_MAX), axis=0))
        if _arrive(counter_ptr, row, NUM_CHUNKS):
            offs_p = tl.arange(0, BLOCK_P)
            p_mask = offs_p < NUM_CHUNKS
            values = tl.load(best_value_ptr + row * NUM_CHUNKS + offs_p, mask=p_mask, other=float("-inf"),
                             cache_modifier=".cg")
            indices = tl.load(best_index_ptr + row * NUM_CHUNKS + offs_p, mask=p_mask, other=INT32_MAX,
                              cache_modifier=".cg")
            top = tl.max(values, axis=0)
            token = tl.min(tl.where(values == top, indices, INT32_MAX), axis=0)
            tl.store(out_ptr + row, tl.minimum(token, V - 1).to(tl.int64))
            tl.atomic_xchg(counter_ptr + row, 0, sem="relaxed", scope="gpu")


# Chunking is set by hand rather than autotuned: it shapes the workspace and the reduction.
# GPU: tiles of 256 tokens, about 64 chunks of a 248320-token row (4096 tokens each; fewer per row when
# many rows share the GPU); the interpreter: tiny tiles, so the CPU tests still cross chunks.
BLOCK_V = 16 if interpreting() else 256
SEARCH_BLOCK_V = 16 if interpreting() else 128  # the bin counting holds a [tile, 64] comparison
TARGET_CHUNKS = 4 if interpreting() else 64
NUM_WARPS = 4
# The interpreter pays per operation, each a numpy call over a whole tile: a row of more than
# INTERPRETER_WIDE_V tokens (a real vocabulary) gets tiles there that cover a chunk in INTERPRETER_STEPS
# steps (248320 tokens: 4 chunks of 4 tiles of 16384, against 15520 tiles of 16), the bin counting's
# [tile, 64] comparison at most INTERPRETER_SEARCH_BLOCK_V rows. The tests' small rows keep the tiny tiles.
INTERPRETER_WIDE_V = 4096
INTERPRETER_STEPS = 4
INTERPRETER_SEARCH_BLOCK_V = 4096
# The top-k kernel's chunk is one register tile (compacted, or masked by the rounds): on the GPU a power of two
# near V / chunks, at most 4096 tokens (16 int64 a thread at 8 warps; 61 chunks of 248320 at batch 1 and 16);
# the interpreter: the draw's tiny tiles (V = 40: 3 chunks of 16), or a quarter of a long row.
TOP_K_BLOCK_MIN, TOP_K_BLOCK_MAX = 256, 4096
TOP_K_WARPS = 8
GROUPS = 128  # group maxima of a chunk's tile, for its bound (32 tokens a group in a 4096-token tile)
MERGE_PER_WIDTH = 2  # the merge sorts at most 2K candidates above its bound, by their ranks
RANK_BLOCK = 32  # candidates compared at a time for the ranks ([2K, 32] comparisons, not [2K, 2K]: registers)


def _tiles(V: int) -> tuple[int, int]:
    """(BLOCK_V, SEARCH_BLOCK_V) of a row of V tokens: the module's, but wide ones for a long row under the
    interpreter (powers of two, the search's no wider than the draw's: a chunk is a multiple of both)."""
    if interpreting() and V > INTERPRETER_WIDE_V:
        block = triton.next_power_of_2(triton.cdiv(V, TARGET_CHUNKS * INTERPRETER_STEPS))
        return block, min(block, INTERPRETER_SEARCH_BLOCK_V)
    return BLOCK_V, SEARCH_BLOCK_V


def _top_k_tile(V: int, chunks: int) -> int:
    """The top-k kernel's tile (= chunk) of a row of V tokens split in about `chunks` chunks."""
    if interpreting():
        return triton.next_power_of_2(triton.cdiv(V, TARGET_CHUNKS)) if V > INTERPRETER_WIDE_V else BLOCK_V
    return min(TOP_K_BLOCK_MAX, max(TOP_K_BLOCK_MIN, triton.next_power_of_2(triton.cdiv(V, chunks))))


_workspaces: dict[tuple, dict] = {}


def _workspace(device: torch.device, M: int, V: int) -> dict:
    key = (device, M, V)
    if key not in _workspaces:
        chunks = TARGET_CHUNKS
        if device.type == "cuda":  # by the power of two at or above M: the few geometries (constexprs) that
            # the decode buckets compile serve every row count up to them, a first token's for any number of prompts
            chunks = max(1, min(TARGET_CHUNKS, triton.cdiv(4 * sm_count(device), triton.next_power_of_2(M))))
        block_v = _tiles(V)[0]
        chunk = triton.cdiv(triton.cdiv(V, chunks), block_v) * block_v
        num_chunks = triton.cdiv(V, chunk)
        top_k_block = _top_k_tile(V, chunks)
        top_k_chunks = triton.cdiv(V, top_k_block)

        def floats(*shape):
            return torch.empty(*shape, dtype=torch.float32, device=device)

        _workspaces[key] = dict(
            chunk=chunk, num_chunks=num_chunks, block_p=triton.next_power_of_2(num_chunks),
            top_k_block=top_k_block, top_k_chunks=top_k_chunks, top_k_block_p=triton.next_power_of_2(top_k_chunks),
            candidates=torch.empty(M, top_k_chunks, K_MAX, dtype=torch.int64, device=device),
            chunk_ties=torch.empty(M, top_k_chunks, 2, dtype=torch.int32, device=device),
            merge=torch.empty(M, (MERGE_PER_WIDTH + 1) * K_MAX, dtype=torch.int64, device=device),
            chunk_stats=floats(M, num_chunks, 3),
            count=torch.empty(M, num_chunks, 64, dtype=torch.int32, device=device),
            mass=floats(M, num_chunks, 64),
            best_value=floats(M, num_chunks),
            best_index=torch.empty(M, num_chunks, dtype=torch.int32, device=device),
            state_int=torch.zeros(M, 4, dtype=torch.int64, device=device),
            state_float=torch.zeros(M, 4, dtype=torch.float32, device=device),
            counters=torch.zeros(M, dtype=torch.int32, device=device),
        )
    return _workspaces[key]


def candidate_width(top_k_bound: int) -> int:
    """K, the top-k path's candidate slots a chunk for rows of top_k <= top_k_bound."""
    return max(2, triton.next_power_of_2(top_k_bound))


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    filtering: bool = True,
    min_p: torch.Tensor | None = None,
    top_k_bound: int | None = None,
) -> torch.Tensor:
    """One token id per row of logits [M, V] (float32, rows may be strided): int64 [M].

    temperature float32 [M] (0 = greedy); top_k int32 [M] (0 = off); top_p float32 [M] (1.0 = off);
    seed int64 [1] (one seed for the batch, rows draw from separate streams) or [M] (a seed per row);
    step int64 [M] (a draw is a pure function of seed, step, the logits and, with one shared seed, the
    row). filtering=False skips the 12 top-k/top-p search launches: only when every row has top_k 0
    and top_p 1.0 (the caller knows this on the host; nothing is read from the device here).
    min_p float32 [M] (0 = off; None: off for every row) needs no search pass.
    top_k_bound (1 to K_MAX): the top-k candidate path, two launches instead of 14, the same ids; only when
    every sampled row (temperature > 0) has 1 <= top_k <= top_k_bound (greedy rows may have any top_k; a
    larger one acts as the candidate width, K = next_power_of_2(top_k_bound)). A compiled variant per width.
    """
    check_tensor("logits", logits, shape=(None, None), dtype=torch.float32)
    M, V = logits.shape
    check_tensor("temperature", temperature, shape=(M,), dtype=torch.float32)
    check_tensor("top_k", top_k, shape=(M,), dtype=torch.int32)
    check_tensor("top_p", top_p, shape=(M,), dtype=torch.float32)
    if min_p is not None:
        check_tensor("min_p", min_p, shape=(M,), dtype=torch.float32)
    check_noise_keys(seed, step, M)
    if out is None:
        out = torch.empty(M, dtype=torch.int64, device=logits.device)
    else:
        check_tensor("out", out, shape=(M,), dtype=torch.int64)
    check_same_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, step=step, out=out,
                      min_p=min_p)
    if V == 0 or V >= 2**31:
        raise ValueError(f"logits has {V} columns, expected 1 to 2**31 - 1")
    if top_k_bound is not None and (isinstance(top_k_bound, bool) or not isinstance(top_k_bound, int)
                                    or not 1 <= top_k_bound <= K_MAX):
        raise ValueError(f"top_k_bound must be an int from 1 to {K_MAX}, got {top_k_bound!r}")
    if top_k_bound is not None and not filtering:
        raise ValueError("top_k_bound is a filtering path: pass filtering=True (the default) with it")
    if M == 0:
        return out
    work = _workspace(logits.device, M, V)
    block_v, search_block_v = _tiles(V)
    grid = (work["num_chunks"], M)
    geometry = dict(V=V, CHUNK=work["chunk"], NUM_CHUNKS=work["num_chunks"])
    seed_per_row = seed.shape[0] == M and M > 1
    if top_k_bound is not None:
        width = candidate_width(top_k_bound)
        _top_k_kernel[(work["top_k_chunks"], M)](
            logits, logits.stride(0), temperature, top_k, top_p, top_p if min_p is None else min_p, seed, step,
            work["candidates"], work["chunk_ties"], work["merge"], work["state_int"], work["counters"], out,
            V, work["top_k_chunks"], K=width, BLOCK_V=work["top_k_block"], GROUPS=min(GROUPS, work["top_k_block"]),
            BLOCK_P=work["top_k_block_p"], MERGE=MERGE_PER_WIDTH * width,
            RANK_BLOCK=min(RANK_BLOCK, MERGE_PER_WIDTH * width), HAS_MIN_P=min_p is not None,
            SEED_PER_ROW=seed_per_row, num_warps=TOP_K_WARPS,
        )
        _draw(logits, temperature, seed, step, out, work, grid, geometry, block_v, seed_per_row)
        return out
    _stats_kernel[grid](
        logits, logits.stride(0), temperature, top_k, top_p, top_p if min_p is None else min_p,
        work["chunk_stats"], work["state_int"], work["state_float"], work["counters"],
        **geometry, BLOCK_V=block_v, BLOCK_P=work["block_p"], HAS_MIN_P=min_p is not None, num_warps=NUM_WARPS,
    )
    if filtering:
        for _ in range(2 * PASSES_PER_FILTER):
            _search_kernel[grid](
                logits, logits.stride(0), temperature, top_k, top_p,
                work["count"], work["mass"], work["state_int"], work["state_float"], work["counters"],
                **geometry, BLOCK_V=search_block_v, BLOCK_P=work["block_p"], num_warps=NUM_WARPS,
            )
    _draw(logits, temperature, seed, step, out, work, grid, geometry, block_v, seed_per_row)
    return out


def _draw(logits, temperature, seed, step, out, work, grid, geometry, block_v, seed_per_row) -> None:
    _draw_kernel[grid](
        logits, logits.stride(0), temperature, seed, step,
        work["best_value"], work["best_index"], work["state_int"], work["counters"], out,
        **geometry, SEED_PER_ROW=seed_per_row, BLOCK_V=block_v, BLOCK_P=work["block_p"], num_warps=NUM_WARPS,
    )


def benchmark_cases(device="cuda") -> list[dict]:
    """Sampling a 248320-token row (Qwen3.5-0.8B) at batch 1: top-k + top-p by the search, and temperature only;
    Qwen3.5's recommended top_k 20, top_p 0.8 (temperature 0.7) by the top-k candidates, at batch 1 and 16, at
    the engine's candidate width (K_MAX)."""
    vocab = 248320
    logits = torch.randn(1, vocab, device=device) * 3
    temperature = torch.full((1,), 0.8, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(1, dtype=torch.int64, device=device)
    filtered = (torch.full((1,), 50, dtype=torch.int32, device=device), torch.full((1,), 0.9, device=device))
    plain = (torch.zeros(1, dtype=torch.int32, device=device), torch.ones(1, device=device))

    def recommended(rows):
        batch = dict(logits=torch.randn(rows, vocab, device=device) * 3,
                     temperature=torch.full((rows,), 0.7, device=device),
                     top_k=torch.full((rows,), 20, dtype=torch.int32, device=device),
                     top_p=torch.full((rows,), 0.8, device=device), seed=seed,
                     step=torch.arange(rows, device=device), out=torch.empty(rows, dtype=torch.int64, device=device))
        return dict(name=f"sample top_k=20 top_p=0.8 candidates M={rows} V={vocab}",
                    fn=lambda: sample(**batch, top_k_bound=K_MAX), bytes=rows * 4 * vocab, flops=0)

    return [
        dict(name=f"sample top_k=50 top_p=0.9 V={vocab}",
             fn=lambda: sample(logits, temperature, *filtered, seed, step, out),
             bytes=(2 + 2 * PASSES_PER_FILTER) * 4 * vocab, flops=0),
        dict(name=f"sample temperature-only V={vocab}",
             fn=lambda: sample(logits, temperature, *plain, seed, step, out, filtering=False),
             bytes=2 * 4 * vocab, flops=0),
        recommended(1),
        recommended(16),
    ]
