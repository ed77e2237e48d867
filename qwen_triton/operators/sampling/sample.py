"""Token sampling on the device: temperature, min-p, top-k, top-p, then a seeded draw; no sort, no host sync.

logits [M, V] float32 -> ids [M] int64. Per row: temperature T (0 = greedy: argmax, lowest id on ties),
min_p (0 = off), top_k (0 = off), top_p (1.0 = off), a seed and a step (device tensors). The distribution is
the one of qwen_triton/engine/sampling.py: s = logits / T; keep the tokens with s >= max(s) + ln(min_p);
of those, the tokens with s >= the k-th largest s (ties kept); then the smallest set of most likely tokens
whose probability (renormalised over what min-p and top-k kept) reaches top_p (ties at the boundary kept);
draw one token in proportion to exp(s).

How, without sorting: both filters are thresholds on s, found by a search over the order-preserving
integer key of the float32 s (monotone, so "s >= t" is "key >= key(t)"). Each search pass splits the
current key interval [lo, hi) into 63 equal bins and counts, in one read of the row, how many tokens
(and how much unnormalised mass exp(s - max)) fall in each bin or above hi; the new interval is the bin
where the count reaches k (the mass reaches top_p * the mass top-k kept). 63^6 > 2^32, so 6 passes pin
each threshold exactly: 12 search passes at most (top-k first, then top-p inside what top-k kept).
min-p's threshold is known once the row's max is: the stats kernel starts the search interval there (so
top-k counts only what min-p kept; with neither top-k nor top-p it is the draw's threshold, and the search
passes are not needed), and the first top-p pass takes the mass at or above it as the mass kept.
Tiles with no token inside [lo, hi) skip the bin counting, so late passes cost little more than a read.
The draw is the Gumbel-max trick on the kept tokens: argmax(s + G), G from noise.gumbel_noise.

Kernels, each over a grid (chunks of the vocabulary, rows), each chunk reduced by "the last program":
partial results go to a workspace, an int32 arrival counter per row counts the chunks, and the program
that arrives last combines all chunks in chunk order (deterministic), updates the row's search state
and resets the counter (so a CUDA graph can replay the launches):
  1. stats: max, min and sum of exp(s - max) of the row; the search state for the row's filters.
  2. search (x 12, or 0 with filtering=False): the binned counts, the narrowed interval.
  3. draw: the Gumbel-max (or greedy) choice among kept tokens.
Rows with nothing left to search skip the search kernels' work.

Floor: the draw reads the logits once: 4*V bytes per row (V = 248320: 1 MB, ~0.2 us of HBM, the
logits sit in L2), plus ~10 Philox rounds per token. Each search pass reads the row again from L2; in
practice the cost is the 14 launches (a few microseconds each), which is why the engine samples
temperature-only requests inside the LM head (lm_head_argmax(temperature=...)) and greedy ones there too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import check_same_device, check_tensor, interpreting, sm_count
from .noise import check_noise_keys, gumbel_noise

TOP_K = tl.constexpr(0)
TOP_P = tl.constexpr(1)
DONE = tl.constexpr(2)
BINS = tl.constexpr(63)  # bins of [lo, hi) per pass; slot 63 counts the tokens at or above hi
SLOTS = tl.constexpr(64)
PASSES_PER_FILTER = 6  # 63**6 > 2**32: enough to pin a threshold in the 32-bit key space
# state_int [M, 4]: the interval [lo, hi) of keys, the phase, and the key just above the row's max
LO, HI, PHASE, KEY_END = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)
# state_float [M, 4]: the row's max of s, sum of exp(s - max), the mass at or above lo, the top-p target
S_MAX, S_SUM, MASS_LO, TARGET = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2), tl.constexpr(3)

INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _key(s):
    """An int64 key of float32 s with the order of s (-0.0 just below +0.0)."""
    bits = s.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


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
def _draw_kernel(
    logits_ptr, stride_lm, temperature_ptr, seed_ptr, step_ptr,
    best_value_ptr, best_index_ptr, state_int_ptr, counter_ptr, out_ptr,
    V, CHUNK, NUM_CHUNKS,
    SEED_PER_ROW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_P: tl.constexpr,
):
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    sampling = temperature > 0
    scale = tl.where(sampling, temperature, 1.0)
    threshold = tl.load(state_int_ptr + row * 4 + LO)
    if SEED_PER_ROW:
        seed = tl.load(seed_ptr + row)
        stream = row * 0
    else:
        seed = tl.load(seed_ptr)
        stream = row  # one seed for the batch: rows draw from their own streams
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


def _tiles(V: int) -> tuple[int, int]:
    """(BLOCK_V, SEARCH_BLOCK_V) of a row of V tokens: the module's, but wide ones for a long row under the
    interpreter (powers of two, the search's no wider than the draw's: a chunk is a multiple of both)."""
    if interpreting() and V > INTERPRETER_WIDE_V:
        block = triton.next_power_of_2(triton.cdiv(V, TARGET_CHUNKS * INTERPRETER_STEPS))
        return block, min(block, INTERPRETER_SEARCH_BLOCK_V)
    return BLOCK_V, SEARCH_BLOCK_V


_workspaces: dict[tuple, dict] = {}


def _workspace(device: torch.device, M: int, V: int) -> dict:
    key = (device, M, V)
    if key not in _workspaces:
        chunks = TARGET_CHUNKS
        if device.type == "cuda":
            chunks = max(1, min(TARGET_CHUNKS, triton.cdiv(4 * sm_count(device), M)))
        block_v = _tiles(V)[0]
        chunk = triton.cdiv(triton.cdiv(V, chunks), block_v) * block_v
        num_chunks = triton.cdiv(V, chunk)

        def floats(*shape):
            return torch.empty(*shape, dtype=torch.float32, device=device)

        _workspaces[key] = dict(
            chunk=chunk, num_chunks=num_chunks, block_p=triton.next_power_of_2(num_chunks),
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
) -> torch.Tensor:
    """One token id per row of logits [M, V] (float32, rows may be strided): int64 [M].

    temperature float32 [M] (0 = greedy); top_k int32 [M] (0 = off); top_p float32 [M] (1.0 = off);
    seed int64 [1] (one seed for the batch, rows draw from separate streams) or [M] (a seed per row);
    step int64 [M] (a draw is a pure function of seed, step, the logits and, with one shared seed, the
    row). filtering=False skips the 12 top-k/top-p search launches: only when every row has top_k 0
    and top_p 1.0 (the caller knows this on the host; nothing is read from the device here).
    min_p float32 [M] (0 = off; None: off for every row) needs no search pass.
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
    if M == 0:
        return out
    work = _workspace(logits.device, M, V)
    block_v, search_block_v = _tiles(V)
    grid = (work["num_chunks"], M)
    geometry = dict(V=V, CHUNK=work["chunk"], NUM_CHUNKS=work["num_chunks"])
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
    _draw_kernel[grid](
        logits, logits.stride(0), temperature, seed, step,
        work["best_value"], work["best_index"], work["state_int"], work["counters"], out,
        **geometry, SEED_PER_ROW=seed.shape[0] == M and M > 1, BLOCK_V=block_v, BLOCK_P=work["block_p"],
        num_warps=NUM_WARPS,
    )
    return out


def benchmark_cases(device="cuda") -> list[dict]:
    """Sampling a 248320-token row (Qwen3.5-0.8B) at batch 1: top-k + top-p, and temperature only."""
    vocab = 248320
    logits = torch.randn(1, vocab, device=device) * 3
    temperature = torch.full((1,), 0.8, device=device)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    out = torch.empty(1, dtype=torch.int64, device=device)
    filtered = (torch.full((1,), 50, dtype=torch.int32, device=device), torch.full((1,), 0.9, device=device))
    plain = (torch.zeros(1, dtype=torch.int32, device=device), torch.ones(1, device=device))
    return [
        dict(name=f"sample top_k=50 top_p=0.9 V={vocab}",
             fn=lambda: sample(logits, temperature, *filtered, seed, step, out),
             bytes=(2 + 2 * PASSES_PER_FILTER) * 4 * vocab, flops=0),
        dict(name=f"sample temperature-only V={vocab}",
             fn=lambda: sample(logits, temperature, *plain, seed, step, out, filtering=False),
             bytes=2 * 4 * vocab, flops=0),
    ]
