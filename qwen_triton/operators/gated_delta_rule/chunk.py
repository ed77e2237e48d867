"""The gated delta rule over a whole sequence (prefill), 32 or 64 tokens at a time in the UT / WY form.

Per value head h (reading key head h // (Hv / Hk)), with the gates and L2 norms fused in:
    g, beta = gating(a, b);  q = l2norm(q) / sqrt(Dk);  k = l2norm(k)        (gating.py; float32)
and, for a chunk of C tokens (32 or 64: below) with G_i = g_1 + ... + g_i (the log-decay from the chunk's start)
and the state S [Dk, Dv] at its start, the C rank-one updates of the recurrent form fold into matrices:
    A   = strictly-lower(diag(beta) K K^T * exp(G_i - G_j))                  [C, C]
    W   = (I + A)^-1 diag(beta exp(G)) K,  U = (I + A)^-1 diag(beta) V       [C, Dk], [C, Dv]
    V'  = U - W S                                                            the corrected values
    O   = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), causal) V'             [C, Dv]
    S   = exp(G_C) S + (diag(exp(G_C - G)) K)^T V'
(functional.gated_delta_rule_chunked is the same math in torch). Shapes: q, k [T, Hk, Dk]; v [T, Hv, Dv]
(strided views of the conv output, unit last stride); a, b [T, Hv] (raw, strided); A_log, dt_bias
float32 [Hv]; state [Hv, Dk, Dv] float32: the initial state in, the final state out, in place.
o [T, Hv, Dv] in v's dtype.

The chunk size. The fully parallel kernels' work per token grows with C (the [C, C] products, the inverse), the
sequential state pass's steps with T / C. Prompts of up to SHORT_CHUNK_TOKENS (1024) tokens run chunks of 32,
longer ones of 64 (`chunk_size_for`; gated_delta_rule_chunked(chunk_size=32 or 64) forces one). Measured on the
H200 (docs/decisions.md, D77): at T = 128, back to back in a CUDA graph (benchmarks/chunk_sweep.py
--chunk-sizes 32,64, commit e5c4a2d), the call 28.6 us in chunks of 64 (prepare 18.8, state pass 6.9, output 5.9)
against 18.1 in chunks of 32 (9.3, 9.4, 4.8): twice the programs and a 32 x 32 inverse for twice the state
steps. In the engine's prefill (benchmarks/prefill_options.py, chunks of 32 against SHORT_CHUNK_TOKENS=0, us):
64 tokens 1,497.4 against 1,671.2, 128 tokens 1,594.4 against 1,759.8, 256 tokens 2,029.3 against 2,131.3
(e5c4a2d), 512 tokens 2,809.7 against 2,912.5, 1024 tokens 4,201.2 against 4,213.9 (7e98561), 2048 tokens
7,281.2 against 7,350.0, and 4096 tokens 13,605.7 against 13,533.8 (e03104f): chunks of 64 from there. With the
state pass in Gluon (below) its steps cost less, and chunks of 64 win at 2048 tokens: 6,597.2 against 6,720.3 and
6,706.8 us replayed (1f4aaed; docs/decisions.md, D67), at 4096 tokens chunks of 32 lose by 0.35-0.45 ms; at 1024
tokens not separated: chunks of 64 from 1025 tokens.

Three kernels (four for long prompts: kernel 1 in two parts):
1. `_chunk_prepare_kernel`, grid (chunks, Hv, 2), fully parallel, two programs per chunk and head: one stores
   the intra-chunk attention Q K^T (causal-masked and decayed: one [C, C] product), the other G, the decayed
   keys K~, A (one [C, C] product), (I + A)^-1 and W, U (one [C, C] x [C, D] product each). These only depend
   on the chunk. The inverse by recursive doubling: a unit lower triangular [[I + A0, 0], [B, I + A1]] has the
   inverse [[X0, 0], [-X1 B X0, X1]], so the inverses of the 2 x 2 diagonal blocks (no product) give
   those of the 4 x 4, 8 x 8 and 16 x 16 blocks (the four 16 x 16 blocks at once, [4, 16, 16] products),
   then of the two 32 x 32 blocks and of the whole: 10 small products in a chain of 10 (for C = 32: the two
   16 x 16 diagonal blocks, then the merge of the halves), where forward
   substitution takes a dependent step of cross-thread reductions per row. It is as accurate (max
   error / max |X| ~3e-7 in float32 for 16 x 16 and 64 x 64 blocks of strongly correlated keys); the
   product form (I - N)(I + N^2)(I + N^4)(I + N^8), N = strictly-lower A, is not (7e-4 there: the powers
   of N cancel). Slower in the prefill of 128 tokens on the H200 (docs/decisions.md, D85;
   commit 80ffd3e: the kernel 18.0 us with these products at 8 warps): the same products with
   three tf32 products each ("tf32x3", 27.6 us), the doubling on the whole 64 x 64 with masks (58.6 us),
   and W and U formed by two programs that each invert (23.8 us; faster alone, 16.6 against 20.5 us, in
   benchmarks/chunk_sweep.py, but not in the prefill); and V loaded after the inverse, which cuts the spills
   for sm_90 at 8 warps from 304 to 64 bytes per thread (18.4 us; commit 863ccc9).
   The blocks move through memory, not registers (`_invert_chunk`, since 93cc029): the program stores A in
   its own [C, C] float32 block of a scratch (16 KiB per chunk and head, L2-resident), loads each step's
   operands in the shapes its products take ([4, 16, 16] diagonal blocks, [2, 16, 16] pairs, [32, 32]
   halves) and writes each result over the block of A it replaces, with a barrier between. The version before
   cut the blocks out of register tensors with reshapes and masked sums (layout conversions through shared
   memory). For sm_90 (`python3 benchmarks/sass_counts.py prepare`, a CPU compile with Triton's ptxas) at 8
   warps 3,544 SASS instructions against 4,144 (175 registers against 217, no spills either way); at 4 warps
   6,248 against 6,792, and 152 bytes of spills per thread against 352 (commits fb3e19c against 17a173e).
   Measured (profiles of the engine's prefill, H200): the kernel 18.02 -> 16.26 us at 128 tokens (commits
   501113a -> fb3e19c), 147.97 -> 139.71 us at 4096 (4ca1bd6 -> fb3e19c), medians over the 18 layers.
   Its products but the inverse's take bf16 operands (Precision, below): at 4096 tokens, back to back in a CUDA
   graph (benchmarks/chunk_sweep.py, commit 0f920e6, against 8550a07's tf32), kernel 1 161.2 -> 117.3 us and
   the whole call 300.9 -> 256.1 us; in the engine's prefill (benchmarks/prefill_options.py,
   docs/decisions.md, D75, us) 13,580.3 -> 12,845.0 at 4096 tokens,
   4,246.4 -> 4,135.6 at 1024, 1,607.6 -> 1,577.1 at 128: the operands' shared memory halves (64 -> 32 KiB a
   program for sm_90, benchmarks/sass_counts.py).
   For prompts of more than SPLIT_PREPARE_TOKENS (2048) tokens, those in chunks of 64, it runs as two kernels
   of shorter programs: `_chunk_inverse_kernel`, grid (chunks, Hv), G, the decayed keys and (I + A)^-1 (left
   in the scratch), then `_chunk_products_kernel`, grid (chunks, Hv, 3), Q K^T, W and U in programs of their
   own, each from the scratch's inverse and the inputs (G and beta recomputed from a, b by the same arithmetic).
   The same values (bit for bit under the interpreter). Measured in the engine's prefill (prefill_options.py, us,
   split against one kernel): 12,845.0 against 12,926.8 at 4096 tokens (0f920e6), 13,441.6 against 13,567.6
   with tf32 operands (8550a07); but 4,135.6 against 4,086.5 at 1024 tokens, 4,251.0 against 4,217.3 (tf32), and
   3,240.6 against 3,203.6 at 512 (tf32; docs/decisions.md, D76). At 4096
   tokens alone in a CUDA graph (chunk_sweep.py, 0f920e6) the first part takes 54.8 us, the second 63.4, the
   two together 115.5 (one kernel 117.3); in the engine's profile at 9362a54 47.9 and 53.2 us a layer.
   Where kernel 1 is split, kernel 3 forms the scores Q K^T itself (the scratch's scores_in_output) and the products
   kernel runs W and U alone, grid (chunks, Hv, 2). From 4096 tokens (LONG_PROMPT_PICKS) the two parts run the
   configs fastest in chunk_sweep.py: the inverse at 4 warps capped at 168 registers (three programs an SM for
   sm_90 instead of two), the products at 4 warps. Measured (docs/decisions.md, D63, D65; the engine's profile at 4096
   tokens, medians a layer): inverse 47.9 -> 43.9 us, products 50.0 -> 31.2, kernel 3 40.1 -> 52.8, the chunked
   rule 205.2 -> 196.3; in the prefill (prefill_options.py, one process, replayed) 12,037.0 us against 12,222.5
   with kernel 3 reading the scores and 12,070.2 without the pins.
2. The sequential part, and only the state's part of it. On Hopper with 16-bit operands (the engine's prefill) it
   runs in Gluon on the transposed state, `state_pass.py` (where `state_pass.applies`): both products of a step take the
   carried operand from registers, no shared-memory round trip in the step's chain; at 4096 tokens 102.1 -> 64-67
   us a layer (profiles efe5bcb -> 9626aa2, 4be166c, c0e27c0), the engine's prefill 12,717 -> 12,063 and 12,784 ->
   12,278 us replayed in one process (benchmarks/prefill_options.py, commits 9626aa2 and 4be166c; 128 tokens
   within 7 us either way). Elsewhere (the float32 options, other GPUs, the interpreter) the Triton kernel:
   `_chunk_state_kernel`, grid (Hv, Dv / BLOCK_V). A
   program carries the [Dk, BLOCK_V] slab of one head's state through the chunks in registers (float32);
   per chunk it stores the slab as the chunk's start state, forms V' = U - W S and stores it, and steps
   S = exp(G_C) S + K~^T V' with the decayed keys K~ = diag(exp(G_C - G)) K that kernel 1 stores. Its
   critical path is two dependent matmuls per chunk (W S, then K~^T V'); no load depends on the state, so
   the software pipeliner (num_stages >= 2, every config) prefetches the next chunk's W, U, K~ and G_C
   behind those products. Reading K~ rather than re-reading and re-normalising the raw k: 117.1 / 120.1 ->
   104.3 / 104.6 us per layer and the prefill 14.14 / 14.16 -> 13.93 / 13.82 ms at 4096 tokens, 6.1 -> 5.1
   us at 128 (commits e5836ff and 031d180 alternating; docs/decisions.md, D80). Its first form
   (commits a9e4d1b, e80ad2e) faulted with an illegal address on the H200 when compiled without pipelining:
   at num_stages=1, and for prompts of one chunk, whose loop Triton unrolled (chunks specialised to 1; the
   engine's prefills of 3, 8 and 12 tokens and T = 1; D80). So no config has one stage
   and `chunks` is not specialised; test_gpu_chunked_every_config and test_gpu_chunked_short_prompts (1, 5,
   63 and 65 tokens) run those cases on the GPU.
   Two other forms of the step are rejected (docs/decisions.md, D71, D70). One dependent product a step,
   S <- exp(G_C) S + K~^T U - N S with N = K~^T W [Dk, Dk] formed by kernel 1 and V' by kernel 3 (commit
   ca65ef3): slower, the prefill of 4096 tokens 13,237 against 12,865 us replayed, of 128 tokens 1,621 against
   1,568 (prefill_options.py in one process): Triton waits for each product's tensor-core group before the
   next, so K~^T U, which needs no state, stayed in the step's chain beside N S (two waits a step as before;
   at BLOCK_V 16, 4 warps, 24 wgmma instructions a step against 16), and a step loads N (32 KiB) in place of
   W (16 KiB): 176 against 123 KiB of shared memory at BLOCK_V 32, 8 warps, 3 stages, the shipped form's pick
   at 4096 tokens (benchmarks/sass_counts.py --sequence --constant ONE_PRODUCT=True, run on ca65ef3's
   chunk.py). The step on S^T, so that both products would take the carried operand from registers (commit
   b732384): its sm_90 PTX (sass_counts.py --sequence) still passes V'^T through shared memory, twice (its
   store layout and the operand's), the state through it before the first product, and loads U^T outside the
   pipeline; at BLOCK_V = 64 (the smallest wgmma tile) 255 registers and spills. Not run on the GPU.
3. `_chunk_output_kernel`, grid (chunks, Hv, Dv / BLOCK_V), fully parallel: a chunk's
   O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), causal) V' from its start state S and V' (kernel 2's),
   its Q K^T (kernel 1's; where kernel 1 is split, formed here from q and k, re-read and re-normalised, as
   kernel 1 forms them) and q, re-read and re-normalised. Folding this into the state pass for short
   prompts (one launch fewer) is no faster in the prefill of 128 tokens (commit 4ca1bd6: the
   state pass 6.2 -> 9.8 us per layer against 4.0 us for this kernel; the prefill 2.126 / 2.243 ms without
   it, 2.280 / 2.449 ms with it, two rounds; docs/decisions.md, D86): not kept.
   With `output_norm` (the engine's prefill) each program takes whole head rows (BLOCK_D >= Dv columns, grid
   (chunks, Hv, 1)) and writes the layer's gated RMSNorm of O instead of O (gated_rms_norm.py's roundings:
   O rounded to the output dtype first), in place of the norm kernel's launch and its read and write of O:
   measured 33.7 + 21.3 (norm kernel) -> 39.7 us per layer at 4096 tokens (profiles 4ca1bd6 -> fb3e19c),
   4.0 + 1.8 -> 6.2 us at 128 (501113a -> fb3e19c; there the launch it saves is the gain).
The kernels run one after the other. Kernel 3 beside the Gluon state pass on the SMs it leaves free (PDL, a flag
per chunk and head that the state pass releases once the chunk's TMA stores land; commit 804aee0) is correct and no
faster: 12,262 against 12,245 us at 4096 tokens, 4,050 against 3,913 at 1024 (prefill_options.py;
docs/decisions.md, D66). Side by side, waiting on per-chunk ready flags, both pairs are
slower in the prefill of 4096 tokens (docs/decisions.md, D79, D78): the state pass beside kernel 1
on a second stream (15.26-15.36 against 13.94-14.28 ms; it started only in kernel 1's last wave, and kernel 1
had to run at 8 warps to leave it room), and kernel 3 beside the state pass through PDL (14.30-14.36 against
13.85-13.95 ms: the state pass's steps slowed by the output programs on its SMs, 104 -> 134 us per layer).
Nor do they take PDL as the prefill's other kernels do: with each letting the next launch at its entry, the
engine's 128-token prefill takes 1,893 against 1,772 us (benchmarks/prefill_options.py; docs/decisions.md, D100; the
next kernel's programs placed beside the few latency-bound ones); with every prefill kernel letting the next
launch only at its exit, 1,800 against 1,797 without PDL. Kernel 3 beside the state pass but kept off the state
pass's SMs (a persistent grid taking (chunk, head) blocks from a queue, its
programs on an SM where a state-pass program runs waiting for the state pass to end; commits 774ab23 - 1c51172)
slows the state pass too, 105 -> 147 us per layer with a count per chunk on one flag (256 release atomics a
program), 127 us with a slot per thread counted a step late, and the prefill of 4096 tokens takes 12,975 and
13,524 us against 12,890 and 13,146 without (benchmarks/prefill_options.py; docs/decisions.md, D74).

Precision. The state, the gates, the norms and every accumulation are float32. The inverse (I + A)^-1
is formed with float32 ("ieee") 16 x 16 and 32 x 32 products: it is reused by all 64 rows and errors
there are systematic. For 16-bit activations the other chunk-local products of kernel 1 (K K^T, Q K^T,
W, U) take operands in the activation dtype (the normalised keys, and the inverse for W and U, rounded to
it), and the products of kernels 2 and 3 take
16-bit operands (the state and V' rounded to the activation dtype, float32 accumulation), the choice of
flash-linear-attention. Measured at the real shape, bf16, 4096 tokens against the float32 reference
(chunk_sweep.py's check, 0f920e6): output Frobenius error 4.06e-3 (3.14e-3 with tf32 in kernel 1), max 5.94e-3
(4.93e-3), state 2.78e-3 (2.40e-3); the engine's logits against the float32 reference model over 384 steps after
a 128-token prefill (tests/engine) median 2.903e-2 -> 2.905e-2, max 5.951e-2 -> 5.809e-2 (9c133f5 -> 9362a54). The chunk
start states and V' are stored in that dtype, the rounding the products make anyway, so that splitting
the sequential pass from the output adds no rounding. So is U (since 4c9ef0a; float32 before, for fear that
V' = U - W S cancels): at 4096 tokens the operator's errors about unchanged (chunk_sweep.py's check, 4c9ef0a:
o Frobenius 4.13e-3 against 4.06e-3 with U in float32, max 5.91e-3 against 5.94e-3, state 2.78e-3 both), the
engine's logits over 384 steps median 2.929e-2, max 5.721e-2 after a 128-token prefill (tests/engine, 1fd5f16);
in the engine's profile at 4096 tokens the state pass 105.3 -> 102.1 us a layer and kernel 1's second part
53.2 -> 50.2 (profiles 9362a54 -> efe5bcb), the prefill 12,901 -> 12,810 us replayed in one process
(prefill_options.py, 06d8514).
`dot_precision="tf32"` or `"ieee"` makes every product take float32 operands at that precision (and the
stored states and V' float32), each kernel at its first config, untuned (`_first_for_float32_operands`: a
config of the state pass faults with float32 operands). float32 activations use "ieee" throughout.

Floor at the real shapes (Hk = Hv = 16, Dk = Dv = 128, bf16), per token: q, k, v in (12 KiB), a, b in,
o out (4 KiB), plus the 1 MiB state in and out once: ~67 MB for T = 4096, 4 MB for T = 128.
Scratch beyond the floor, per call: kernel 1 writes W, U, K~, Q K^T (bf16) and G (fp32), ~14 KiB per token,
which kernel 2 (W, U, K~, G) and kernel 3 (Q K^T, G) read back; kernel 2 writes V' (bf16, 4
KiB per token) and the chunk start states (bf16 [Dk, Dv] per chunk and head: 512 KiB per chunk, 8 KiB per
token; 64 x 16 x 128 x 128 x 2 B = 32 MiB at T = 4096), which kernel 3 reads once: 12 KiB per token more
written and read (48 MiB each way at T = 4096), the price of taking Q S and (Q K^T) V' off the sequential
path. Under the float32 options V' and the chunk states are float32: twice that. Kernel 1's inverse works in a
float32 [C, C] block per chunk and head (16 KiB; 16 MiB at T = 4096), written and read back by the same
program.
~10 MFLOP per 64-token chunk and head (K K^T and Q K^T 1.3M, W and U 1.3M, W S, Q S, K^T V' 6.3M and
(Q K^T) V' 1M): ~10.7 GFLOP for T = 4096, of which kernel 2 does W S and K^T V' (4.2M per chunk and
head) in sequence. (Kernel 1 forms K K^T and Q K^T whole, upper halves included, as one tensor-core
product each: 0.8M more.) In chunks of 32 the [C, C] products take half the FLOPs per token.
Measured on the H200 (`benchmarks/chunk_sweep.py`, back to back in a CUDA graph, commit 447c82a): T = 4096,
the call 377.3 us (prepare 166.8, state pass 181.7, output 35.3) against 436.3 us for the two-kernel
version before it; T = 128, 31.2 against 30.4 us. Far from the floor: the state pass's 64 dependent steps
and the prepare kernel's inverse above all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...tuning import active
from ..common import autotune_configs, check_same_device, check_tensor, keep_preferred
from ..packed import ALIGN_ROWS, block_sequence, check_blocks
from . import state_pass
from .gated_rms_norm import gated_rms_norm_values
from .gating import ACTIVATION_DTYPES, check_gate_parameters, gate_and_beta, l2_normalize_rows
from .recurrent import state_slab

CHUNK = 64
# Prompts of up to SHORT_CHUNK_TOKENS tokens run in chunks of SHORT_CHUNK tokens (gated_delta_rule_chunked's
# chunk_size=None): twice the programs of the fully parallel kernels and a shorter inverse, for a state pass of
# twice the (cheaper) steps. See the module docstring for what was measured.
SHORT_CHUNK = 32
SHORT_CHUNK_TOKENS = active().chunk_short_chunk_tokens  # (tuning/h200.py)
CHUNK_SIZES = (SHORT_CHUNK, CHUNK)

TORCH_TO_TRITON = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _load_rows(base, rows, length, stride_row, cols, width, TO_FLOAT: tl.constexpr = True):
    mask = (rows[:, None] < length) & (cols[None, :] < width)
    x = tl.load(base + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0)
    if TO_FLOAT:
        x = x.to(tl.float32)
    return x


@triton.jit
def _valid_end(blocks_ptr, chunk, length, CHUNK_ROWS: tl.constexpr, PACKED: tl.constexpr):
    """The end of chunk `chunk`'s valid rows (the rows below it are tokens): the sequence's length, or in a packed
    layout (blocks_ptr, operators/packed.py) its sequence's last token + 1 (0 in the bucket's tail). The kernels
    load a chunk's inputs below it (zeros past it: no decay, no write) and write every row of the layout."""
    if PACKED:
        first, tokens, _, _ = block_sequence(blocks_ptr, chunk * CHUNK_ROWS)
        end = first + tokens
    else:
        end = length
    return end


@triton.jit
def _mm(a, b, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with operands rounded to DOT_DTYPE (float32 operands at PRECISION), float32 accumulation."""
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)


@triton.jit
def _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, length, stride_at, stride_bt):
    """G (the cumulative log-decay from the chunk's start) and beta of a chunk's rows; past the sequence's end
    g = beta = 0 (no decay, no write: the reference's padding)."""
    mask = rows < length
    a = tl.load(a_ptr + head + rows * stride_at, mask=mask, other=0.0)
    b = tl.load(b_ptr + head + rows * stride_bt, mask=mask, other=0.0)
    g, beta = gate_and_beta(a, b, tl.load(a_log_ptr + head), tl.load(dt_bias_ptr + head), b_ptr.dtype.element_ty)
    return tl.cumsum(tl.where(mask, g, 0.0), 0), tl.where(mask, beta, 0.0)


@triton.jit
def _decayed_scores(left, right, decay, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, STRICT: tl.constexpr):
    """(left right^T) * exp(G_i - G_j) for a chunk's rows, causal: j <= i (j < i if STRICT), zero elsewhere."""
    scores = _mm(left, tl.trans(right), DOT_DTYPE, PRECISION)
    i = tl.arange(0, left.shape[0])[:, None]
    j = tl.arange(0, right.shape[0])[None, :]
    if STRICT:
        keep = i > j
    else:
        keep = i >= j
    # masked entries would take exp of a positive exponent: zero the exponent first
    exponent = tl.where(keep, decay[:, None] - decay[None, :], 0.0)
    return tl.where(keep, scores * tl.exp(exponent), 0.0)


@triton.jit
def _double_inverse(x, a, LEVEL: tl.constexpr):
    """One doubling step of the inverse of a batch [B, n, n] of unit lower triangular matrices I + a.

    x = (I + a)^-1 on each diagonal block of size s = 2^LEVEL (zero elsewhere) becomes the inverse on the
    diagonal blocks of size 2s: such a block of I + a is [[I + a0, 0], [c, I + a1]], whose inverse is
    [[X0, 0], [-X1 c X0, X1]] = x - x e x, with e = a's lower-left s x s block in each 2s block.
    float32 "ieee" products.
    """
    n: tl.constexpr = x.shape[1]
    i = tl.arange(0, n)[None, :, None]
    j = tl.arange(0, n)[None, None, :]
    e = tl.where(((i >> (LEVEL + 1)) == (j >> (LEVEL + 1))) & ((i >> LEVEL) > (j >> LEVEL)), a, 0.0)
    return tl.dot(-x, tl.dot(e, x, input_precision="ieee"), acc=x, input_precision="ieee")


@triton.jit
def _invert_unit_lower(a):
    """(I + a)^-1 of a batch of strictly lower triangular blocks a [B, n, n] (entries on and above the
    diagonal are ignored), n a power of two from 16 (tl.dot's minimum) to 256, by recursive doubling:
    log2(n) - 1 steps of two batched products each (`_double_inverse`), as accurate as forward
    substitution (unlike the product form (I - N)(I + N^2)(I + N^4)..., whose powers of N cancel)."""
    n: tl.constexpr = a.shape[1]
    i = tl.arange(0, n)[None, :, None]
    j = tl.arange(0, n)[None, None, :]
    # the 2 x 2 blocks need no product: [[1, 0], [c, 1]]^-1 = [[1, 0], [-c, 1]]
    x = tl.where(i == j, 1.0, 0.0) - tl.where(((i >> 1) == (j >> 1)) & (i > j), a, 0.0)
    for level in tl.static_range(1, 8):
        if (2 << level) <= n:
            x = _double_inverse(x, a, level)
    return x


@triton.jit
def _merge_blocks(block_base, upper_offsets, SIZE: tl.constexpr, BLOCK: tl.constexpr):
    """The inverse of [[I + a0, 0], [c, I + a1]] from those of its diagonal blocks X0, X1 (each BLOCK x BLOCK, in
    place in a [SIZE, SIZE] float32 row-major block that holds the system a below them): its lower-left
    block -X1 c X0 replaces c. upper_offsets: the offsets of X0's entries (any batch shape [.., BLOCK, BLOCK]);
    X1 sits BLOCK rows and columns further, c BLOCK rows below X0. float32 "ieee" products."""
    upper = tl.load(block_base + upper_offsets, cache_modifier=".cg")
    lower = tl.load(block_base + upper_offsets + BLOCK * (SIZE + 1), cache_modifier=".cg")
    corner = tl.load(block_base + upper_offsets + BLOCK * SIZE, cache_modifier=".cg")
    corner = -tl.dot(lower, tl.dot(corner, upper, input_precision="ieee"), input_precision="ieee")
    tl.debug_barrier()  # every program thread has read c before any overwrites it
    tl.store(block_base + upper_offsets + BLOCK * SIZE, corner)
    tl.debug_barrier()


@triton.jit
def _invert_chunk(system, block_base):
    """(I + A)^-1 [C, C] of a strictly lower triangular A [C, C] (entries on and above the diagonal are
    ignored; C a power of two >= 32), through block_base, a [C, C] float32 scratch of this program's own:
    A is stored there, and its blocks are replaced by those of the inverse as they are formed, so that
    each step loads its operands in the shapes its products take. The diagonal blocks (four of C/4 for
    C >= 64, two of 16 for C = 32: tl.dot's smallest) are inverted by recursive doubling, batched, then
    merged in pairs (for C >= 64: two C/4 corners, batched), then the two halves (one C/2 corner)."""
    size: tl.constexpr = system.shape[0]
    block: tl.constexpr = size // 4 if size >= 64 else size // 2
    count: tl.constexpr = size // block
    rows = tl.arange(0, size)
    square = rows[:, None] * size + rows[None, :]
    tl.store(block_base + square, tl.where(rows[:, None] > rows[None, :], system, 0.0))  # zero on and above
    tl.debug_barrier()
    r = tl.arange(0, block)[None, :, None]
    c = tl.arange(0, block)[None, None, :]
    diagonal = tl.arange(0, count)[:, None, None] * (block * (size + 1)) + r * size + c  # [count, block, block]
    inverses = _invert_unit_lower(tl.load(block_base + diagonal, cache_modifier=".cg"))
    tl.debug_barrier()
    tl.store(block_base + diagonal, inverses)
    tl.debug_barrier()
    if count == 4:
        _merge_blocks(block_base, tl.arange(0, 2)[:, None, None] * (2 * block * (size + 1)) + r * size + c,
                      size, block)
    half = tl.arange(0, size // 2)
    # (the halves' upper-right blocks hold A's zeros, as the inverse's do)
    _merge_blocks(block_base, half[:, None] * size + half[None, :], size, size // 2)


@triton.jit
def _store_rows(base, rows, length, stride_row, cols, width, value):
    mask = (rows[:, None] < length) & (cols[None, :] < width)
    tl.store(base + rows[:, None] * stride_row + cols[None, :], value.to(base.dtype.element_ty), mask=mask)


PREPARE_CONFIGS = [
    triton.Config({}, num_warps=8),
    triton.Config({}, num_warps=4),
]


# Prompts of up to SHORT_PROMPT_TOKENS tokens run the configs fastest at T = 128 back to back in a CUDA graph, by
# chunk size and kernel; prompts of LONG_PROMPT_TOKENS tokens or more kernel 1's two parts at those fastest at
# T = 4096: this GPU's tuning table (tuning/h200.py, with what was measured); without a table the autotuner chooses.
SHORT_PROMPT_TOKENS = active().chunk_short_prompt_tokens
SHORT_PROMPT_PICKS = active().chunk_short_prompt_picks
LONG_PROMPT_TOKENS = active().chunk_long_prompt_tokens
LONG_PROMPT_PICKS = active().chunk_long_prompt_picks


def _prompt_pick(kernel: str):
    """The kernel's pinned config for a short prompt (SHORT_PROMPT_PICKS) or a long one (LONG_PROMPT_PICKS), where
    the table has one; every config otherwise."""
    def prune(configs, named_args, **kwargs):
        chunk, bucket = kwargs.get("CHUNK_ROWS", CHUNK), named_args.get("chunk_bucket")
        if bucket is not None and bucket * chunk <= SHORT_PROMPT_TOKENS:
            return keep_preferred(configs, SHORT_PROMPT_PICKS.get(chunk, {}).get(kernel))
        if bucket is not None and bucket * chunk >= LONG_PROMPT_TOKENS:
            return keep_preferred(configs, LONG_PROMPT_PICKS.get(kernel))
        return configs
    return prune


def _first_for_float32_operands(prune):
    """`prune`, but a kernel whose products take float32 operands (the "tf32" and "ieee" options, float32
    activations: DOT_DTYPE float32) runs its first config, untuned: these are accuracy options. At 4096 tokens
    with "tf32" the state pass's tuning faulted with an illegal address on the H200 (test_gpu_chunked, commit
    2323671): its config of BLOCK_V 16 at 8 warps and 2 stages faults with float32 operands, alone, where every
    other config of kernel 1's two parts, the state pass and the output kernel ran (one at a time in processes
    of their own, commit 4f56a5a: docs/decisions.md, D73; BLOCK_V 32 at 8 warps and 3
    stages needs 240 KiB of shared memory, which the tuning skips). Not analysed further; with 16-bit operands
    the same config runs in every tuning at that length. (With "ieee" every product is an FMA chain: for sm_90
    ptxas took 65 s on the one-kernel prepare at 4 warps, 12 s at 8, its first config.)"""
    def pruned(configs, named_args, **kwargs):
        if kwargs.get("DOT_DTYPE") == tl.float32:
            return configs[:1]
        return prune(configs, named_args, **kwargs)
    return pruned


@triton.jit
def _store_scores(q_ptr, k_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, qk_ptr, chunk, head, length, scale,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt,
                  V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
                  CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk `chunk`'s intra-chunk attention of head `head`, causal Q K^T * exp(G_i - G_j) [C, C] (the upper
    triangle is never read, nor written)."""
    key_head = head // GROUP
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    keys = tl.arange(0, BLOCK_K)
    # the loads first, so that their latencies overlap
    q = _load_rows(q_ptr + key_head * stride_qh, rows, length, stride_qt, keys, K_DIM, False)
    k = _load_rows(k_ptr + key_head * stride_kh, rows, length, stride_kt, keys, K_DIM, False)
    decay, _ = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, length, stride_at, stride_bt)
    q = l2_normalize_rows(q.to(tl.float32), scale)
    k = l2_normalize_rows(k.to(tl.float32), 1.0)
    qk = _decayed_scores(q, k, decay, DOT_DTYPE, PRECISION, False)
    offsets = tl.arange(0, CHUNK_ROWS)
    tl.store(qk_ptr + (chunk * V_HEADS + head) * (CHUNK_ROWS * CHUNK_ROWS) + offsets[:, None] * CHUNK_ROWS
             + offsets[None, :], qk.to(qk_ptr.dtype.element_ty), mask=offsets[:, None] >= offsets[None, :])


@triton.jit
def _form_system(k, decay, beta, decayed_keys_ptr, system_ptr, chunk, head, length,
                 V_HEADS: tl.constexpr, K_DIM: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK_ROWS: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """From a chunk's raw keys k [C, BLOCK_K] and its G and beta: stores the decayed keys
    diag(exp(G_C - G)) K (the state pass multiplies them by V'; G_C: G at the chunk's last row, the padding
    keeps G) and forms (I + A)^-1, A = strictly-lower(diag(beta) K K^T * exp(G_i - G_j)), in the chunk's
    [C, C] float32 block of system_ptr (float32 "ieee" products: the inverse is reused by every row).
    Returns the normalised keys."""
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    keys = tl.arange(0, BLOCK_K)
    k = l2_normalize_rows(k.to(tl.float32), 1.0)
    offsets = tl.arange(0, CHUNK_ROWS)
    decay_last = tl.sum(tl.where(offsets == CHUNK_ROWS - 1, decay, 0.0))
    _store_rows(decayed_keys_ptr + head * length * K_DIM, rows, length, K_DIM, keys, K_DIM,
                k * tl.exp(decay_last - decay)[:, None])
    system_base = system_ptr + (chunk * V_HEADS + head) * (CHUNK_ROWS * CHUNK_ROWS)
    _invert_chunk(_decayed_scores(k * beta[:, None], k, decay, DOT_DTYPE, PRECISION, True), system_base)
    return k


@triton.jit
def _load_inverse(system_ptr, chunk, head, V_HEADS: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    offsets = tl.arange(0, CHUNK_ROWS)
    square = offsets[:, None] * CHUNK_ROWS + offsets[None, :]
    return tl.load(system_ptr + (chunk * V_HEADS + head) * (CHUNK_ROWS * CHUNK_ROWS) + square,
                   cache_modifier=".cg")


@triton.jit
def _store_w(inverse, k, decay, beta, w_ptr, chunk, head, length, K_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
             CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """W = (I + A)^-1 diag(beta exp(G)) K of a chunk (k: its normalised keys)."""
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    keys = tl.arange(0, BLOCK_K)
    w = _mm(inverse, k * (beta * tl.exp(decay))[:, None], DOT_DTYPE, PRECISION)
    _store_rows(w_ptr + head * length * K_DIM, rows, length, K_DIM, keys, K_DIM, w)


@triton.jit
def _store_u(inverse, v, beta, u_ptr, chunk, head, length, V_DIM: tl.constexpr, BLOCK_V: tl.constexpr,
             CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """U = (I + A)^-1 diag(beta) V of a chunk (v: its raw values)."""
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    values = tl.arange(0, BLOCK_V)
    u = _mm(inverse, v.to(tl.float32) * beta[:, None], DOT_DTYPE, PRECISION)
    _store_rows(u_ptr + head * length * V_DIM, rows, length, V_DIM, values, V_DIM, u)


@triton.autotune(configs=autotune_configs(PREPARE_CONFIGS),
                 key=["chunk_bucket", "K_DIM", "V_DIM", "CHUNK_ROWS", "PRECISION"],
                 prune_configs_by={"early_config_prune": _first_for_float32_operands(_prompt_pick("prepare"))},
                 cache_results=True)
@triton.jit(do_not_specialize=["chunk_bucket"])  # a tuning key only: no recompilation per bucket
def _chunk_prepare_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    w_ptr, u_ptr, qk_ptr, decay_ptr, decayed_keys_ptr, system_ptr, blocks_ptr,
    length, chunk_bucket, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, PACKED: tl.constexpr = False,
):
    """Grid (chunks, Hv, 2): program (c, h, 0) writes chunk c's causal Q K^T * exp(G_i - G_j) [C, C] of head
    h; program (c, h, 1) its G [C], W [C, Dk], U [C, Dv] and the decayed keys diag(exp(G_C - G)) K [C, Dk],
    through (I + A)^-1 [C, C] (float32, formed in its [C, C] block of system_ptr)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    end = _valid_end(blocks_ptr, chunk, length, CHUNK_ROWS, PACKED)
    if tl.program_id(2) == 0:
        _store_scores(q_ptr, k_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, qk_ptr, chunk, head, end, scale,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt,
                      V_HEADS, GROUP, K_DIM, BLOCK_K, CHUNK_ROWS, DOT_DTYPE, PRECISION)
    else:
        rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
        # the loads first, so that their latencies overlap
        k = _load_rows(k_ptr + (head // GROUP) * stride_kh, rows, end, stride_kt, tl.arange(0, BLOCK_K), K_DIM,
                       False)
        v = _load_rows(v_ptr + head * stride_vh, rows, end, stride_vt, tl.arange(0, BLOCK_V), V_DIM, False)
        decay, beta = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, end, stride_at, stride_bt)
        tl.store(decay_ptr + head * length + rows, decay, mask=rows < length)
        k = _form_system(k, decay, beta, decayed_keys_ptr, system_ptr, chunk, head, length,
                         V_HEADS, K_DIM, BLOCK_K, CHUNK_ROWS, DOT_DTYPE, PRECISION)
        inverse = _load_inverse(system_ptr, chunk, head, V_HEADS, CHUNK_ROWS)
        _store_w(inverse, k, decay, beta, w_ptr, chunk, head, length, K_DIM, BLOCK_K, CHUNK_ROWS, DOT_DTYPE, PRECISION)
        _store_u(inverse, v, beta, u_ptr, chunk, head, length, V_DIM, BLOCK_V, CHUNK_ROWS, DOT_DTYPE, PRECISION)


# Prompts of more than SPLIT_PREPARE_TOKENS tokens (in chunks of 64) run kernel 1 as two kernels (below), each of
# shorter programs. See the module docstring for what was measured.
SPLIT_PREPARE_TOKENS = active().chunk_split_prepare_tokens  # (tuning/h200.py)
# Where kernel 1 is split, kernel 3 forms each chunk's Q K^T * exp(G_i - G_j) itself (from q and k, which it reads
# beside the chunk's V' and start state) instead of reading scores stored by a third set of the products kernel's
# programs: those programs, their reads of q and k and the scores' round trip through memory go. Measured:
# docs/decisions.md, D63.

# The inverse's programs are chains of small dependent products (latency-bound): a register cap (maxnreg) puts more
# programs on an SM (for sm_90, benchmarks/sass_counts.py inverse --maxnreg N: 4 warps at 182 registers, two programs
# an SM; capped at 168, three, no spills; at 128, four, 264 bytes of spills). At T = 4096 (benchmarks/chunk_sweep.py,
# commit d437362, docs/decisions.md, D65; the two parts together, the products at their pick, us): 106.5 capped at
# 168, 110.5 at 128, 110.9 uncapped; 8 warps (108 registers, two programs an SM) 113.6, capped at 80 113.8 and at 64
# 120.9 (three and four programs): those dropped.
INVERSE_CONFIGS = [
    triton.Config({}, num_warps=4),
    triton.Config({}, num_warps=8),
    triton.Config({}, num_warps=4, maxnreg=168),
    triton.Config({}, num_warps=4, maxnreg=128),
]


@triton.autotune(configs=autotune_configs(INVERSE_CONFIGS),
                 key=["chunk_bucket", "K_DIM", "CHUNK_ROWS", "PRECISION"],
                 prune_configs_by={"early_config_prune": _first_for_float32_operands(_prompt_pick("inverse"))},
                 cache_results=True)
@triton.jit(do_not_specialize=["chunk_bucket"])  # a tuning key only: no recompilation per bucket
def _chunk_inverse_kernel(
    k_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, decay_ptr, decayed_keys_ptr, system_ptr, blocks_ptr,
    length, chunk_bucket, stride_kt, stride_kh, stride_at, stride_bt,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr = False,
):
    """Kernel 1 split, first part. Grid (chunks, Hv): program (c, h) writes chunk c's G [C] and decayed keys
    [C, Dk] of head h, and forms (I + A)^-1 [C, C] in its block of system_ptr (float32)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    end = _valid_end(blocks_ptr, chunk, length, CHUNK_ROWS, PACKED)
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    k = _load_rows(k_ptr + (head // GROUP) * stride_kh, rows, end, stride_kt, tl.arange(0, BLOCK_K), K_DIM,
                   False)
    decay, beta = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, end, stride_at, stride_bt)
    tl.store(decay_ptr + head * length + rows, decay, mask=rows < length)
    _form_system(k, decay, beta, decayed_keys_ptr, system_ptr, chunk, head, length,
                 V_HEADS, K_DIM, BLOCK_K, CHUNK_ROWS, DOT_DTYPE, PRECISION)


# (8 warps capped at 64 registers, four programs an SM for sm_90 where 76 give three, `sass_counts.py products --warps
# 8 --maxnreg 64`: measured 116.8 against 115.0 us at T = 4096 in the same sweep, not kept)
PRODUCTS_CONFIGS = [
    triton.Config({}, num_warps=4),
    triton.Config({}, num_warps=8),
]


@triton.autotune(configs=autotune_configs(PRODUCTS_CONFIGS),
                 key=["chunk_bucket", "K_DIM", "V_DIM", "CHUNK_ROWS", "PRECISION"],
                 prune_configs_by={"early_config_prune": _first_for_float32_operands(_prompt_pick("products"))},
                 cache_results=True)
@triton.jit(do_not_specialize=["chunk_bucket"])  # a tuning key only: no recompilation per bucket
def _chunk_products_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, w_ptr, u_ptr, qk_ptr, system_ptr, blocks_ptr,
    length, chunk_bucket, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_at, stride_bt,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_ROWS: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr, PACKED: tl.constexpr = False,
):
    """Kernel 1 split, second part, after `_chunk_inverse_kernel`. Grid (chunks, Hv, 2): program (c, h, 0) writes
    chunk c's W [C, Dk] of head h and program (c, h, 1) its U [C, Dv], from the inverse in system_ptr; G and beta
    recomputed from a, b (the same arithmetic as the first part's, so the same values). The chunks' scores are
    kernel 3's (q_ptr, qk_ptr and scale unused: the one kernel's arguments)."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    end = _valid_end(blocks_ptr, chunk, length, CHUNK_ROWS, PACKED)
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    if tl.program_id(2) == 0:
        k = _load_rows(k_ptr + (head // GROUP) * stride_kh, rows, end, stride_kt, tl.arange(0, BLOCK_K),
                       K_DIM, False)
        decay, beta = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, end, stride_at,
                                   stride_bt)
        inverse = _load_inverse(system_ptr, chunk, head, V_HEADS, CHUNK_ROWS)
        _store_w(inverse, l2_normalize_rows(k.to(tl.float32), 1.0), decay, beta, w_ptr, chunk, head, length,
                 K_DIM, BLOCK_K, CHUNK_ROWS, DOT_DTYPE, PRECISION)
    else:
        v = _load_rows(v_ptr + head * stride_vh, rows, end, stride_vt, tl.arange(0, BLOCK_V), V_DIM, False)
        _, beta = _chunk_gates(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, head, rows, end, stride_at, stride_bt)
        inverse = _load_inverse(system_ptr, chunk, head, V_HEADS, CHUNK_ROWS)
        _store_u(inverse, v, beta, u_ptr, chunk, head, length, V_DIM, BLOCK_V, CHUNK_ROWS, DOT_DTYPE, PRECISION)


# num_stages >= 2: the next chunk's W, U, decayed keys and G_C prefetched (the software pipeliner's cp.async
# copies). Every config is pipelined, and the kernel is compiled with `chunks` unspecialised, so that a one-chunk
# prompt runs the same loop: the state pass reading stored decayed keys faulted with an illegal address on the
# H200 (docs/decisions.md, D80) when compiled without pipelining, at num_stages=1 or with the loop unrolled
# for one chunk (chunks specialised to 1). test_gpu_chunked_every_config and test_gpu_chunked_short_prompts
# run those cases.
STATE_CONFIGS = [
    triton.Config({"BLOCK_V": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_V": 16}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_V": 16}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_V": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_V": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_V": 64}, num_warps=8, num_stages=2),
]


@triton.jit
def _state_step_tiles(w_base, u_base, keys_base, decay_base, chunk, length, keys, values,
                      K_DIM: tl.constexpr, V_DIM: tl.constexpr, CHUNK_ROWS: tl.constexpr):
    """What a state step reads of chunk `chunk`: W [C, Dk], U's columns [C, BLOCK_V], the decayed keys [C, Dk]
    and G_C. Rows past the sequence's end load as zeros."""
    rows = chunk * CHUNK_ROWS + tl.arange(0, CHUNK_ROWS)
    w = _load_rows(w_base, rows, length, K_DIM, keys, K_DIM, False)
    u = _load_rows(u_base, rows, length, V_DIM, values, V_DIM, False)
    decayed_keys = _load_rows(keys_base, rows, length, K_DIM, keys, K_DIM, False)
    decay_last = tl.load(decay_base + tl.minimum(chunk * CHUNK_ROWS + CHUNK_ROWS, length) - 1)
    return w, u, decayed_keys, decay_last


@triton.autotune(
    configs=autotune_configs(STATE_CONFIGS),
    key=["chunk_bucket", "V_HEADS", "K_DIM", "V_DIM", "CHUNK_ROWS", "PRECISION"],  # DOT_DTYPE: w's dtype, in the key
    prune_configs_by={"early_config_prune": _first_for_float32_operands(_prompt_pick("state"))},
    restore_value=["state_ptr"], cache_results=True,
)
# chunk_bucket: a tuning key only (no recompilation per bucket); chunks: not specialised to 1 (above)
@triton.jit(do_not_specialize=["chunk_bucket", "chunks"])
def _chunk_state_kernel(
    decayed_keys_ptr, w_ptr, u_ptr, decay_ptr, state_ptr, new_values_ptr, chunk_states_ptr, blocks_ptr,
    length, chunks, chunk_bucket,
    V_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, PACKED: tl.constexpr = False,
):
    """Grid (Hv, Dv / BLOCK_V): program (h, j) carries columns j of head h's state through the chunks,
    storing each chunk's start state [chunks, Hv, Dk, Dv] and V' [Hv, T, Dv] (in DOT_DTYPE) on the way and
    the final state (float32) in place. PACKED: state_ptr holds every slot's states [S, Hv, Dk, Dv]; a sequence's
    first chunk starts from its slot's state, and its last chunk's end state is stored there."""
    head = tl.program_id(0)
    keys = tl.arange(0, BLOCK_K)
    values = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    slab, slab_mask = state_slab(state_ptr + head * (K_DIM * V_DIM), keys, values, K_DIM, V_DIM)
    if PACKED:
        state = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)  # (the first chunk starts a sequence)
    else:
        state = tl.load(slab, mask=slab_mask, other=0.0)

    keys_base = decayed_keys_ptr + head * length * K_DIM
    decay_base = decay_ptr + head * length
    w_base = w_ptr + head * length * K_DIM
    u_base = u_ptr + head * length * V_DIM
    new_values_base = new_values_ptr + head * length * V_DIM
    offsets = tl.arange(0, CHUNK_ROWS)
    for chunk in range(chunks):
        # no load depends on the state: at num_stages >= 2 the software pipeliner copies the next chunk's
        # tiles into shared memory (cp.async) while this chunk's products run
        w, u, decayed_keys, decay_last = _state_step_tiles(
            w_base, u_base, keys_base, decay_base, chunk, length, keys, values, K_DIM, V_DIM, CHUNK_ROWS)
        if PACKED:
            first, tokens, _, slot = block_sequence(blocks_ptr, chunk * CHUNK_ROWS)
            sequence_slab = slab + tl.maximum(slot, 0).to(tl.int64) * (V_HEADS * K_DIM * V_DIM)
            if (slot >= 0) & (chunk * CHUNK_ROWS == first):
                state = tl.load(sequence_slab, mask=slab_mask, other=0.0)
        start_slab, _ = state_slab(chunk_states_ptr + (chunk * V_HEADS + head) * (K_DIM * V_DIM), keys, values,
                                   K_DIM, V_DIM)
        tl.store(start_slab, state.to(chunk_states_ptr.dtype.element_ty), mask=slab_mask)
        new_values = u - _mm(w, state, DOT_DTYPE, PRECISION)
        _store_rows(new_values_base, chunk * CHUNK_ROWS + offsets, length, V_DIM, values, V_DIM, new_values)
        state = state * tl.exp(decay_last) + _mm(tl.trans(decayed_keys), new_values, DOT_DTYPE, PRECISION)
        if PACKED:
            # the sequence's rows end with its chunk of its last aligned block
            end = first + (tokens + ALIGN_ROWS - 1) // ALIGN_ROWS * ALIGN_ROWS
            if (slot >= 0) & (chunk * CHUNK_ROWS + CHUNK_ROWS == end):
                tl.store(sequence_slab, state, mask=slab_mask)
    if not PACKED:
        tl.store(slab, state, mask=slab_mask)


# No BLOCK_V of 32: forming the scores (SCORES_HERE) without the norm, the kernel at BLOCK_V 32 and 4 warps wrote
# a wrong output and then faulted with an illegal address on the H200 (chunks of 64; commit c5763f8:
# docs/decisions.md, D64), where BLOCK_V 64 and 128 at 4 and 8 warps
# matched the kernel reading the products kernel's scores (to the bit with the norm and at 128; within one bf16
# rounding at 64). Not analysed further (its second product [64, 64] x [64, 32], the scores from the first product's
# registers). It was never the pick either: at 4096 tokens 100.0 us against 35.7 at BLOCK_V 128 reading the scores
# (chunk_sweep.py; D64); short prompts pin 128. (A single config is not pruned, so it had to go from the list.)
OUTPUT_CONFIGS = [
    triton.Config({"BLOCK_V": 64}, num_warps=4),
    triton.Config({"BLOCK_V": 64}, num_warps=8),
    triton.Config({"BLOCK_V": 128}, num_warps=4),
    triton.Config({"BLOCK_V": 128}, num_warps=8),
]


def _prune_output(configs, named_args, **kwargs):
    """With the output norm a program writes whole head rows whatever BLOCK_V: the configs of the largest
    BLOCK_V stand for the warp counts. Then the short-prompt pick."""
    if kwargs.get("NORM"):
        widest = max(c.kwargs["BLOCK_V"] for c in configs)
        configs = [c for c in configs if c.kwargs["BLOCK_V"] == widest]
    return _prompt_pick("output")(configs, named_args, **kwargs)


@triton.autotune(configs=autotune_configs(OUTPUT_CONFIGS),
                 key=["chunk_bucket", "V_HEADS", "K_DIM", "V_DIM", "CHUNK_ROWS", "PRECISION", "NORM", "SCORES_HERE"],
                 prune_configs_by={"early_config_prune": _first_for_float32_operands(_prune_output)},
                 cache_results=True)
@triton.jit(do_not_specialize=["chunk_bucket"])  # a tuning key only: no recompilation per bucket
def _chunk_output_kernel(
    q_ptr, k_ptr, qk_ptr, decay_ptr, new_values_ptr, chunk_states_ptr, out_ptr, z_ptr, norm_weight_ptr, blocks_ptr,
    length, chunk_bucket, scale, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_zt,
    V_HEADS: tl.constexpr, GROUP: tl.constexpr, K_DIM: tl.constexpr, V_DIM: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr, ROUND_PRODUCT: tl.constexpr,
    SCORES_HERE: tl.constexpr = False, SCORES_DTYPE: tl.constexpr = tl.float32, PACKED: tl.constexpr = False,
):
    """Grid (chunks, Hv, Dv / BLOCK_V): program (c, h, j) writes columns j of chunk c's output of head h,
    O = diag(exp(G)) Q S + (Q K^T decayed, causal) V', S the chunk's start state. NORM: grid (chunks, Hv,
    1), each program the whole head rows (BLOCK_D >= Dv columns), and it writes gated_rms_norm(O, z)
    instead, O rounded to the output dtype first, as the norm kernel reads it. SCORES_HERE: the program forms
    the chunk's Q K^T * exp(G_i - G_j) itself from q and k (as `_store_scores` does, its operands in
    SCORES_DTYPE, rounded to the scratch's dtype as its store rounds them) instead of reading kernel 1's."""
    chunk = tl.program_id(0)
    head = tl.program_id(1)
    keys = tl.arange(0, BLOCK_K)
    if NORM:
        values = tl.arange(0, BLOCK_D)
    else:
        values = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offsets = tl.arange(0, CHUNK_ROWS)
    rows = chunk * CHUNK_ROWS + offsets
    block = chunk * V_HEADS + head
    end = _valid_end(blocks_ptr, chunk, length, CHUNK_ROWS, PACKED)
    decay = tl.load(decay_ptr + head * length + rows, mask=rows < length, other=0.0)
    q = l2_normalize_rows(_load_rows(q_ptr + (head // GROUP) * stride_qh, rows, end, stride_qt, keys, K_DIM),
                          scale)
    if SCORES_HERE:  # (before the state's and V''s loads: k's tile is gone before theirs are live)
        k = l2_normalize_rows(
            _load_rows(k_ptr + (head // GROUP) * stride_kh, rows, end, stride_kt, keys, K_DIM), 1.0)
        qk = _decayed_scores(q, k, decay, SCORES_DTYPE, PRECISION, False).to(new_values_ptr.dtype.element_ty)
    else:
        qk = tl.load(qk_ptr + block * (CHUNK_ROWS * CHUNK_ROWS) + offsets[:, None] * CHUNK_ROWS + offsets[None, :],
                     mask=offsets[:, None] >= offsets[None, :], other=0.0)
    start_slab, slab_mask = state_slab(chunk_states_ptr + block * (K_DIM * V_DIM), keys, values, K_DIM, V_DIM)
    state = tl.load(start_slab, mask=slab_mask, other=0.0)
    new_values = _load_rows(new_values_ptr + head * length * V_DIM, rows, length, V_DIM, values, V_DIM, False)
    q = q * tl.exp(decay)[:, None]
    out = _mm(q, state, DOT_DTYPE, PRECISION) + _mm(qk, new_values, DOT_DTYPE, PRECISION)
    if NORM:
        dtype = out_ptr.dtype.element_ty
        z = _load_rows(z_ptr + head * V_DIM, rows, end, stride_zt, values, V_DIM)
        weight = tl.load(norm_weight_ptr + values, mask=values < V_DIM, other=0.0).to(tl.float32)
        out = gated_rms_norm_values(out.to(dtype).to(tl.float32), z, weight, eps, V_DIM, ROUND_PRODUCT, dtype)
    _store_rows(out_ptr + head * stride_oh, rows, length, stride_ot, values, V_DIM, out)


def _check_arguments(q, k, v, a, b, A_log, dt_bias, chunk_size, out, dot_precision, output_norm) -> torch.Tensor:
    """Raise ValueError naming the offending argument; returns out (allocated when None)."""
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be None or one of {CHUNK_SIZES}, got {chunk_size}")
    check_tensor("q", q, shape=(None, None, None), dtype=ACTIVATION_DTYPES)
    length, key_heads, key_dim = q.shape
    check_tensor("k", k, shape=(length, key_heads, key_dim), dtype=q.dtype)
    check_tensor("v", v, shape=(length, None, None), dtype=q.dtype)
    value_heads, value_dim = v.shape[1], v.shape[2]
    if key_heads == 0 or value_heads % key_heads:
        raise ValueError(f"v has {value_heads} heads, not a multiple of the {key_heads} heads of q and k")
    check_gate_parameters(a, b, A_log, dt_bias, rows=length, heads=value_heads)
    if out is None:
        out = torch.empty(length, value_heads, value_dim, device=v.device, dtype=v.dtype)
    check_tensor("out", out, shape=(length, value_heads, value_dim), dtype=v.dtype)
    check_same_device(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, out=out)
    if dot_precision not in (None, "tf32", "ieee"):
        raise ValueError(f"dot_precision must be None, 'tf32' or 'ieee', got {dot_precision!r}")
    if output_norm is not None:
        if not (isinstance(output_norm, tuple) and len(output_norm) == 3):
            raise ValueError("output_norm must be a tuple (z, weight, eps)")
        z, weight, _ = output_norm
        check_tensor("output_norm's z", z, shape=(length, value_heads * value_dim), dtype=v.dtype)
        check_tensor("output_norm's weight", weight, shape=(value_dim,), dtype=ACTIVATION_DTYPES, contiguous=True)
        check_same_device(v=v, z=z, weight=weight)
    return out


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None = None,
    out: torch.Tensor | None = None,
    dot_precision: str | None = None,
    output_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Prefill of one sequence: o [T, Hv, Dv]; state [Hv, Dk, Dv] float32 carried in place.

    dot_precision: None (the default mix, see the module docstring), "tf32" or "ieee" (float32 operands).
    output_norm: (z [T, Hv * Dv], weight [Dv], eps): return gated_rms_norm(o, z, weight, eps) instead of o
    (gated_rms_norm.py's roundings, o rounded to v's dtype first), formed by the output kernel.
    """
    out = _check_arguments(q, k, v, a, b, A_log, dt_bias, chunk_size, out, dot_precision, output_norm)
    check_tensor("state", state, shape=(v.shape[1], q.shape[2], v.shape[2]), dtype=torch.float32, contiguous=True)
    check_same_device(v=v, state=state)
    if q.shape[0] == 0:
        return out

    scratch = chunk_scratch(q, v, dot_precision, chunk_size)
    launch_prepare(q, k, v, a, b, A_log, dt_bias, scratch)
    launch_state_pass(state, scratch)
    launch_output(q, k, out, scratch, output_norm)
    return out


def gated_delta_rule_chunked_packed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    states: torch.Tensor,
    blocks: torch.Tensor,
    chunk_size: int | None = None,
    out: torch.Tensor | None = None,
    dot_precision: str | None = None,
    output_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Prefill of the sequences of a packed layout (operators/packed.py): q, k, v, a, b their rows [T, ...], blocks
    [T / ALIGN, 4] where they lie; states [S, Hv, Dk, Dv] float32, every slot's: each sequence starts from its
    slot's state and leaves its final state there. o [T, Hv, Dv] (or its gated norm, output_norm as
    gated_delta_rule_chunked's): padding rows zero. Chunks of chunk_size_for(T) unless chunk_size says."""
    out = _check_arguments(q, k, v, a, b, A_log, dt_bias, chunk_size, out, dot_precision, output_norm)
    check_blocks(blocks, q.shape[0])
    check_tensor("states", states, shape=(None, v.shape[1], q.shape[2], v.shape[2]), dtype=torch.float32,
                 contiguous=True)
    check_same_device(v=v, states=states, blocks=blocks)
    if q.shape[0] == 0:
        return out

    scratch = chunk_scratch(q, v, dot_precision, chunk_size)
    launch_prepare(q, k, v, a, b, A_log, dt_bias, scratch, blocks)
    launch_state_pass(states, scratch, blocks)
    launch_output(q, k, out, scratch, output_norm, blocks)
    return out


class _Scratch(NamedTuple):
    """What kernel 1 writes for kernels 2 and 3, what kernel 2 writes for kernel 3, and the precisions."""
    chunk: int  # the chunk's rows, C
    prepare_dtype: torch.dtype  # the operands of kernel 1's products but the inverse's
    prepare_precision: str
    dot_dtype: torch.dtype  # the operands of kernels 2 and 3, and the dtype of W, U, Q K^T, V' and the chunk states
    product_precision: str  # the precision of kernels 2 and 3's products
    w: torch.Tensor  # [Hv, T, Dk]
    u: torch.Tensor  # [Hv, T, Dv] in dot_dtype
    scores_in_output: bool  # kernel 3 forms the chunks' scores (where kernel 1 is split)
    qk: torch.Tensor  # [chunks, Hv, C, C], the causal lower triangle written (empty where kernel 3 forms them)
    decay: torch.Tensor  # [Hv, T] float32, G
    decayed_keys: torch.Tensor  # [Hv, T, Dk], diag(exp(G_C - G)) K of each chunk (normalised keys)
    system: torch.Tensor  # [chunks, Hv, C, C] float32: kernel 1's own, where it forms (I + A)^-1
    new_values: torch.Tensor  # [Hv, T, Dv], V'
    chunk_states: torch.Tensor  # [chunks, Hv, Dk, Dv], the state at each chunk's start


def chunk_size_for(length: int) -> int:
    """The chunk size gated_delta_rule_chunked(chunk_size=None) takes for a prompt of `length` tokens."""
    return SHORT_CHUNK if length <= SHORT_CHUNK_TOKENS else CHUNK


def chunk_scratch(q, v, dot_precision=None, chunk_size=None) -> _Scratch:
    """The buffers the stages write for the next ones (what gated_delta_rule_chunked allocates per call)."""
    if v.dtype == torch.float32 or dot_precision == "ieee":
        prepare_precision, dot_dtype, product_precision = "ieee", torch.float32, "ieee"
    elif dot_precision == "tf32":
        prepare_precision, dot_dtype, product_precision = "tf32", torch.float32, "tf32"
    else:
        prepare_precision, dot_dtype, product_precision = "tf32", v.dtype, "tf32"
    prepare_dtype = dot_dtype  # (see the module docstring, Precision)
    (length, value_heads, value_dim), key_dim, device = v.shape, q.shape[2], v.device
    chunk = chunk_size or chunk_size_for(length)
    chunks = triton.cdiv(length, chunk)
    scores_in_output = length > SPLIT_PREPARE_TOKENS
    return _Scratch(
        chunk, prepare_dtype, prepare_precision, dot_dtype, product_precision,
        w=torch.empty(value_heads, length, key_dim, device=device, dtype=dot_dtype),
        u=torch.empty(value_heads, length, value_dim, device=device, dtype=dot_dtype),
        scores_in_output=scores_in_output,
        qk=torch.empty(0 if scores_in_output else chunks, value_heads, chunk, chunk, device=device, dtype=dot_dtype),
        decay=torch.empty(value_heads, length, device=device, dtype=torch.float32),
        decayed_keys=torch.empty(value_heads, length, key_dim, device=device, dtype=dot_dtype),
        system=torch.empty(chunks, value_heads, chunk, chunk, device=device, dtype=torch.float32),
        new_values=torch.empty(value_heads, length, value_dim, device=device, dtype=dot_dtype),
        chunk_states=torch.empty(chunks, value_heads, key_dim, value_dim, device=device, dtype=dot_dtype),
    )


def _prepare_arguments(q, k, v, a, b, scratch: _Scratch):
    """Kernel 1's grid size (chunks), its shape constexprs, value constexprs and strides."""
    (length, value_heads, value_dim), (key_heads, key_dim) = v.shape, q.shape[1:]
    shapes = dict(V_HEADS=value_heads, GROUP=value_heads // key_heads, K_DIM=key_dim,
                  BLOCK_K=max(16, triton.next_power_of_2(key_dim)), CHUNK_ROWS=scratch.chunk,
                  DOT_DTYPE=TORCH_TO_TRITON[scratch.prepare_dtype], PRECISION=scratch.prepare_precision)
    values = dict(V_DIM=value_dim, BLOCK_V=max(16, triton.next_power_of_2(value_dim)))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0),
               b.stride(0))
    return triton.cdiv(length, scratch.chunk), shapes, values, strides


def _blocks(blocks, scratch: _Scratch) -> torch.Tensor:
    """The kernels' blocks_ptr: the packed layout's blocks, or (one sequence, PACKED False) a stand-in pointer."""
    return scratch.decay if blocks is None else blocks


def launch_prepare(q, k, v, a, b, A_log, dt_bias, scratch: _Scratch, blocks=None) -> None:
    """Kernel 1, or for prompts of more than SPLIT_PREPARE_TOKENS tokens its two parts (launch_inverse, then
    launch_products); arguments checked by gated_delta_rule_chunked, scratch from `chunk_scratch`; blocks: the
    packed layout's (gated_delta_rule_chunked_packed), None for one sequence."""
    length, value_heads, key_dim = v.shape[0], v.shape[1], q.shape[2]
    if length > SPLIT_PREPARE_TOKENS:
        launch_inverse(q, k, v, a, b, A_log, dt_bias, scratch, blocks)
        launch_products(q, k, v, a, b, A_log, dt_bias, scratch, blocks)
        return
    chunks, shapes, values, strides = _prepare_arguments(q, k, v, a, b, scratch)
    _chunk_prepare_kernel[(chunks, value_heads, 2)](
        q, k, v, a, b, A_log, dt_bias, scratch.w, scratch.u, scratch.qk, scratch.decay, scratch.decayed_keys,
        scratch.system, _blocks(blocks, scratch), length, triton.next_power_of_2(chunks), key_dim**-0.5, *strides,
        **shapes, **values, PACKED=blocks is not None)


def launch_inverse(q, k, v, a, b, A_log, dt_bias, scratch: _Scratch, blocks=None) -> None:
    """Kernel 1's first part: G, the decayed keys and each chunk's inverse (I + A)^-1. Grid (chunks, Hv)."""
    chunks, shapes, _, _ = _prepare_arguments(q, k, v, a, b, scratch)
    _chunk_inverse_kernel[(chunks, v.shape[1])](
        k, a, b, A_log, dt_bias, scratch.decay, scratch.decayed_keys, scratch.system, _blocks(blocks, scratch),
        v.shape[0], triton.next_power_of_2(chunks), k.stride(0), k.stride(1), a.stride(0), b.stride(0), **shapes,
        PACKED=blocks is not None)


def launch_products(q, k, v, a, b, A_log, dt_bias, scratch: _Scratch, blocks=None) -> None:
    """Kernel 1's second part, after launch_inverse: each chunk's W and U. Grid (chunks, Hv, 2)."""
    chunks, shapes, values, strides = _prepare_arguments(q, k, v, a, b, scratch)
    _chunk_products_kernel[(chunks, v.shape[1], 2)](
        q, k, v, a, b, A_log, dt_bias, scratch.w, scratch.u, scratch.qk, scratch.system, _blocks(blocks, scratch),
        v.shape[0], triton.next_power_of_2(chunks), q.shape[2]**-0.5, *strides, **shapes, **values,
        PACKED=blocks is not None)


def launch_state_pass(state, scratch: _Scratch, blocks=None) -> None:
    """Kernel 2: the state [Hv, Dk, Dv] carried in place (with blocks, a packed layout's: every slot's [S, Hv, Dk,
    Dv], each sequence's read and written in its slot), V' and the chunk start states written; in Gluon where it
    applies (Hopper, 16-bit operands: state_pass.py), else the Triton kernel."""
    if state_pass.applies(state, scratch.dot_dtype, scratch.chunk):
        state_pass.launch(state, scratch.w, scratch.u, scratch.decayed_keys, scratch.decay, scratch.new_values,
                          scratch.chunk_states, scratch.chunk, blocks)
        return
    launch_triton_state_pass(state, scratch, blocks)


def launch_triton_state_pass(state, scratch: _Scratch, blocks=None) -> None:
    """Kernel 2 in Triton: `_chunk_state_kernel`, grid (Hv, Dv / BLOCK_V)."""
    (value_heads, key_dim, value_dim), length = state.shape[-3:], scratch.decay.shape[1]
    chunks = triton.cdiv(length, scratch.chunk)
    grid = lambda meta: (value_heads, triton.cdiv(value_dim, meta["BLOCK_V"]))  # noqa: E731
    _chunk_state_kernel[grid](
        scratch.decayed_keys, scratch.w, scratch.u, scratch.decay, state, scratch.new_values, scratch.chunk_states,
        _blocks(blocks, scratch), length, chunks, triton.next_power_of_2(chunks),
        V_HEADS=value_heads, K_DIM=key_dim, V_DIM=value_dim,
        CHUNK_ROWS=scratch.chunk, BLOCK_K=max(16, triton.next_power_of_2(key_dim)),
        DOT_DTYPE=TORCH_TO_TRITON[scratch.dot_dtype], PRECISION=scratch.product_precision, PACKED=blocks is not None,
    )


def launch_output(q, k, out, scratch: _Scratch, output_norm=None, blocks=None) -> None:
    """Kernel 3: o (or its gated norm, with output_norm) written into out."""
    (length, value_heads, value_dim), (key_heads, key_dim) = out.shape, q.shape[1:]
    chunks = triton.cdiv(length, scratch.chunk)
    z, weight, eps = output_norm if output_norm is not None else (out, out, 0.0)  # unused stand-ins without it

    def grid(meta):
        return chunks, value_heads, 1 if output_norm is not None else triton.cdiv(value_dim, meta["BLOCK_V"])

    _chunk_output_kernel[grid](
        q, k, scratch.qk, scratch.decay, scratch.new_values, scratch.chunk_states, out, z, weight,
        _blocks(blocks, scratch), length, triton.next_power_of_2(chunks), key_dim**-0.5, eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), z.stride(0),
        PACKED=blocks is not None,
        V_HEADS=value_heads, GROUP=value_heads // key_heads, K_DIM=key_dim, V_DIM=value_dim,
        CHUNK_ROWS=scratch.chunk, BLOCK_K=max(16, triton.next_power_of_2(key_dim)),
        BLOCK_D=max(16, triton.next_power_of_2(value_dim)),
        DOT_DTYPE=TORCH_TO_TRITON[scratch.dot_dtype], PRECISION=scratch.product_precision,
        NORM=output_norm is not None,
        # torch multiplies two tensors of one 16-bit dtype in that dtype; a float32 weight promotes
        ROUND_PRODUCT=output_norm is not None and weight.dtype == out.dtype and out.dtype != torch.float32,
        SCORES_HERE=scratch.scores_in_output, SCORES_DTYPE=TORCH_TO_TRITON[scratch.prepare_dtype],
    )


def gated_delta_rule_chunked_cost(length, key_heads, value_heads, key_dim, value_dim, element_size=2,
                                  chunk_size=None):
    """(bytes, FLOPs) of the floor: q, k, v, a, b in, o out, the float32 state in and out once; the
    chunk's matmuls (A and Q K^T lower halves, the inverse, W, U, W S, Q S, (Q K^T) V', K^T V') at the chunk
    size the call takes (chunk_size=None: chunk_size_for(length))."""
    data = element_size * length * (2 * key_heads * key_dim + 2 * value_heads * value_dim + 2 * value_heads)
    data += 2 * 4 * value_heads * key_dim * value_dim
    n = chunk_size or chunk_size_for(length)
    per_chunk = n * n * (3 * key_dim + 2 * value_dim) + n**3 // 3 + 6 * n * key_dim * value_dim
    return data, triton.cdiv(length, n) * value_heads * per_chunk
