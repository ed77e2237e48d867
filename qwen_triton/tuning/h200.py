"""The H200's measured picks and thresholds (Qwen3.5-0.8B's shapes, bf16): the table `tuning.active()` gives on
an H200 and under the interpreter. Each entry says what was measured, with which script; where no entry serves a
shape, the kernel autotunes over its whole config space."""

from . import Tuning

# ---- linear.gemv (decode projections) -------------------------------------------------------------------
# The configs that were fastest in the decode step's own setting: benchmarks/decode_sweep.py timed all 17
# on the H200 (2026-11-29) as the model runs them, back to back in a CUDA graph with PDL on distinct
# weights, for each projection of Qwen3.5-0.8B; by K: K <= 1024 (the in-projections, gate/up) 16 rows x
# 256 columns; K <= 2048 (the out-projections) 8 rows x the whole K; larger K (down, 3584) four splits of
# 16 x 512. Timing one launch at a time after an L2 flush, the autotuner picked configs up to 30% slower
# in that setting (and once 2.5x slower), so where a preferred config applies it is the only candidate.
GEMV_BY_K = ((1024, (1, 16, 256)), (2048, (1, 8, 1024)), (None, (4, 16, 512)))  # (SPLIT_K, BLOCK_N, BLOCK_K)

# ---- linear.gemm (prefill projections) ------------------------------------------------------------------
# The configs that were fastest for a 128-token prompt in the prefill's own setting (benchmarks/gemm_sweep.py
# on the H200, 2026-11-29, commit 23ea421: back to back in a CUDA graph on distinct weights): for K <= 1024
# (the in-projections and gate/up) one 64 x 64 tile per program; for larger K (the out-projections,
# down) 64 x 64 tiles with K split in four. The autotuner, timing one launch at a time, picked others up
# to 1.6x slower (the out-projection: 12.9 us against 7.9), and not the same ones from run to run, so for
# prompts of up to gemm.MAX_SPLIT_ROWS tokens the preferred config is the only candidate where it is allowed.
GEMM_BY_K = ((1024, (64, 64, 64, 1)), (None, (64, 64, 128, 4)))  # (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K) by K
# A decode step of several sequences (tuning.gemm_decode_rows): (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
# by K, BLOCK_M the bucket's rows (16 to 64). The in-projections and gate/up (K = 1024) 64 x 128 tiles, one a
# program; the out-projections (2048) K split in two of 256-wide steps over 32 columns; down (3584) in four.
# The 4B's K = 2560 projections (its in-projections and gate/up) 32 x 128 tiles, one a program: at 1 and 16 rows
# 1,959 and 1,979 us a step against 2,203 and 2,244 with K split in four (benchmarks/decode_gemm_sweep.py
# --preset 4b --rows 1,16 on the H100; docs/decisions.md, D168).
GEMM_DECODE_BY_K = ((1024, (64, 128, 1, 4, 4)), (2048, (32, 256, 2, 4, 3)), (2560, (32, 128, 1, 4, 4)),
                    (None, (32, 128, 4, 4, 4)))
# A decode step of 64 rows where a row's bits may depend on its batch (not batch_invariant): the bucket's own picks,
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) by K. K = 1024 32 x 128 tiles, one a program; 2048 and
# 3584 32 x 256 tiles, K split in four; the 4B's 2560 restated from GEMM_DECODE_BY_K, so that no K of another size
# takes a 0.8B pick (K past 3584: GEMM_DECODE_BY_K). The 0.8B at context 128 on the H100, a step of 64 rows 2,252.0
# against 2,308.2 us with the one pick per K (three alternating rounds). The same search at 32 and 128 rows, 8-warp
# and 128-row tiles among the candidates, gained nothing end to end (benchmarks/decode_gemm_sweep.py --wide, then
# batched_decode.py --bucket-picks; docs/decisions.md, D180).
GEMM_DECODE_BY_ROWS = ((64, ((1024, (64, 32, 128, 1, 4, 4)), (2048, (64, 32, 256, 4, 4, 3)),
                             (2560, (64, 32, 128, 1, 4, 4)), (3584, (64, 32, 256, 4, 4, 3)))),)
# Prompts of gemm_long_prompt_rows tokens or more: the configs fastest in the same setting at M = 4096
# (benchmarks/gemm_sweep.py, commit 23ea421; docs/decisions.md, D58): 128 x 256
# tiles for the N = 1024 projections (out-projections, down: 33.1 and 53.7 us), 128 x 128 for the wide ones
# (in-projections, gate/up), 8 warps, 3 stages. The autotuner's one-launch timings picked others from run
# to run: the 4096-token profiles of 2026-11-30 ran the down projection at 48.5 and 66.3 us per layer and
# the DeltaNet out-projection at 33.7 and 40.6 with its different picks (commits 4ca1bd6, a9e4d1b).
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the largest N it serves
GEMM_LONG_BY_N = ((1024, (128, 256, 64, 8, 3)), (None, (128, 128, 64, 8, 3)))
# Prompts of 513-1024 tokens on the TMA loads (the bucket of M = 1024): the TMA configs fastest at M = 1024 in
# the same setting (benchmarks/gemm_sweep.py, commit 8e66760; docs/decisions.md, D54): 64 x
# 128 tiles at 4 warps for the N = 1024 projections (down 16.6 us, out-projection 11.6, attention gate + out
# 14.8, where the autotuner's one-launch picks ran 21.0, 12.3, 15.9), 128 x 128 at 8 warps for the wide ones.
# In the engine's 1024-token prefill (docs/decisions.md, D54): 4.52 and
# 4.70 ms pinned against 5.40 ms with the autotuner's picks (the GEMMs' median 21.9 against 28.8 us).
GEMM_MEDIUM_BY_N = ((1024, (64, 128, 64, 4, 4)), (None, (128, 128, 64, 8, 3)))

# ---- conv.causal_conv1d (prefill) ----------------------------------------------------------------------
# Each prompt runs one config: conv_prefill_pick up to 512 tokens, conv_long_prefill_pick from 513 (length bucket
# conv_long_prefill_from, 1024). conv_prefill_pick was the fastest tile in the prefill at 128 tokens (the 128-token
# profiles of commits f3827f2, aee88c5, d5cf3a2, a0111c5: 4.5 us per layer in two runs, against 5.7 and 8.0
# us with the autotuner's other picks) and at 4096 among the tiles (docs/decisions.md, D95: 49.5 us per layer
# against 58.0-71.4). With the walking configs (docs/decisions.md, D94), at 4096 tokens the walk of 8 x 512 x 4
# at 4 warps took 34.8 us per layer against the tile's 49.9 (the other walks 37.2-55.6); at 128 tokens every
# walk was slower than the tile (6.8-41.7 us against 3.6: 48 programs of 32 rows leave most SMs idle). With
# the walk on and off in alternation (the walk's threshold, commit 44ebcbb; D94): 34.4 against 48.8-49.1 us and
# the prefill 13.89 / 14.26 against 14.28 / 14.63 ms at 4096 tokens; 17.2-17.3 against 25.4 us at 2048;
# 10.2-10.4 against 11.2-11.3 at 1024. 512 tokens was not measured: the walk starts at the 1024 bucket. The autotuner's
# one-launch timings picked differently from run to run (at 4096: 64 x 64 and 64 x 128 at 8 warps in the
# profiles of fb3e19c and a9e4d1b, 57.9 and 71.6 us), hence the pins; the other configs stay for the sweep.
# Each output element is the same 4-tap sum in the same order whatever the tiles and the kernel (tile or
# walking): no result depends on them.

# ---- attention.qk_norm_rotary (prefill) ----------------------------------------------------------------
# ROWS: the rows a program handles, one after the other (one head each). One program per (row, head) made 49,152
# programs of one 512-byte vector at 4096 tokens. In the engine's prefill (docs/decisions.md, D92): at 4096 rows
# 4 rows per program at 1 warp take 18.0 us per layer against 31.8 for one row at 2 warps (the rest 22.8-39.7);
# at 128 rows one row per program is fastest (2.6-2.7 us against 3.9-16.5). On and off in alternation (commit
# 44ebcbb): 18.0 against 31.8 us at 4096 rows, 9.9-10.0 against 16.8 at 2048, 6.0 against 9.3 at 1024.
# So inputs of 513 rows or more (row bucket qk_long_rows_from) run qk_long_rows_pick; others one row per program,
# the warps tuned per row bucket (the decode step's single row is its own bucket). 512 rows was not measured.

# ---- gated_delta_rule.chunk (prefill) ------------------------------------------------------------------
# Chunks of 32 tokens up to 1024 tokens, and kernel 1 split above 2048: see chunk.py's module docstring for
# what was measured.
# Prompts of up to chunk_short_prompt_tokens tokens run the configs that were fastest at T = 128 back to back in a
# CUDA graph on the H200, for each chunk size (benchmarks/chunk_sweep.py; chunks of 64: the same in two runs,
# commits 447c82a and 4db1353; chunks of 32: one run, e5c4a2d, where the state pass took 8.3 us at its pick
# and 9.4 at that of chunks of 64): there the kernels take 5-20 us, the autotuner's one-launch timings picked
# differently from run to run, and the profiles' chunked delta rule at 128 tokens took 30-39 us per layer with
# its picks.
CHUNK_SHORT_PROMPT_PICKS = {
    64: {
        "prepare": dict(num_warps=8, num_stages=3),
        "state": dict(BLOCK_V=16, num_warps=4, num_stages=2),
        "output": dict(BLOCK_V=128, num_warps=4, num_stages=3),
    },
    32: {
        "prepare": dict(num_warps=4, num_stages=3),
        "state": dict(BLOCK_V=32, num_warps=8, num_stages=3),
        "output": dict(BLOCK_V=128, num_warps=4, num_stages=3),
    },
}
# Prompts of chunk_long_prompt_tokens tokens or more (chunks of 64, kernel 1 split): kernel 1's two parts at the configs
# fastest at T = 4096 in the same setting (benchmarks/chunk_sweep.py at commit d437362, docs/decisions.md, D65;
# the two parts together, us): the inverse at 4 warps capped
# at 168 registers 106.5 (110.9 uncapped, 113.6 at 8 warps), the products at 4 warps 106.6 (115.0 at 8 warps, the
# engine's profile's pick at d1b830a: the autotuner's one-launch timings pick either).
CHUNK_LONG_PROMPT_PICKS = {
    "inverse": dict(num_warps=4, num_stages=3, maxnreg=168),
    "products": dict(num_warps=4, num_stages=3, maxnreg=None),
}

# ---- the engine (engine/plan.py) ------------------------------------------------------------------------
# The decode step's LM head is launched without PDL (the step's other kernels with it, where they are): with
# PDL the step took 22.6 us longer at context 128 after the staged tail, 12.4 after the three-launch one
# (benchmarks/engine_options.py; docs/decisions.md, D42). Alone after a tail, with PDL, its kernel runs 19-21 us
# longer after the staged tail (D42).
# The screened LM head's four kernels (lm_head/screened.py) with PDL: the first is one program, not a grid of
# thousands placed early behind a staged layer tail.
# A prefill of up to prefill_pdl_tokens tokens launches its projections (GEMMs, their prologues, the q/k norm),
# convs and attention with PDL where the model uses it; the chunked delta rule's kernels and the LM head
# without. Measured on the H200 (benchmarks/prefill_options.py, the graph's replay; docs/decisions.md, D99,
# D100): 128 tokens 1,797 us without PDL, 1,772 so, 1,893 with the delta rule's kernels too
# (its next kernel's programs placed beside its latency-bound ones); 4096 tokens no gain (13.56-13.73 ms).

TABLE = Tuning(
    name="h200",
    gemv_by_k=GEMV_BY_K,
    # one sequence's step at context 128, the GEMV and its fused paths against the decode GEMM (batch_invariant=True,
    # the same kernels for one row as for 16), us: 0.8B (hidden 1024) 568 against 1,020; 4B (2560) 3,271 against
    # 3,017; 9B (4096) 5,224 against 4,476; 27B (5120) 22,499 against 13,859 (benchmarks/engine_options.py
    # --preset P "" "batch_invariant=True"; docs/decisions.md, D165)
    gemv_hidden_limit=2048,
    # one row through the GEMV, 2-16 through the resident-weights GEMM, more through the tiled decode GEMM: 0.8B at
    # context 128 on the H100, us per step: 2 rows 994 through the GEMV, 838 resident; 16 rows 1,388 tiled, 1,148
    # resident; 64 and 128 rows 2,544 and 4,128 tiled, 3,305 and 6,197 resident (benchmarks/batched_decode.py;
    # docs/decisions.md, D172)
    gemv_most_rows=1,
    resident_most_rows=16,
    gemm_by_k=GEMM_BY_K,
    gemm_decode_rows=128,
    # a decode step of 2-128 rows (and prompts of 2-128 tokens): the configs that took the least time over a step's
    # projections of each K at 2, 16, 64 and 128 rows, launched with PDL back to back in a CUDA graph
    # (benchmarks/decode_gemm_sweep.py, on the H100; docs/decisions.md, D149). BLOCK_M is the bucket's rows, 16 to
    # 64; the rest is one pick per K for every bucket, so that a row's result does not depend on how many rows
    # share its step (batch invariance)
    gemm_decode_by_k=GEMM_DECODE_BY_K,
    gemm_decode_by_rows=GEMM_DECODE_BY_ROWS,
    gemm_long_by_n=GEMM_LONG_BY_N,
    gemm_medium_by_n=GEMM_MEDIUM_BY_N,
    gemm_long_prompt_rows=4096,
    gemm_medium_prompt_bucket=1024,
    gemm_tma_rows=257,  # the first prompt length past the split-K GEMM's (256 rows)
    conv_prefill_pick=dict(BLOCK_T=16, BLOCK_C=128, WALK_BLOCKS=0, num_warps=4),
    conv_long_prefill_pick=dict(BLOCK_T=8, BLOCK_C=512, WALK_BLOCKS=4, num_warps=4),
    conv_long_prefill_from=1024,  # the length bucket (the prompt length rounded up to a power of two, at most 4096)
    qk_long_rows_pick=dict(ROWS=4, num_warps=1),
    qk_long_rows_from=1024,  # the row bucket (the row count rounded up to a power of two, at most 4096)
    chunk_short_chunk_tokens=1024,
    chunk_split_prepare_tokens=2048,
    chunk_short_prompt_tokens=256,
    chunk_short_prompt_picks=CHUNK_SHORT_PROMPT_PICKS,
    chunk_long_prompt_tokens=4096,
    chunk_long_prompt_picks=CHUNK_LONG_PROMPT_PICKS,
    prefill_pdl_tokens=256,
    lm_head_pdl=False,
    screened_lm_head_pdl=True,
    screened_rows=16,  # one pass over the int8 copy serves up to 16 rows
    # the autotuner's picks on the H100 for the greedy head at 32, 64 and 128 rows (docs/decisions.md, D177); the
    # buckets of fewer rows (temperature-only sampling) take the 32-row pick
    lm_head_tiled_by_rows=((32, (128, 128, 8, 3)), (64, (64, 64, 4, 4)), (None, (256, 64, 8, 3))),
)
