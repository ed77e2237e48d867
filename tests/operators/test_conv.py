"""The causal conv1d + SiLU kernels (prefill and decode step) against the reference math.

CPU (interpreter) tests use float32 / float16 with channel counts that are no multiple of any block
(37, 300), widths 2, 3 and 4, lengths shorter than the state (T < W-1), inside one time block and across
several, inputs as strided row views of a wider buffer, and zero and non-zero incoming state. The prefill's
walking kernel (configs with WALK_BLOCKS > 0, each pinned alone) must match
the reference and the tile kernel bit for bit (y and state), at small blocks on the CPU and with every
walking config of the autotuner's space on the CPU and at the real shape on the GPU. GPU tests use bfloat16
at the real shapes (6144 channels, W = 4).

GPU error bounds: the kernel computes in float32 and rounds once to bf16, so against a float64 reference
from the same bf16 inputs each element is within one rounding: |err| <= 2^-9 |y| (+ float32 summation
order, ~1e-7); we allow rtol 2^-8, atol 1e-5. The conv state is a copy: it must match exactly.
"""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import triton

from qwen_triton.operators.conv import benchmark_cases, causal_conv1d, causal_conv1d_step
from qwen_triton.operators.packed import ALIGN, PackedLayout
from qwen_triton.reference import functional as fn

# the module (the package's `causal_conv1d` is the function)
conv_module = importlib.import_module("qwen_triton.operators.conv.causal_conv1d")

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float16: dict(rtol=2e-3, atol=1e-3)}

# the interpreter converts one-element arrays to scalars in runtime-bounded loops (the walking kernel's)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# the tile kernel's pinned config, and small walking configs for the interpreter: several channel blocks at 37
# and 300 channels, several segments and a partial last time block at a few dozen tokens, one-row time blocks
TILE = triton.Config({"BLOCK_T": 16, "BLOCK_C": 128, "WALK_BLOCKS": 0}, num_warps=4)
SMALL_WALKS = [
    triton.Config({"BLOCK_T": 4, "BLOCK_C": 32, "WALK_BLOCKS": 2}, num_warps=1),
    triton.Config({"BLOCK_T": 1, "BLOCK_C": 16, "WALK_BLOCKS": 3}, num_warps=1),
    triton.Config({"BLOCK_T": 16, "BLOCK_C": 64, "WALK_BLOCKS": 1}, num_warps=2),
]
WALKS = [c for c in conv_module.prefill_config_space() if c.kwargs["WALK_BLOCKS"] > 0]


def describe(config):
    return "walk{BLOCK_T}x{BLOCK_C}x{WALK_BLOCKS}".format(**config.kwargs) + f"w{config.num_warps}"


@contextlib.contextmanager
def pinned_prefill(config):
    """The prefill kernel with `config` alone."""
    kernel = conv_module._causal_conv1d_kernel
    saved = kernel.configs, kernel.cache
    kernel.configs, kernel.cache = [config], {}
    try:
        yield
    finally:
        kernel.configs, kernel.cache = saved


def prefill_with(config, x, weight, state):
    """(y, the new state) of one prefill call with `config` pinned; `state` is not modified."""
    state = state.clone()
    with pinned_prefill(config):
        return causal_conv1d(x, weight, state), state


def strided_rows(rows, channels, dtype, device, seed):
    """x [rows, channels] as a view of a wider buffer (the q | k | v columns of the fused projection)."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, channels + 11, generator=generator).to(device=device, dtype=dtype)
    return wide[:, 5:5 + channels]


def make_weight(channels, width, dtype, device, seed=100):
    generator = torch.Generator().manual_seed(seed)
    # the checkpoint's conv1d.weight [C, 1, W] viewed as [C, W]
    return (torch.randn(channels, 1, width, generator=generator) * 0.5).to(device=device, dtype=dtype)[:, 0, :]


@pytest.mark.parametrize("length", [1, 2, 5, 16, 37, 70])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("initial_state", [False, True])
def test_prefill_matches_reference(device, length, width, initial_state):
    channels, dtype = 37, torch.float32
    x = strided_rows(length, channels, dtype, device, seed=length)
    weight = make_weight(channels, width, dtype, device)
    state = torch.zeros(channels, width - 1, device=device, dtype=dtype)
    if initial_state:
        state.copy_(torch.randn(channels, width - 1))
    ref_out, ref_state = fn.causal_conv1d(x, weight, state.clone())
    out = causal_conv1d(x, weight, state)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(state, ref_state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_wide_and_chained(device, dtype):
    """300 channels over several channel blocks; two calls (the second shorter than W-1) equal one."""
    channels, width, length = 300, 3, 41
    x = strided_rows(length, channels, dtype, device, seed=7)
    weight = make_weight(channels, width, dtype, device)
    initial = torch.randn(channels, width - 1).to(device=device, dtype=dtype)
    ref_out, ref_state = fn.causal_conv1d(x, weight, initial.clone())
    state = initial.clone()
    out = torch.empty(length, channels, device=device, dtype=dtype)
    causal_conv1d(x[:40], weight, state, out=out[:40])
    causal_conv1d(x[40:], weight, state, out=out[40:])
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(state, ref_state)


def check_walk_against_reference_and_tiles(config, length, channels, width, dtype, device, seed):
    """One prefill with the walking `config` pinned, from a random state: y and the new state against the
    reference, and bit for bit against the tile kernel's."""
    x = strided_rows(length, channels, dtype, device, seed=seed)
    weight = make_weight(channels, width, dtype, device)
    initial = torch.randn(channels, width - 1).to(device=device, dtype=dtype)
    ref_out, ref_state = fn.causal_conv1d(x, weight, initial.clone())
    out, state = prefill_with(config, x, weight, initial)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(state, ref_state)
    tile_out, tile_state = prefill_with(TILE, x, weight, initial)
    assert torch.equal(out, tile_out) and torch.equal(state, tile_state)


@pytest.mark.parametrize("length", [1, 2, 3, 5, 16, 17, 40, 100])
@pytest.mark.parametrize("config", SMALL_WALKS, ids=describe)
def test_walking_prefill_matches_reference_and_tiles(device, length, config):
    """The walking kernel against the reference, and bit for bit against the tile kernel (y and state)."""
    check_walk_against_reference_and_tiles(config, length, 37, 4, torch.float32, device, seed=length)


@pytest.mark.parametrize("width", [2, 3, 16])
@pytest.mark.parametrize("length", [2, 20, 53])
def test_walking_prefill_widths(device, width, length):
    """Widths 2, 3 and the widest (a segment of 16 rows holds the W-1 = 15 inputs before the next)."""
    config = triton.Config({"BLOCK_T": 4, "BLOCK_C": 32, "WALK_BLOCKS": 4}, num_warps=1)
    check_walk_against_reference_and_tiles(config, length, 37, width, torch.float16, device, seed=length + width)


@pytest.mark.parametrize("config", [
    triton.Config({"BLOCK_T": 4, "BLOCK_C": 128, "WALK_BLOCKS": 2}, num_warps=1),
    triton.Config({"BLOCK_T": 1, "BLOCK_C": 128, "WALK_BLOCKS": 3}, num_warps=1),
], ids=describe)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_walking_prefill_chained(device, config, dtype):
    """300 channels (no multiple of the block); the state carried over three calls, one shorter than W-1, equals
    one call."""
    channels, width, length = 300, 4, 45
    x = strided_rows(length, channels, dtype, device, seed=8)
    weight = make_weight(channels, width, dtype, device)
    initial = torch.randn(channels, width - 1).to(device=device, dtype=dtype)
    ref_out, ref_state = fn.causal_conv1d(x, weight, initial.clone())
    whole_out, whole_state = prefill_with(config, x, weight, initial)
    state = initial.clone()
    out = torch.empty(length, channels, device=device, dtype=dtype)
    with pinned_prefill(config):
        for begin, end in ((0, 17), (17, 19), (19, length)):
            causal_conv1d(x[begin:end], weight, state, out=out[begin:end])
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(state, ref_state) and torch.equal(whole_state, ref_state)
    assert torch.equal(out, whole_out)


@pytest.mark.parametrize("config", WALKS, ids=describe)
def test_walking_config_space(device, config):
    """Every walking config of the autotuner's space, at 300 channels (one channel block, masked) and a
    length that ends inside a time block: bit for bit the tile kernel."""
    channels, width, dtype = 300, 4, torch.float16
    weight = make_weight(channels, width, dtype, device)
    initial = torch.randn(channels, width - 1).to(device=device, dtype=dtype)
    for length in (1, 2, 70):
        x = strided_rows(length, channels, dtype, device, seed=length)
        out, state = prefill_with(config, x, weight, initial)
        tile_out, tile_state = prefill_with(TILE, x, weight, initial)
        assert torch.equal(out, tile_out) and torch.equal(state, tile_state), length


def test_pick_is_one_config():
    """PREFILL_PICK and LONG_PREFILL_PICK each name exactly one config of the space: a tile and a walk."""
    space = conv_module.prefill_config_space()
    for pick, walks in ((conv_module.PREFILL_PICK, False), (conv_module.LONG_PREFILL_PICK, True)):
        kept = conv_module.keep_preferred(space, pick)
        assert len(kept) == 1 and len(space) > 1 and (kept[0].kwargs["WALK_BLOCKS"] > 0) == walks
    assert all(conv_module.rows_per_program(c.kwargs) >= conv_module.MIN_BLOCK_T for c in space)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_step_matches_reference(device, batch, width, dtype):
    channels = 37
    x = strided_rows(batch, channels, dtype, device, seed=batch)
    weight = make_weight(channels, width, dtype, device)
    state = torch.randn(batch, channels, width - 1).to(device=device, dtype=dtype)
    ref_out, ref_state = fn.causal_conv1d_step(x, weight, state.clone())
    out = torch.empty(batch, channels, device=device, dtype=dtype)
    assert causal_conv1d_step(x, weight, state, out=out) is out
    # the reference multiplies and sums in the activation dtype; the kernel in float32
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    assert torch.equal(state, ref_state)


def test_step_over_slots_equals_each_slot_alone(device):
    """Rows over conv-state slots [3, 1] of 5, and a padding row (slot -1): each row's output and its slot's state
    as that slot stepped alone, bit for bit; the other slots untouched, the padding row's output unwritten."""
    channels, width = 37, 4
    x = strided_rows(3, channels, torch.float32, device, seed=11)
    weight = make_weight(channels, width, torch.float32, device)
    initial = torch.randn(5, channels, width - 1).to(device)
    state = initial.clone()
    out = torch.full((3, channels), 7.0, device=device)
    causal_conv1d_step(x, weight, state, out=out, slots=torch.tensor([3, 1, -1], device=device, dtype=torch.int32))
    alone = initial.clone()
    for row, slot in enumerate([3, 1]):
        step = causal_conv1d_step(x[row:row + 1], weight, alone,
                                  slots=torch.tensor([slot], device=device, dtype=torch.int32))
        assert torch.equal(out[row], step[0])
        ref_out, ref_state = fn.causal_conv1d_step(x[row:row + 1], weight, initial[slot:slot + 1].clone())
        torch.testing.assert_close(out[row:row + 1], ref_out, **TOLERANCE[torch.float32])
        assert torch.equal(state[slot], ref_state[0])
    assert torch.equal(state, alone)
    assert torch.equal(state[[0, 2, 4]], initial[[0, 2, 4]])
    assert (out[2] == 7.0).all()


def test_steps_continue_prefill(device):
    """Prefill of T tokens then steps == prefill of all of them (the state layouts agree)."""
    channels, width, length, dtype = 37, 4, 10, torch.float32
    x = strided_rows(length, channels, dtype, device, seed=3)
    weight = make_weight(channels, width, dtype, device)
    whole_state = torch.zeros(channels, width - 1, device=device)
    whole = causal_conv1d(x, weight, whole_state)
    state = torch.zeros(1, channels, width - 1, device=device)
    prefix = causal_conv1d(x[:6], weight, state[0])
    steps = [causal_conv1d_step(x[t:t + 1], weight, state) for t in range(6, length)]
    torch.testing.assert_close(torch.cat([prefix, *steps]), whole, **TOLERANCE[dtype])
    assert torch.equal(state[0], whole_state)


def test_deterministic(device):
    channels, width = 300, 4
    x = strided_rows(50, channels, torch.float16, device, seed=4)
    weight = make_weight(channels, width, torch.float16, device)
    runs = []
    for _ in range(2):
        state = torch.ones(channels, width - 1, device=device, dtype=torch.float16)
        step_state = torch.ones(2, channels, width - 1, device=device, dtype=torch.float16)
        runs.append((causal_conv1d(x, weight, state), state, causal_conv1d_step(x[:2], weight, step_state),
                     step_state))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_prompt_longer_than_the_grid(device):
    # the time blocks are the grid's second dimension (at most 65535 of at least 16 tokens)
    rows = 65535 * 16 + 1
    x = torch.zeros(1, 2, device=device).expand(rows, 2)  # no memory: a broadcast view
    with pytest.raises(ValueError, match="tokens in one prefill call"):
        causal_conv1d(x, torch.randn(2, 4, device=device), torch.zeros(2, 3, device=device))


def test_argument_errors(device):
    x = torch.randn(5, 8, device=device)
    weight = torch.randn(8, 4, device=device)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, torch.zeros(8, 4, device=device))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d(x, weight, torch.zeros(3, 8, device=device).t())
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, weight[:4], torch.zeros(8, 3, device=device))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, torch.randn(8, 20, device=device), torch.zeros(8, 19, device=device))
    with pytest.raises(ValueError, match="^x "):
        causal_conv1d(x.t(), weight, torch.zeros(8, 3, device=device))
    with pytest.raises(ValueError, match="out"):
        causal_conv1d(x, weight, torch.zeros(8, 3, device=device), out=torch.empty(5, 8, device=device).half())
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_step(x, weight, torch.zeros(4, 8, 3, device=device))
    with pytest.raises(ValueError, match="^x "):
        causal_conv1d_step(x.int(), weight, torch.zeros(5, 8, 3, device=device))


# ---- packed prefill: several sequences in one call -------------------------------------------------------------
PACKED_LENGTHS = (1, 5, 63, 64, 65, 130)  # inside the first block, one block, just over, two blocks and more
PACKED_SLOTS = (4, 0, 6, 2, 5, 1)  # any order; slot 3 holds no sequence


def packed_inputs(lengths, channels, width, dtype, device, seed, tokens=None, slots=PACKED_SLOTS):
    """A packed layout of `lengths` in `slots` (T = tokens rows), its x as a strided view with NaN in every padding
    row (a padding row read by a token would show), the weight and random conv states of 7 slots."""
    layout = PackedLayout.of(lengths, slots=slots[:len(lengths)], tokens=tokens)
    wide = strided_rows(layout.tokens, channels, dtype, device, seed=seed)
    valid = torch.zeros(layout.tokens, dtype=torch.bool, device=device)
    for first, length in zip(layout.firsts, layout.lengths):
        valid[first:first + length] = True
    wide.masked_fill_(~valid[:, None], float("nan"))
    weight = make_weight(channels, width, dtype, device)
    states = torch.randn(7, channels, width - 1).to(device=device, dtype=dtype)
    return layout, wide, weight, states


def check_packed_against_one_call_each(layout, x, weight, states, config):
    """The packed call with `config` pinned: each sequence's y and its slot's state equal one call each, bit for
    bit, and the reference; padding rows unwritten; the slots without a sequence untouched."""
    blocks = layout.blocks().to(x.device)
    packed_states = states.clone()
    out = torch.full_like(x, 7.0)
    with pinned_prefill(config):
        assert conv_module.causal_conv1d_packed(x, weight, packed_states, blocks, out=out) is out
    for rows, y, slot in zip(layout.unpack(x), layout.unpack(out), layout.slots):
        alone_state = states[slot].clone()
        with pinned_prefill(config):
            alone = causal_conv1d(rows, weight, alone_state)
        assert torch.equal(y, alone) and torch.equal(packed_states[slot], alone_state), slot
        ref_out, ref_state = fn.causal_conv1d(rows, weight, states[slot].clone())
        torch.testing.assert_close(y, ref_out, **TOLERANCE[x.dtype])
        assert torch.equal(alone_state, ref_state)
    written = layout.token_slots().to(x.device) >= 0
    assert (out[~written] == 7.0).all()
    others = [slot for slot in range(states.shape[0]) if slot not in layout.slots]
    assert torch.equal(packed_states[others], states[others])


@pytest.mark.parametrize("config", [TILE, triton.Config({"BLOCK_T": 4, "BLOCK_C": 32, "WALK_BLOCKS": 2}, num_warps=1),
                                    triton.Config({"BLOCK_T": 16, "BLOCK_C": 64, "WALK_BLOCKS": 4}, num_warps=2)],
                         ids=["tile", "walk4x32x2", "walk16x64x4"])
def test_packed_prefill_equals_one_call_each(device, config):
    """Six sequences of 1 to 130 tokens in slots in any order, a bucket's tail of one block after them, width 4
    (a token near its sequence's start reads its slot's state, three of its inputs)."""
    layout, x, weight, states = packed_inputs(PACKED_LENGTHS, 37, 4, torch.float32, device, seed=30,
                                              tokens=640)
    check_packed_against_one_call_each(layout, x, weight, states, config)


@pytest.mark.parametrize("width", [2, 16])
def test_packed_prefill_widths(device, width):
    """The narrowest conv and the widest (a sequence shorter than its W-1 inputs keeps part of its old state)."""
    layout, x, weight, states = packed_inputs((3, 70, 1), 21, width, torch.float32, device, seed=31)
    check_packed_against_one_call_each(layout, x, weight, states, TILE)


def test_packed_prefill_prunes_the_configs_that_straddle_blocks():
    """A packed program's rows must lie in one aligned block: the configs whose rows do not divide 64 go; the tile
    and the long-prompt pick stay."""
    space = conv_module.prefill_config_space()
    kept = conv_module._prune_prefill(space, {"length_bucket": 4096}, PACKED=True)
    assert kept and all(ALIGN % conv_module.rows_per_program(c.kwargs) == 0 for c in kept)
    straddling = [c for c in space if ALIGN % conv_module.rows_per_program(c.kwargs)]
    assert straddling and not any(c in kept for c in straddling)
    for bucket in (128, 4096):
        pick = conv_module._prune_prefill(space, {"length_bucket": bucket}, PACKED=True)
        assert pick == conv_module._prune_prefill(space, {"length_bucket": bucket}), bucket


def test_packed_prefill_argument_errors(device):
    layout = PackedLayout.of([5, 70])
    x = torch.randn(layout.tokens, 8, device=device)
    weight = torch.randn(8, 4, device=device)
    blocks = layout.blocks().to(device)
    with pytest.raises(ValueError, match="conv_states"):
        conv_module.causal_conv1d_packed(x, weight, torch.zeros(8, 3, device=device), blocks)
    with pytest.raises(ValueError, match="blocks"):
        conv_module.causal_conv1d_packed(x, weight, torch.zeros(2, 8, 3, device=device), blocks[:1])
    with pytest.raises(ValueError, match="multiple of 64"):
        conv_module.causal_conv1d_packed(x[:100], weight, torch.zeros(2, 8, 3, device=device), blocks)
    with pytest.raises(ValueError, match="blocks"):
        conv_module.causal_conv1d_packed(x, weight, torch.zeros(2, 8, 3, device=device), blocks.long())


# ---- GPU, bfloat16, the real shapes ---------------------------------------------------------------

CHANNELS, WIDTH = 6144, 4


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [640, 4096])
def test_gpu_packed_prefill(tokens):
    """The real shape in bf16, a packed layout of eight prompts (the length bucket of 640 rows runs the tile pick,
    of 4096 the walking pick): each prompt as one call, bit for bit, states included; padding rows unwritten."""
    lengths = (1, 5, 63, 64, 65, 130) if tokens == 640 else (1, 5, 63, 64, 65, 130, 1500, 1900)
    layout, x, weight, states = packed_inputs(lengths, CHANNELS, WIDTH, torch.bfloat16, "cuda", seed=32,
                                              tokens=tokens, slots=(4, 0, 6, 2, 5, 1, 3, 7))
    states = torch.cat([states, states])  # 14 slots
    blocks = layout.blocks().cuda()
    packed_states = states.clone()
    out = torch.full_like(x, 7.0)
    conv_module.causal_conv1d_packed(x, weight, packed_states, blocks, out=out)
    for rows, y, slot in zip(layout.unpack(x), layout.unpack(out), layout.slots):
        alone_state = states[slot].clone()
        alone = causal_conv1d(rows, weight, alone_state)
        assert torch.equal(y, alone) and torch.equal(packed_states[slot], alone_state), slot
    assert (out[layout.token_slots().cuda() < 0] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("length", [128, 4096])
def test_gpu_prefill(length):
    x = strided_rows(length, CHANNELS, torch.bfloat16, "cuda", seed=20)
    weight = make_weight(CHANNELS, WIDTH, torch.bfloat16, "cuda")
    initial = torch.randn(CHANNELS, WIDTH - 1, device="cuda").to(torch.bfloat16)
    # float64: a float32 F.conv1d may run in TF32 on the GPU
    ref_out, ref_state = fn.causal_conv1d(x.double(), weight.double(), initial.double())
    state = initial.clone()
    out = causal_conv1d(x, weight, state)
    torch.testing.assert_close(out.double(), ref_out, rtol=2**-8, atol=1e-5)
    assert torch.equal(state.double(), ref_state)
    again = initial.clone()
    assert torch.equal(causal_conv1d(x, weight, again), out)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [128, 4096])
@pytest.mark.parametrize("config", WALKS, ids=describe)
def test_gpu_walking_prefill(length, config):
    """Each walking config at the real shape (strided x): bit for bit the tile kernel's pinned config, which
    test_gpu_prefill checks against the reference."""
    x = strided_rows(length, CHANNELS, torch.bfloat16, "cuda", seed=20)
    weight = make_weight(CHANNELS, WIDTH, torch.bfloat16, "cuda")
    initial = torch.randn(CHANNELS, WIDTH - 1, device="cuda").to(torch.bfloat16)
    tile_out, tile_state = prefill_with(TILE, x, weight, initial)
    out, state = prefill_with(config, x, weight, initial)
    assert torch.equal(out, tile_out)
    assert torch.equal(state, tile_state)
    ref_out, _ = fn.causal_conv1d(x.double(), weight.double(), initial.double())
    torch.testing.assert_close(out.double(), ref_out, rtol=2**-8, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_step(batch):
    x = strided_rows(batch, CHANNELS, torch.bfloat16, "cuda", seed=21)
    weight = make_weight(CHANNELS, WIDTH, torch.bfloat16, "cuda")
    initial = torch.randn(batch, CHANNELS, WIDTH - 1, device="cuda").to(torch.bfloat16)
    ref_out, ref_state = fn.causal_conv1d_step(x.double(), weight.double(), initial.double())
    state = initial.clone()
    out = causal_conv1d_step(x, weight, state)
    torch.testing.assert_close(out.double(), ref_out, rtol=2**-8, atol=1e-5)
    assert torch.equal(state.double(), ref_state)


@pytest.mark.gpu
def test_gpu_step_cuda_graph():
    """The decode step captured once and replayed: the state advances in place, results match eager."""
    x = strided_rows(2, CHANNELS, torch.bfloat16, "cuda", seed=22)
    weight = make_weight(CHANNELS, WIDTH, torch.bfloat16, "cuda")
    state = torch.randn(2, CHANNELS, WIDTH - 1, device="cuda").to(torch.bfloat16)
    out = torch.empty(2, CHANNELS, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes
            causal_conv1d_step(x, weight, state, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        causal_conv1d_step(x, weight, state, out=out)
    for _ in range(3):
        eager_state = state.clone()
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager_out = causal_conv1d_step(x, weight, eager_state)
        assert torch.equal(out, eager_out)
        assert torch.equal(state, eager_state)


@pytest.mark.gpu
def test_gpu_step_over_slots_in_a_cuda_graph():
    """The step captured once over slots read from a device buffer, replayed with new slot sets (a padding row
    among them): each row's output and its slot's state as that slot stepped alone, the other slots untouched."""
    batch, slot_count = 3, 6
    x = strided_rows(batch, CHANNELS, torch.bfloat16, "cuda", seed=23)
    weight = make_weight(CHANNELS, WIDTH, torch.bfloat16, "cuda")
    state = torch.randn(slot_count, CHANNELS, WIDTH - 1, device="cuda").to(torch.bfloat16)
    out = torch.empty(batch, CHANNELS, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes
            causal_conv1d_step(x, weight, state, out=out, slots=slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        causal_conv1d_step(x, weight, state, out=out, slots=slots)
    for new_slots in ([5, 0, 3], [2, 4, -1], [1, 5, 0]):
        slots.copy_(torch.tensor(new_slots, dtype=torch.int32))
        x.copy_(torch.randn_like(x))
        before = state.clone()
        graph.replay()
        torch.cuda.synchronize()
        for row, slot in enumerate(new_slots):
            if slot < 0:
                continue
            alone = before.clone()
            step = causal_conv1d_step(x[row:row + 1], weight, alone,
                                      slots=torch.tensor([slot], device="cuda", dtype=torch.int32))
            assert torch.equal(out[row], step[0]), (new_slots, row)
            assert torch.equal(state[slot], alone[slot]), (new_slots, row)
        untouched = [slot for slot in range(slot_count) if slot not in new_slots]
        assert torch.equal(state[untouched], before[untouched])


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
        assert case["bytes"] > 0 and case["flops"] > 0, case["name"]
    torch.cuda.synchronize()
