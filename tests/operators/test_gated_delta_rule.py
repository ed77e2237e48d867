"""The gated delta rule kernels (gates, chunked prefill, recurrent decode, output norm) against the
reference math (qwen_triton.reference.functional).

CPU (interpreter) tests use float32 / float16 at small, awkward shapes: Dk 24 / Dv 40 (Dk != Dv, neither
a power of two), Dk 12 / Dv 20 (below the 16-wide dot minimum), Hv = 2 Hk, lengths 1, 17, 64, 65, 130
(inside one chunk, one full chunk, crossing chunk boundaries), inputs as strided views of one fused
projection row [q | k | v | z | b | a | pad]. GPU tests use bfloat16 at the real Qwen3.5-0.8B shapes
(Hk = Hv = 16, Dk = Dv = 128).

GPU error bounds. bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3); the reference runs in
float32 from the same bf16 inputs. The recurrent kernel and the norms are float32 inside and round once
at the output: relative error (Frobenius) ~u, bounded by 5e-3. The chunked kernel by default rounds the
state and V' to bf16 as matmul operands (float32 accumulation, the state itself float32) and uses tf32
for the chunk-local products: a float32 torch emulation of exactly those roundings at the real shapes
(T = 4096, random bf16 inputs, transformers-like A_log / dt_bias) gives output error 3.2e-3 (Frobenius),
4.8e-3 (max, relative to max |o|) and final-state error 2.5e-3 (Frobenius); the bounds below are ~4x
that (1.5e-2, 2e-2, 1e-2). A masking, indexing or decay bug gives errors of order 1.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from qwen_triton.operators.conv import causal_conv1d_step
from qwen_triton.operators.gated_delta_rule import chunk as chunk_module
from qwen_triton.operators.gated_delta_rule import fused_decode as fused_decode_module
from qwen_triton.operators.gated_delta_rule import state_pass
from qwen_triton.operators.gated_delta_rule import (
    benchmark_cases,
    gated_delta_rule_chunked,
    gated_delta_rule_decode_fused,
    gated_delta_rule_recurrent,
    gated_rms_norm,
    gating,
)
from qwen_triton.operators.packed import PackedLayout
from qwen_triton.reference import functional as fn
from tests.support import run_without_interpreter

# the interpreter converts one-element arrays to scalars in runtime-bounded loops (numpy deprecation)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


# ---- helpers -------------------------------------------------------------------------------------


def make_inputs(rows, key_heads, value_heads, key_dim, value_dim, dtype, device, seed=0):
    """Views into one fused projection buffer [rows, q | k | v | z | b | a | pad], and the gate weights."""
    generator = torch.Generator().manual_seed(seed)
    key_width, value_width = key_heads * key_dim, value_heads * value_dim
    widths = [key_width, key_width, value_width, value_width, value_heads, value_heads, 3]
    fused = torch.randn(rows, sum(widths), generator=generator).to(device=device, dtype=dtype)
    q, k, v, z, b, a, _ = fused.split(widths, dim=1)
    # transformers' initialisation: A ~ U(1, 16), softplus(dt_bias) ~ logU(1e-3, 1e-1); a wider a spreads
    # the decays from ~1 (long memory, so the carried state matters) to ~e^-16 per step
    A_log = torch.empty(value_heads).uniform_(1, 16, generator=generator).log().to(device)
    dt = torch.exp(torch.empty(value_heads).uniform_(math.log(1e-3), math.log(1e-1), generator=generator))
    dt_bias = (dt + torch.log(-torch.expm1(-dt))).to(device)
    a = a.mul_(3.0)
    return dict(
        q=q.view(rows, key_heads, key_dim), k=k.view(rows, key_heads, key_dim),
        v=v.view(rows, value_heads, value_dim), z=z, b=b, a=a, A_log=A_log, dt_bias=dt_bias,
    )


def random_state(shape, device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator) * 0.5).to(device)


def reference_chunked(inputs, state):
    g, beta = fn.gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    return fn.gated_delta_rule_chunked(inputs["q"], inputs["k"], inputs["v"], g, beta, state)


def reference_recurrent(inputs, state):
    g, beta = fn.gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    return fn.gated_delta_rule_recurrent(inputs["q"], inputs["k"], inputs["v"], g, beta, state)


def kernel_arguments(inputs):
    return [inputs[name] for name in ("q", "k", "v", "a", "b", "A_log", "dt_bias")]


def frobenius_error(ours, reference):
    return float((ours.float() - reference.float()).norm() / reference.float().norm())


def max_error(ours, reference):
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())


TOLERANCE = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=2e-3)}


# ---- gating --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gating(device, dtype):
    inputs = make_inputs(37, 2, 5, 8, 8, dtype, device)
    inputs["a"][0, :3] = torch.tensor([30.0, -30.0, 0.0], dtype=dtype)  # softplus's threshold and tail
    g, beta = gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    ref_g, ref_beta = fn.gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    assert g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(beta, ref_beta.float(), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-3)
    out = (torch.empty_like(g), torch.empty_like(beta))
    assert gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"], out=out)[0] is out[0]
    assert torch.equal(out[0], g) and torch.equal(out[1], beta)


# ---- chunked prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 17, 64, 65, 130])
@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_chunked_matches_reference(device, length, initial_state, chunk_size):
    key_heads, value_heads, key_dim, value_dim = 1, 2, 24, 40
    inputs = make_inputs(length, key_heads, value_heads, key_dim, value_dim, torch.float32, device, seed=length)
    shape = (value_heads, key_dim, value_dim)
    state = random_state(shape, device) if initial_state else torch.zeros(shape, device=device)
    ref_out, ref_state = reference_chunked(inputs, state.clone())
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, ref_state, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("shape", [(1, 1, 12, 20), (3, 3, 32, 16)])
def test_chunked_small_heads(device, shape):
    key_heads, value_heads, key_dim, value_dim = shape
    inputs = make_inputs(80, key_heads, value_heads, key_dim, value_dim, torch.float32, device, seed=3)
    state = random_state((value_heads, key_dim, value_dim), device)
    ref_out, ref_state = reference_chunked(inputs, state.clone())
    out = torch.full((80, value_heads, value_dim), float("nan"), device=device)
    assert gated_delta_rule_chunked(*kernel_arguments(inputs), state, out=out) is out
    torch.testing.assert_close(out, ref_out, **TOLERANCE[torch.float32])
    torch.testing.assert_close(state, ref_state, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_chunked_float16(device, chunk_size):
    """16-bit activations: the state pass's and the output kernel's products take float16 operands, and the
    chunk start states and V' pass between them in float16 (the default precision mix)."""
    inputs = make_inputs(100, 2, 4, 24, 40, torch.float16, device, seed=4)
    state = random_state((4, 24, 40), device)
    ref_out, ref_state = reference_chunked(inputs, state.clone())
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
    assert out.dtype == torch.float16
    assert frobenius_error(out, ref_out) < 5e-3
    assert frobenius_error(state, ref_state) < 5e-3
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLERANCE[torch.float16])


@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
@pytest.mark.parametrize("split", [False, True])
def test_chunked_long_memory(device, monkeypatch, chunk_size, split):
    """16-bit activations (U, V' and the chunk start states in float16) with long memory, G over the first 64
    tokens from -0.04 to -1.05, kernel 1 whole or in two parts: make_inputs' decays mostly forget the state
    within a chunk of 64 (G there mostly below -12), where a wrong sign on a state step's product went unseen
    by the tests above (commit ca65ef3: docs/decisions.md, D71)."""
    inputs = make_inputs(150, 2, 4, 24, 40, torch.float16, device, seed=9)
    inputs["a"] = (inputs["a"].float() / 6 - 3).to(torch.float16)
    monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", -1 if split else 150)
    initial = random_state((4, 24, 40), device)
    ref_out, ref_state = reference_chunked(inputs, initial.clone())
    state = initial.clone()
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
    assert frobenius_error(out, ref_out) < 2e-3
    assert frobenius_error(state, ref_state) < 2e-3
    assert frobenius_error(state, initial) > 0.1  # the step moved the state


def test_chunked_state_equals_recurrent_steps(device):
    """The chunked form over T tokens == the recurrent kernel run T times (outputs and final state)."""
    length = 66
    inputs = make_inputs(length, 1, 2, 16, 24, torch.float32, device, seed=5)
    initial = random_state((2, 16, 24), device)
    chunked_state = initial.clone()
    chunked_out = gated_delta_rule_chunked(*kernel_arguments(inputs), chunked_state)
    step_state = initial.clone()[None]
    for t in range(length):
        step = [x[t:t + 1] for x in kernel_arguments(inputs)[:5]] + [inputs["A_log"], inputs["dt_bias"]]
        step_out = gated_delta_rule_recurrent(*step, step_state)
        torch.testing.assert_close(chunked_out[t], step_out[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(chunked_state, step_state[0], rtol=1e-4, atol=1e-5)


def test_chunked_in_two_calls_equals_one(device):
    """A prefill split at a chunk-crossing point carries the state exactly as one call does (the whole in
    chunks of 64, its parts in chunks of 32: the chunk size changes only roundings)."""
    inputs = make_inputs(90, 1, 2, 24, 40, torch.float32, device, seed=6)
    whole_state = torch.zeros(2, 24, 40, device=device)
    whole = gated_delta_rule_chunked(*kernel_arguments(inputs), whole_state, chunk_size=64)
    split_state = torch.zeros_like(whole_state)
    first = gated_delta_rule_chunked(*[x[:33] for x in kernel_arguments(inputs)[:5]], inputs["A_log"],
                                     inputs["dt_bias"], split_state)
    second = gated_delta_rule_chunked(*[x[33:] for x in kernel_arguments(inputs)[:5]], inputs["A_log"],
                                      inputs["dt_bias"], split_state)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(split_state, whole_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_chunked_start_states_are_the_prefix_states(device, chunk_size):
    """The state pass's chunk start states: chunk c's is the final state of a call on the first C c tokens."""
    length, heads, key_dim, value_dim = 130, 2, 24, 40
    inputs = make_inputs(length, 1, heads, key_dim, value_dim, torch.float32, device, seed=8)
    initial = random_state((heads, key_dim, value_dim), device)
    scratch = chunk_module.chunk_scratch(inputs["q"], inputs["v"], None, chunk_size)
    chunk_module.launch_prepare(*kernel_arguments(inputs), scratch)
    chunk_module.launch_state_pass(initial.clone(), scratch)
    chunks = -(-length // chunk_size)
    assert scratch.chunk_states.shape == (chunks, heads, key_dim, value_dim)
    torch.testing.assert_close(scratch.chunk_states[0], initial, rtol=0, atol=0)
    for chunk in range(1, chunks):
        prefix = [x[:chunk * chunk_size] for x in kernel_arguments(inputs)[:5]]
        state = initial.clone()
        gated_delta_rule_chunked(*prefix, inputs["A_log"], inputs["dt_bias"], state, chunk_size=chunk_size)
        torch.testing.assert_close(scratch.chunk_states[chunk], state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("length, chunk_size", [(17, 32), (65, 64), (130, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_split_prepare_equals_one_kernel(device, monkeypatch, length, chunk_size, dtype):
    """Kernel 1 in two parts (prompts of more than SPLIT_PREPARE_TOKENS tokens): the same scratch, bit for bit,
    as the one kernel writes under the interpreter (the same arithmetic in the same order); on the GPU the
    tiles of another warp count may sum in another order, so there within float32 roundings. (The scores: the
    one kernel's; where kernel 1 is split kernel 3 forms them, test_chunked_scores_in_the_output_kernel.) And
    the call through the two parts against the reference."""
    inputs = make_inputs(length, 1, 2, 24, 40, dtype, device, seed=length)
    scratches = {}
    for split in (False, True):
        monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", -1 if split else length)
        scratch = chunk_module.chunk_scratch(inputs["q"], inputs["v"], None, chunk_size)
        for name in ("w", "u", "qk", "decay", "decayed_keys"):
            getattr(scratch, name).fill_(float("nan"))  # every entry read later must be written
        chunk_module.launch_prepare(*kernel_arguments(inputs), scratch)
        scratches[split] = scratch
    exact = device == "cpu"
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    assert scratches[True].qk.numel() == 0 and not scratches[False].qk[..., lower].isnan().any()
    for name in ("w", "u", "decay", "decayed_keys"):
        one, two = getattr(scratches[False], name), getattr(scratches[True], name)
        assert not two.isnan().any(), name
        if exact:
            assert torch.equal(one, two), name
        else:
            torch.testing.assert_close(two.float(), one.float(), rtol=1e-3, atol=1e-4)
    state = random_state((2, 24, 40), device)
    ref_out, ref_state = reference_chunked(inputs, state.clone())
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)  # the two parts
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLERANCE[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(state, ref_state, **TOLERANCE[torch.float32])
    else:  # test_chunked_float16's bound
        assert frobenius_error(state, ref_state) < 5e-3


@pytest.mark.parametrize("length, chunk_size, value_dim", [(17, 32, 40), (130, 64, 40), (70, 64, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
def test_chunked_scores_in_the_output_kernel(device, monkeypatch, length, chunk_size, value_dim, dtype, norm):
    """Where kernel 1 is split, kernel 3 forms the chunks' scores itself (the products kernel has no score programs
    and the scratch no scores): the output, its gated norm and the state as when kernel 3 reads the scores the one
    kernel 1 stored, bit for bit under the interpreter (the same arithmetic), within float32 roundings on the GPU;
    and the output against the reference. (80 value columns: two programs of 64 a chunk and head without the
    norm.)"""
    inputs = make_inputs(length, 1, 2, 24, value_dim, dtype, device, seed=length + 1)
    initial = random_state((2, 24, value_dim), device)
    weight = torch.linspace(0.5, 1.5, value_dim, device=device, dtype=dtype)
    output_norm = (inputs["z"], weight, 1e-6) if norm else None
    results = {}
    for here in (True, False):
        monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", -1 if here else length)
        scores = chunk_module.chunk_scratch(inputs["q"], inputs["v"], None, chunk_size).qk
        assert scores.numel() == (0 if here else 2 * -(-length // chunk_size) * chunk_size**2)
        state = initial.clone()
        out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size,
                                       output_norm=output_norm)
        results[here] = (out, state)
    for got, want in zip(results[True], results[False]):
        if device == "cpu":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-3, atol=1e-4)
    if not norm:  # (the norm against norming after: test_chunked_output_norm_equals_norming_after)
        ref_out, _ = reference_chunked(inputs, initial.clone())
        torch.testing.assert_close(results[True][0].float(), ref_out.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                  (torch.float16, torch.float32)])
def test_chunked_output_norm_equals_norming_after(device, dtype, weight_dtype):
    """output_norm: the output kernel writes gated_rms_norm(o, z) (o rounded first, as the norm kernel reads
    it): the same as the two calls, for a head width (40) below its power of two and two chunks."""
    rows, heads, key_dim, value_dim, eps = 70, 3, 16, 40, 1e-6
    inputs = make_inputs(rows, 1, heads, key_dim, value_dim, dtype, device, seed=12)
    weight = (1 + 0.3 * torch.randn(value_dim, generator=torch.Generator().manual_seed(3))).to(device, weight_dtype)
    state = random_state((heads, key_dim, value_dim), device)
    plain_state = state.clone()
    o = gated_delta_rule_chunked(*kernel_arguments(inputs), plain_state)
    expected = gated_rms_norm(o, inputs["z"], weight, eps)
    normed_state = state.clone()
    normed = gated_delta_rule_chunked(*kernel_arguments(inputs), normed_state, output_norm=(inputs["z"], weight, eps))
    assert normed.shape == (rows, heads, value_dim)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(normed.reshape(rows, -1), expected, **tolerance)
    assert not torch.allclose(normed.reshape(rows, -1).float(), o.reshape(rows, -1).float(), atol=1e-2)  # normed
    torch.testing.assert_close(normed_state, plain_state, rtol=0, atol=0)  # the same state pass


def test_chunked_output_norm_arguments(device):
    inputs = make_inputs(8, 1, 2, 16, 16, torch.float32, device, seed=1)
    state = torch.zeros(2, 16, 16, device=device)
    weight = torch.ones(16, device=device)
    with pytest.raises(ValueError, match="tuple"):
        gated_delta_rule_chunked(*kernel_arguments(inputs), state, output_norm=(inputs["z"], weight))
    with pytest.raises(ValueError, match="z"):
        gated_delta_rule_chunked(*kernel_arguments(inputs), state, output_norm=(inputs["z"][:, :-1], weight, 1e-6))
    with pytest.raises(ValueError, match="weight"):
        gated_delta_rule_chunked(*kernel_arguments(inputs), state, output_norm=(inputs["z"], weight[:-1], 1e-6))


@pytest.mark.parametrize("precision", ["tf32", "ieee"])
def test_chunked_precision_options(device, precision):
    inputs = make_inputs(20, 1, 2, 16, 16, torch.float16, device, seed=7)
    state = torch.zeros(2, 16, 16, device=device)
    ref_out, ref_state = reference_chunked(inputs, state.clone())
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, dot_precision=precision)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOLERANCE[torch.float16])
    if device == "cuda" and precision == "tf32":  # tensor-core tf32 (10-bit operands; the interpreter's are exact)
        assert frobenius_error(state, ref_state) < 5e-3  # test_gpu_chunked's bound for the option
    else:
        torch.testing.assert_close(state, ref_state, rtol=1e-3, atol=1e-4)


# ---- packed prefill: several sequences in one call ----------------------------------------------------------
PACKED_LENGTHS = (5, 64, 65, 33)  # inside a chunk, one aligned block, just over, and a chunk of 32 + 1
PACKED_SLOTS = (3, 0, 2, 1)  # any order; slot 4 holds no sequence


def packed_case(dtype, device, seed, tokens=None, value_heads=2):
    """A packed layout of PACKED_LENGTHS (T = tokens rows), its inputs with NaN in every padding row of the fused
    projection (a kernel that read one would show it), and random states of 5 slots."""
    layout = PackedLayout.of(PACKED_LENGTHS, slots=PACKED_SLOTS, tokens=tokens)
    inputs = make_inputs(layout.tokens, 1, value_heads, 24, 40, dtype, device, seed=seed)
    inputs["a"].copy_((inputs["a"].float() / 6 - 1).to(dtype))  # long memory: the carried states matter
    padding = layout.token_slots().to(device) < 0
    inputs["z"]._base[padding] = float("nan")
    states = random_state((5, value_heads, 24, 40), device)
    return layout, inputs, states


def sequence_arguments(inputs, rows: slice):
    return [x[rows] for x in kernel_arguments(inputs)[:5]] + [inputs["A_log"], inputs["dt_bias"]]


def check_packed_against_one_call_each(layout, inputs, states, exact: bool, **options):
    """The packed call against one gated_delta_rule_chunked call per sequence from its slot's state (bit for bit
    where exact, else within float32 roundings) and the reference; padding rows zero; slot 4 untouched."""
    packed_states = states.clone()
    z = options.pop("z", None)
    norm = None if z is None else (z, options.pop("weight"), 1e-6)
    out = chunk_module.gated_delta_rule_chunked_packed(*kernel_arguments(inputs), packed_states,
                                                       layout.blocks().to(states.device), output_norm=norm, **options)
    for first, length, slot in zip(layout.firsts, layout.lengths, layout.slots):
        rows = slice(first, first + length)
        state = states[slot].clone()
        sequence_norm = None if norm is None else (z[rows], *norm[1:])
        alone = gated_delta_rule_chunked(*sequence_arguments(inputs, rows), state, output_norm=sequence_norm,
                                         **options)
        if exact:
            assert torch.equal(out[rows], alone) and torch.equal(packed_states[slot], state), slot
        else:
            torch.testing.assert_close(out[rows], alone, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(packed_states[slot], state, rtol=1e-5, atol=1e-6)
        if norm is None:
            g, beta = fn.gating(inputs["a"][rows], inputs["b"][rows], inputs["A_log"], inputs["dt_bias"])
            ref_out, ref_state = fn.gated_delta_rule_chunked(inputs["q"][rows], inputs["k"][rows], inputs["v"][rows],
                                                             g, beta, states[slot].clone())
            torch.testing.assert_close(out[rows].float(), ref_out.float(), **TOLERANCE[out.dtype])
            torch.testing.assert_close(packed_states[slot], ref_state, rtol=1e-3, atol=1e-4)
    padding = layout.token_slots().to(states.device) < 0
    assert (out[padding] == 0).all()
    assert torch.equal(packed_states[4], states[4])


@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_chunked_packed_equals_one_call_each(device, chunk_size):
    """Four sequences in slots in any order and a bucket's tail of one block: each sequence's output and final
    state as one call from its slot's state (kernel 1 whole, the Triton state pass: the interpreter's)."""
    layout, inputs, states = packed_case(torch.float32, device, seed=40, tokens=384)
    check_packed_against_one_call_each(layout, inputs, states, exact=device == "cpu", chunk_size=chunk_size)


def test_chunked_packed_split_prepare_and_output_norm(device, monkeypatch):
    """Kernel 1 in two parts (the scores formed in the output kernel) and the gated norm in the output kernel,
    float16: the same as one call each."""
    monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", -1)
    layout, inputs, states = packed_case(torch.float16, device, seed=41, value_heads=2)
    weight = (1 + 0.3 * torch.randn(40, generator=torch.Generator().manual_seed(4))).to(device, torch.float16)
    check_packed_against_one_call_each(layout, inputs, states, exact=device == "cpu", z=inputs["z"], weight=weight)


def test_chunked_packed_argument_errors(device):
    layout = PackedLayout.of([5, 70])
    inputs = make_inputs(layout.tokens, 1, 2, 16, 16, torch.float32, device, seed=2)
    states = torch.zeros(2, 2, 16, 16, device=device)
    blocks = layout.blocks().to(device)
    packed = chunk_module.gated_delta_rule_chunked_packed
    with pytest.raises(ValueError, match="states"):
        packed(*kernel_arguments(inputs), states[0], blocks)
    with pytest.raises(ValueError, match="states"):
        packed(*kernel_arguments(inputs), states.double(), blocks)
    with pytest.raises(ValueError, match="blocks"):
        packed(*kernel_arguments(inputs), states, blocks[:1])
    with pytest.raises(ValueError, match="multiple of 64"):
        packed(*[x[:100] for x in kernel_arguments(inputs)[:5]], inputs["A_log"], inputs["dt_bias"], states, blocks)


# ---- the chunk's (I + A)^-1 ---------------------------------------------------------------------


@triton.jit
def _invert_blocks_kernel(a_ptr, x_ptr, BLOCKS: tl.constexpr, SIZE: tl.constexpr):
    index = (tl.arange(0, BLOCKS)[:, None, None] * SIZE + tl.arange(0, SIZE)[None, :, None]) * SIZE
    index += tl.arange(0, SIZE)[None, None, :]
    tl.store(x_ptr + index, chunk_module._invert_unit_lower(tl.load(a_ptr + index)))


@triton.jit
def _invert_chunk_kernel(a_ptr, scratch_ptr, x_ptr, SIZE: tl.constexpr):
    index = tl.arange(0, SIZE)[:, None] * SIZE + tl.arange(0, SIZE)[None, :]
    chunk_module._invert_chunk(tl.load(a_ptr + index), scratch_ptr)  # the inverse replaces A in the scratch
    tl.store(x_ptr + index, tl.load(scratch_ptr + index))


def chunk_systems(blocks, size, correlation, seed):
    """A = strictly-lower(diag(beta) K K^T * exp(G_i - G_j)) [blocks, size, size] float64 as a chunk forms it,
    from unit keys around a shared direction (correlation 1: all equal, |A_ij| up to ~1), beta in
    [0.5, 1] and slow decays; above the diagonal, garbage the inversion must ignore."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(blocks, 1, 64, generator=generator, dtype=torch.float64)
    keys = correlation * shared + (1 - correlation) * torch.randn(blocks, size, 64, generator=generator,
                                                                  dtype=torch.float64)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    beta = 0.5 + 0.5 * torch.rand(blocks, size, generator=generator, dtype=torch.float64)
    decay = -(0.05 * torch.rand(blocks, size, generator=generator, dtype=torch.float64)).cumsum(-1)
    system = beta[..., None] * (keys @ keys.transpose(-1, -2)) * (decay[..., :, None] - decay[..., None, :]).exp()
    lower = torch.ones(size, size, dtype=torch.bool).tril(-1)
    garbage = 100 * torch.randn(blocks, size, size, generator=generator, dtype=torch.float64)
    return torch.where(lower, system, garbage)


def inverse_error(x, system):
    """max |X - (I + strictly-lower(A))^-1| / max |(I + ...)^-1|, the exact inverse of the float32 A in float64."""
    size = system.shape[-1]
    exact = torch.linalg.inv(torch.eye(size, dtype=torch.float64) + system.float().double().tril(-1))
    return float(((x.double() - exact).abs().amax((-1, -2)) / exact.abs().amax((-1, -2))).max())


# the doubling reaches 2e-7 on these (float32 forward substitution: 1e-7 to 4e-7 on such systems); the product
# form (I - N)(I + N^2)(I + N^4)(I + N^8) 3e-5 on the correlated 16 x 16 blocks (its powers of N cancel); a
# skipped doubling step or merge gives errors of order 1
INVERSE_TOLERANCE = 3e-6


@pytest.mark.parametrize("blocks, size", [(4, 16), (2, 32)])
@pytest.mark.parametrize("correlation", [0.0, 0.9, 1.0])
def test_invert_unit_lower(device, blocks, size, correlation):
    system = chunk_systems(blocks, size, correlation, seed=size)
    x = torch.empty(blocks, size, size, device=device)
    _invert_blocks_kernel[(1,)](system.float().to(device), x, BLOCKS=blocks, SIZE=size)
    assert inverse_error(x.cpu(), system) < INVERSE_TOLERANCE


@pytest.mark.parametrize("correlation", [0.0, 0.9, 1.0])
@pytest.mark.parametrize("size", chunk_module.CHUNK_SIZES)
def test_invert_chunk(device, correlation, size):
    """The chunk's whole inverse as _chunk_prepare_kernel forms it: doubling inside the 16 x 16 blocks, then
    the merges into 32 x 32 (and 64 x 64), through a scratch block (garbage before: every entry is written
    before it is read)."""
    system = chunk_systems(3, size, correlation, seed=1)
    for a in system:
        x = torch.empty(size, size, device=device)
        scratch = torch.full((size, size), float("nan"), device=device)
        _invert_chunk_kernel[(1,)](a.float().to(device), scratch, x, SIZE=size)
        assert inverse_error(x.cpu(), a) < INVERSE_TOLERANCE


# ---- recurrent decode ----------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_recurrent_matches_reference(device, batch, dtype):
    key_heads, value_heads, key_dim, value_dim = 2, 4, 24, 40
    inputs = make_inputs(batch, key_heads, value_heads, key_dim, value_dim, dtype, device, seed=batch)
    state = random_state((batch, value_heads, key_dim, value_dim), device)
    ref_out, ref_state = reference_recurrent(inputs, state.clone())
    out = torch.empty(batch, value_heads, value_dim, device=device, dtype=dtype)
    assert gated_delta_rule_recurrent(*kernel_arguments(inputs), state, out=out) is out
    torch.testing.assert_close(out, ref_out, **TOLERANCE[dtype])
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-6)


def test_recurrent_over_slots_equals_each_slot_alone(device):
    """Rows over state slots [3, 1] of 5 and a padding row (slot -1): each row's o and its slot's state as that
    slot stepped alone, bit for bit; the other slots untouched, the padding row's o unwritten."""
    key_heads, value_heads, key_dim, value_dim = 2, 4, 24, 40
    inputs = make_inputs(3, key_heads, value_heads, key_dim, value_dim, torch.float32, device, seed=12)
    arguments = kernel_arguments(inputs)
    initial = random_state((5, value_heads, key_dim, value_dim), device, seed=13)
    state = initial.clone()
    out = torch.full((3, value_heads, value_dim), 7.0, device=device)
    slots = torch.tensor([3, 1, -1], device=device, dtype=torch.int32)
    gated_delta_rule_recurrent(*arguments, state, out=out, slots=slots)
    alone = initial.clone()
    for row, slot in enumerate([3, 1]):
        row_arguments = [x[row:row + 1] for x in arguments[:5]] + arguments[5:]
        step = gated_delta_rule_recurrent(*row_arguments, alone, slots=slots[row:row + 1])
        assert torch.equal(out[row], step[0])
        row_inputs = {name: (x[row:row + 1] if x.shape[0] == 3 else x) for name, x in inputs.items()}
        ref_out, ref_state = reference_recurrent(row_inputs, initial[slot:slot + 1].clone())
        torch.testing.assert_close(out[row:row + 1], ref_out, **TOLERANCE[torch.float32])
        torch.testing.assert_close(state[slot:slot + 1], ref_state, rtol=1e-5, atol=1e-6)
    assert torch.equal(state, alone)
    assert torch.equal(state[[0, 2, 4]], initial[[0, 2, 4]])
    assert (out[2] == 7.0).all()


# ---- gated norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, weight_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32),
])
def test_gated_rms_norm(device, dtype, weight_dtype):
    rows, heads, head_dim, eps = 5, 3, 40, 1e-6
    inputs = make_inputs(rows, 1, heads, 8, head_dim, dtype, device, seed=8)
    x = inputs["v"]  # a strided [M, Hv, Dv] view
    weight = (1 + 0.3 * torch.randn(head_dim)).to(device=device, dtype=weight_dtype)
    out = gated_rms_norm(x, inputs["z"], weight, eps)
    ref = fn.gated_rms_norm(x, inputs["z"].reshape(rows, heads, head_dim), weight, eps).reshape(rows, -1)
    assert out.shape == (rows, heads * head_dim) and out.dtype == dtype
    tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out, ref, **tolerance)


# ---- the fused decode step ---------------------------------------------------------------------


def make_decode_layer(batch, key_heads, value_heads, key_dim, value_dim, width, dtype, device, seed=0):
    """A decode step's inputs: the pre-conv row x [B, C] (views as the engine passes them), z, a, b, the
    conv and norm weights, non-zero conv and recurrent states."""
    generator = torch.Generator().manual_seed(seed)
    inputs = make_inputs(batch, key_heads, value_heads, key_dim, value_dim, dtype, device, seed=seed)
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    x = inputs["q"].view(batch, -1).as_strided((batch, channels), inputs["q"].stride()[:1] + (1,))
    conv_weight = (torch.randn(channels, 1, width, generator=generator) * 0.5).to(device=device, dtype=dtype)
    conv_state = torch.randn(batch, channels, width - 1, generator=generator).to(device=device, dtype=dtype)
    norm_weight = (1 + 0.3 * torch.randn(value_dim, generator=generator)).to(device=device, dtype=dtype)
    state = random_state((batch, value_heads, key_dim, value_dim), device, seed=seed + 1) * 0.2
    return dict(x=x, z=inputs["z"], a=inputs["a"], b=inputs["b"], conv_weight=conv_weight[:, 0, :],
                conv_state=conv_state, A_log=inputs["A_log"], dt_bias=inputs["dt_bias"], norm_weight=norm_weight,
                state=state, heads=(key_heads, value_heads, key_dim, value_dim))


def unfused_decode(layer, eps=1e-6):
    """The chain the fused step replaces: conv step, recurrent step, gated norm (states updated in place)."""
    key_heads, value_heads, key_dim, value_dim = layer["heads"]
    mixed = causal_conv1d_step(layer["x"], layer["conv_weight"], layer["conv_state"])
    batch = mixed.shape[0]
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=1)
    o = gated_delta_rule_recurrent(
        q.view(batch, key_heads, key_dim), k.view(batch, key_heads, key_dim), v.view(batch, value_heads, value_dim),
        layer["a"], layer["b"], layer["A_log"], layer["dt_bias"], layer["state"])
    return gated_rms_norm(o, layer["z"], layer["norm_weight"], eps)


def reference_decode(layer, eps=1e-6):
    key_heads, value_heads, key_dim, value_dim = layer["heads"]
    mixed, conv_state = fn.causal_conv1d_step(layer["x"], layer["conv_weight"], layer["conv_state"])
    batch = mixed.shape[0]
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=1)
    g, beta = fn.gating(layer["a"], layer["b"], layer["A_log"], layer["dt_bias"])
    o, state = fn.gated_delta_rule_recurrent(
        q.reshape(batch, key_heads, key_dim), k.reshape(batch, key_heads, key_dim),
        v.reshape(batch, value_heads, value_dim), g, beta, layer["state"])
    z = layer["z"].reshape(batch, value_heads, value_dim)
    return fn.gated_rms_norm(o, z, layer["norm_weight"], eps).reshape(batch, -1), conv_state, state


def fused_decode(layer, **options):
    names = ("x", "z", "a", "b", "conv_weight", "conv_state", "A_log", "dt_bias", "norm_weight")
    return gated_delta_rule_decode_fused(*[layer[n] for n in names], 1e-6, layer["state"], **options)


def clone_states(layer):
    return dict(layer, conv_state=layer["conv_state"].clone(), state=layer["state"].clone())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_decode_matches_unfused_and_reference(device, batch, dtype):
    layer = make_decode_layer(batch, 2, 4, 24, 40, 4, dtype, device, seed=batch)
    ref_out, ref_conv_state, ref_state = reference_decode(clone_states(layer))
    unfused = clone_states(layer)
    unfused_out = unfused_decode(unfused)
    out = torch.empty_like(unfused_out)
    delta_out = torch.empty(batch, 4, 40, device=device, dtype=dtype)
    assert fused_decode(layer, out=out, delta_out=delta_out) is out
    # the same float32 operations in the same order as the unfused chain
    assert torch.equal(out, unfused_out)
    assert torch.equal(layer["conv_state"], unfused["conv_state"])
    assert torch.equal(layer["state"], unfused["state"])
    assert torch.equal(layer["conv_state"], ref_conv_state)
    # in float16 the reference's conv step multiplies and sums in float16, the kernels in float32
    state_tolerance = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=3e-3)
    torch.testing.assert_close(layer["state"], ref_state, **state_tolerance)
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, ref_out, **tolerance)
    # a second step: the last program of each head reset its arrival counter, so the norm runs again
    fused_decode(layer, out=out, delta_out=delta_out)
    assert torch.equal(out, unfused_decode(unfused))
    assert torch.equal(layer["state"], unfused["state"])
    assert torch.equal(layer["conv_state"], unfused["conv_state"])


def slot_states(layer, slot_count, seed):
    """The layer with conv and recurrent states of `slot_count` slots (random, non-zero)."""
    generator = torch.Generator().manual_seed(seed)
    conv_state, state = layer["conv_state"], layer["state"]
    return dict(layer, conv_state=torch.randn((slot_count,) + conv_state.shape[1:], generator=generator).to(conv_state),
                state=(torch.randn((slot_count,) + state.shape[1:], generator=generator) * 0.1).to(state))


def decode_row(layer, row):
    """Row `row` of a decode layer's inputs (the states, all slots', shared)."""
    return dict(layer, **{name: layer[name][row:row + 1] for name in ("x", "z", "a", "b")})


@pytest.mark.parametrize("normalize", [True, False])
def test_fused_decode_over_slots_equals_each_slot_alone(device, normalize):
    """Rows over slots [3, 1] of 5 and a padding row (slot -1): each row's output and its slot's conv and recurrent
    states as that slot stepped alone, bit for bit, and as the unfused chain over the same slots; the other slots
    untouched (the padding row's among them); the arrival counters left zero."""
    layer = slot_states(make_decode_layer(3, 2, 4, 16, 24, 4, torch.float32, device, seed=14), 5, seed=15)
    initial = clone_states(layer)
    slots = torch.tensor([3, 1, -1], device=device, dtype=torch.int32)
    delta_out = torch.full((3, 4, 24), 7.0, device=device)
    result = fused_decode(layer, delta_out=delta_out, normalize=normalize, slots=slots)
    alone = clone_states(initial)
    for row, slot in enumerate([3, 1]):
        step = fused_decode(decode_row(alone, row), normalize=normalize, slots=slots[row:row + 1])
        assert torch.equal(result[row], step[0])
    assert torch.equal(layer["conv_state"], alone["conv_state"])
    assert torch.equal(layer["state"], alone["state"])
    for name in ("conv_state", "state"):
        assert torch.equal(layer[name][[0, 2, 4]], initial[name][[0, 2, 4]])
        assert not torch.equal(layer[name][[1, 3]], initial[name][[1, 3]])
    assert (delta_out[2] == 7.0).all()
    for counters in fused_decode_module._counters.values():
        assert (counters == 0).all()
    if normalize:  # the unfused chain over the same slots
        unfused = clone_states(initial)
        key_heads, value_heads, key_dim, value_dim = unfused["heads"]
        mixed = torch.zeros_like(unfused["x"])  # the padding row's is not written (nor its o below)
        causal_conv1d_step(unfused["x"], unfused["conv_weight"], unfused["conv_state"], out=mixed, slots=slots)
        q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=1)
        o = gated_delta_rule_recurrent(q.view(3, key_heads, key_dim), k.view(3, key_heads, key_dim),
                                       v.view(3, value_heads, value_dim), unfused["a"], unfused["b"],
                                       unfused["A_log"], unfused["dt_bias"], unfused["state"], slots=slots,
                                       out=torch.zeros(3, value_heads, value_dim, device=device))
        out = gated_rms_norm(o, unfused["z"], unfused["norm_weight"], 1e-6)
        assert torch.equal(result[:2], out[:2])
        assert torch.equal(layer["state"], unfused["state"])
        assert torch.equal(layer["conv_state"], unfused["conv_state"])


def test_fused_decode_one_value_head_per_key_head(device):
    # Hk = Hv (the real model's case): each key head's last program normalises one value head
    layer = make_decode_layer(2, 2, 2, 16, 40, 4, torch.float16, device, seed=7)
    ref_out, ref_conv_state, ref_state = reference_decode(clone_states(layer))
    for _ in range(2):  # the second step runs on the first one's conv state and state
        unfused = clone_states(layer)
        unfused_out = unfused_decode(unfused)
        out = fused_decode(layer)
        assert torch.equal(out, unfused_out)
        assert torch.equal(layer["conv_state"], unfused["conv_state"])
        assert torch.equal(layer["state"], unfused["state"])
        if ref_out is not None:
            torch.testing.assert_close(out, ref_out, rtol=2e-2, atol=2e-2)
            assert torch.equal(layer["conv_state"], ref_conv_state)
            torch.testing.assert_close(layer["state"], ref_state, rtol=1e-2, atol=3e-3)
            ref_out = None


def test_fused_decode_without_the_norm_returns_the_delta_rule_output(device):
    # normalize=False: o itself (for out_projection_mlp's head_norm), the states updated as before
    layer = make_decode_layer(1, 2, 2, 16, 32, 4, torch.float32, device, seed=8)
    unfused = clone_states(layer)
    key_heads, value_heads, key_dim, value_dim = layer["heads"]
    mixed = causal_conv1d_step(unfused["x"], unfused["conv_weight"], unfused["conv_state"])
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=1)
    o = gated_delta_rule_recurrent(q.view(1, key_heads, key_dim), k.view(1, key_heads, key_dim),
                                   v.view(1, value_heads, value_dim), unfused["a"], unfused["b"], unfused["A_log"],
                                   unfused["dt_bias"], unfused["state"])
    out = torch.full((1, value_heads * value_dim), 7.0, device=device)
    delta_out = torch.empty(1, value_heads, value_dim, device=device)
    for _ in range(2):  # the counter is reset by the last program, norm or not
        result = fused_decode(layer, out=out, delta_out=delta_out, normalize=False)
        assert result is delta_out and torch.equal(result, o)
        assert torch.equal(layer["state"], unfused["state"])
        assert torch.equal(layer["conv_state"], unfused["conv_state"])
        assert (out == 7.0).all()
        mixed = causal_conv1d_step(unfused["x"], unfused["conv_weight"], unfused["conv_state"])
        q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=1)
        o = gated_delta_rule_recurrent(q.view(1, key_heads, key_dim), k.view(1, key_heads, key_dim),
                                       v.view(1, value_heads, value_dim), unfused["a"], unfused["b"],
                                       unfused["A_log"], unfused["dt_bias"], unfused["state"])


def test_fused_decode_width_two_and_argument_errors(device):
    layer = make_decode_layer(2, 1, 2, 16, 24, 2, torch.float32, device, seed=5)
    unfused = clone_states(layer)
    assert torch.equal(fused_decode(layer), unfused_decode(unfused))
    assert torch.equal(layer["state"], unfused["state"])
    assert torch.equal(layer["conv_state"], unfused["conv_state"])
    with pytest.raises(ValueError, match="^x "):
        fused_decode(dict(layer, x=layer["x"][:, :-3]))
    with pytest.raises(ValueError, match="conv_state"):
        fused_decode(dict(layer, conv_state=layer["conv_state"][:1]))
    with pytest.raises(ValueError, match="norm_weight"):
        fused_decode(dict(layer, norm_weight=layer["norm_weight"][:5]))


# ---- determinism and argument checks -------------------------------------------------------------


def test_deterministic(device):
    inputs = make_inputs(70, 1, 2, 24, 40, torch.float16, device, seed=9)
    results = []
    for _ in range(2):
        state = random_state((2, 24, 40), device)
        out = gated_delta_rule_chunked(*kernel_arguments(inputs), state)
        step_state = random_state((3, 2, 24, 40), device)
        step = gated_delta_rule_recurrent(*[x[:3] for x in kernel_arguments(inputs)[:5]], inputs["A_log"],
                                          inputs["dt_bias"], step_state)
        results.append((out, state, step, step_state))
    for first, second in zip(*results):
        assert torch.equal(first, second)


def test_argument_errors(device):
    inputs = make_inputs(10, 2, 4, 16, 16, torch.float32, device)
    args = kernel_arguments(inputs)
    state = torch.zeros(4, 16, 16, device=device)
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_chunked(*args, state.double())
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_chunked(*args, state[:, :, :8])
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule_chunked(*args, state, chunk_size=16)
    with pytest.raises(ValueError, match="^k "):
        gated_delta_rule_chunked(args[0], args[1][:5], *args[2:], state)
    with pytest.raises(ValueError, match="^v "):
        gated_delta_rule_chunked(*args[:2], args[2].transpose(1, 2), *args[3:], state)
    with pytest.raises(ValueError, match="^a "):
        gated_delta_rule_chunked(*args[:3], args[3][:, :2], *args[4:], state)
    with pytest.raises(ValueError, match="A_log"):
        gated_delta_rule_chunked(*args[:5], args[5].half(), args[6], state)
    with pytest.raises(ValueError, match="out"):
        gated_delta_rule_chunked(*args, state, out=torch.empty(10, 4, 8, device=device))
    with pytest.raises(ValueError, match="state"):
        gated_delta_rule_recurrent(*[x[:2] for x in args[:5]], *args[5:], torch.zeros(2, 4, 16, 8, device=device))
    with pytest.raises(ValueError, match="^b "):
        gated_delta_rule_recurrent(*[x[:2] for x in args[:4]], args[4][:1], *args[5:],
                                   torch.zeros(2, 4, 16, 16, device=device))
    with pytest.raises(ValueError, match="^z "):
        gated_rms_norm(inputs["v"], inputs["z"][:, :10], torch.ones(16, device=device), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(inputs["v"], inputs["z"], torch.ones(15, device=device), 1e-6)
    with pytest.raises(ValueError, match="^b "):
        gating(inputs["a"], inputs["b"][:3], inputs["A_log"], inputs["dt_bias"])


STATE_PASS_FOR_HOPPER = """
import json, os, re, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qwen_triton.operators.gated_delta_rule import state_pass
heads, length, dim = 16, 4096, 128
rows = torch.zeros(heads, length, dim, dtype=torch.bfloat16)  # the scratch's W, U, K~ and V' at the real shape
state = torch.zeros(heads, dim, dim)
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
results = {}
for chunk, packed in ((32, False), (64, False), (32, True), (64, True)):
    chunk_states = torch.zeros(length // chunk, heads, dim, dim, dtype=torch.bfloat16)
    descriptors = state_pass.descriptors(state, rows, rows, rows, rows, chunk_states, chunk)
    kernel = state_pass._state_pass_kernel
    pointers = dict(decay_ptr="*fp32", state_ptr="*fp32", blocks_ptr="*i32", length="i32", chunks="i32")
    signature = {name: mangle_type(descriptors[name]) if name in descriptors else pointers.get(name, "constexpr")
                 for name in kernel.arg_names}
    constants = dict(V_HEADS=heads, K_DIM=dim, V_DIM=dim, CHUNK_ROWS=chunk, STAGES=state_pass.STAGES, PACKED=packed)
    compiled = triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=state_pass.WARPS))
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    products = [line for line in compiled.asm["ptx"].splitlines() if "wgmma.mma_async" in line]
    results[f"{chunk}{' packed' if packed else ''}"] = dict(shared=compiled.metadata.shared, stack=int(usage.split("STACK:")[1].split()[0]),
                          products=len(products),
                          left_from_registers=sum(bool(re.search(r"\\}, \\{", line)) for line in products))
print(json.dumps(results))
"""


def test_state_pass_compiles_for_hopper():
    """The Gluon state pass compiled for sm_90 on the CPU (the interpreter runs no Gluon), for one sequence and for a
    packed layout (PACKED: the slots' states loaded and stored in the loop): no spills, within the shared memory of
    an H100/H200 program, and every tensor-core product takes its left operand from registers, the kernel's premise
    (state_pass.py: no shared-memory round trip in the step's chain)."""
    results = run_without_interpreter(STATE_PASS_FOR_HOPPER)
    assert len(results) == 4
    for chunk, result in results.items():
        assert result["stack"] == 0, (chunk, result)
        assert result["shared"] <= 227 * 1024, (chunk, result)
        assert result["products"] > 0 and result["left_from_registers"] == result["products"], (chunk, result)


# ---- GPU, bfloat16, the real shapes ---------------------------------------------------------------

HEADS, DIM = 16, 128


@pytest.mark.parametrize("state_block_v, output_block_v", [(16, 128), (32, 32), (64, 16)])
def test_chunked_every_value_tiling(state_block_v, output_block_v, monkeypatch):
    # the autotuner picks the BLOCK_V of the state pass and of the output kernel independently: each pair
    # must give the same function (128 tokens, two chunks, Dv = 64, so an output tile wider than a head is
    # included; float32, so the interpreter's dots are exact)
    for kernel, block_v in ((chunk_module._chunk_state_kernel, state_block_v),
                            (chunk_module._chunk_output_kernel, output_block_v)):
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_V": block_v}, num_warps=4, num_stages=2)])
        monkeypatch.setattr(kernel, "cache", {})
    device = "cuda" if torch.cuda.is_available() else "cpu"
    inputs = make_inputs(128, 2, 2, 64, 64, torch.float32, device, seed=20)
    initial = random_state((2, 64, 64), device) * 0.2
    ref_out, ref_state = reference_chunked(inputs, initial.clone())
    state = initial.clone()
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, dot_precision="ieee")
    assert frobenius_error(out, ref_out) < 1e-4
    assert frobenius_error(state, ref_state) < 1e-4


def real_shape_chunked_case(length, seed):
    """bf16 inputs at the real shape on the GPU, a non-zero initial state, and the float32 reference's output
    and final state from them."""
    inputs = make_inputs(length, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=seed)
    initial = random_state((HEADS, DIM, DIM), "cuda") * 0.2
    float_inputs = dict(inputs, q=inputs["q"].float(), k=inputs["k"].float(), v=inputs["v"].float())
    ref_out, ref_state = reference_chunked(float_inputs, initial.clone())
    return inputs, initial, ref_out, ref_state


@pytest.mark.gpu
@pytest.mark.parametrize("length", [200, 4096])
def test_gpu_chunked_scores_in_output_every_config(length, monkeypatch):
    """Chunks of 64: each output config pinned in turn, with and without the norm: kernel 1 split, the scores formed
    in the output kernel, against the one kernel 1's stored scores, the same config: within one bf16 rounding
    (equal or a rounding apart when measured; BLOCK_V 32, since dropped, faulted)."""
    inputs, initial, ref_out, _ = real_shape_chunked_case(length, seed=26)
    weight = torch.linspace(0.5, 1.5, DIM, device="cuda", dtype=torch.bfloat16)
    kernel = chunk_module._chunk_output_kernel
    configs = list(kernel.configs)
    try:
        for config in chunk_module.OUTPUT_CONFIGS:
            for norm in (None, (inputs["z"], weight, 1e-6)):
                outs = {}
                for here in (True, False):
                    monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", 199 if here else length)
                    kernel.configs, kernel.cache = [config], {}
                    outs[here] = gated_delta_rule_chunked(*kernel_arguments(inputs), initial.clone(), chunk_size=64,
                                                          output_norm=norm)
                    torch.cuda.synchronize()
                case = (config.kwargs, config.num_warps, norm is not None)
                assert frobenius_error(outs[True], outs[False]) < 1e-4, case
                assert max_error(outs[True], outs[False]) < 4e-3, case
                if norm is None:
                    assert frobenius_error(outs[True], ref_out) < 1.5e-2, case
    finally:
        kernel.configs, kernel.cache = configs, {}


@pytest.mark.gpu
@pytest.mark.parametrize("length, chunk_size", [(128, 32), (128, 64), (2048, None), (4096, None)])
def test_gpu_chunked(length, chunk_size):
    # chunk_size None: the engine's choice (2048 tokens in chunks of 32, 4096 in chunks of 64)
    inputs, initial, ref_out, ref_state = real_shape_chunked_case(length, seed=20)
    state = initial.clone()
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
    assert frobenius_error(out, ref_out) < 1.5e-2
    assert max_error(out, ref_out) < 2e-2
    assert frobenius_error(state, ref_state) < 1e-2
    again = initial.clone()
    assert torch.equal(gated_delta_rule_chunked(*kernel_arguments(inputs), again, chunk_size=chunk_size), out)
    assert torch.equal(again, state)
    for precision in ("tf32", "ieee"):  # the float32-operand options are at least as accurate
        state = initial.clone()
        out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, dot_precision=precision,
                                       chunk_size=chunk_size)
        assert frobenius_error(out, ref_out) < 1e-2
        assert frobenius_error(state, ref_state) < 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 5, 31, 33, 63, 65])
@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_gpu_chunked_short_prompts(length, chunk_size):
    """Prompts of one partial chunk or two, at the real shape: with `chunks` specialised to 1, Triton unrolled
    the state pass's loop for one-chunk prompts, without pipelining, where the first form of
    the state pass reading stored decayed keys faulted with an illegal address on the H200 (docs/decisions.md, D80);
    `chunks` is no longer specialised, and these prompts run the pipelined loop; the output norm as norming
    after."""
    inputs, initial, ref_out, ref_state = real_shape_chunked_case(length, seed=23)
    state = initial.clone()
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
    torch.cuda.synchronize()
    assert frobenius_error(out, ref_out) < 1.5e-2
    assert frobenius_error(state, ref_state) < 1e-2
    weight = torch.linspace(0.5, 1.5, DIM, device="cuda", dtype=torch.bfloat16)
    normed = gated_delta_rule_chunked(*kernel_arguments(inputs), initial.clone(),
                                      output_norm=(inputs["z"], weight, 1e-6), chunk_size=chunk_size)
    expected = gated_rms_norm(out, inputs["z"], weight, 1e-6)
    assert frobenius_error(normed.reshape(length, -1), expected) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
@pytest.mark.parametrize("split", [False, True])
def test_gpu_chunked_every_config(chunk_size, split, monkeypatch):
    """Each config of each kernel pinned in turn (the others at their autotuner's pick), at the real shape over
    four or seven chunks (the last partial), with and without the output norm, for each chunk size, with kernel
    1 whole and in its two parts (split): a config the compiler gets wrong fails here whatever the tuning
    picks (one did, in a version of the output kernel: docs/decisions.md, D81)."""
    length = 200
    monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", length - 1 if split else length)
    monkeypatch.setattr(chunk_module.state_pass, "applies", lambda *args: False)  # the Triton kernel 2 (Gluon's:
    # test_gpu_state_pass_in_gluon_equals_triton)
    inputs, initial, ref_out, ref_state = real_shape_chunked_case(length, seed=24)
    weight = torch.linspace(0.5, 1.5, DIM, device="cuda", dtype=torch.bfloat16)
    if split:
        kernels = {"inverse": (chunk_module._chunk_inverse_kernel, chunk_module.INVERSE_CONFIGS),
                   "products": (chunk_module._chunk_products_kernel, chunk_module.PRODUCTS_CONFIGS)}
    else:
        kernels = {"prepare": (chunk_module._chunk_prepare_kernel, chunk_module.PREPARE_CONFIGS)}
    kernels.update(state=(chunk_module._chunk_state_kernel, chunk_module.STATE_CONFIGS),
                   output=(chunk_module._chunk_output_kernel, chunk_module.OUTPUT_CONFIGS))
    for name, (kernel, every) in kernels.items():
        configs = list(kernel.configs)
        try:
            for config in every:
                kernel.configs, kernel.cache = [config], {}
                state = initial.clone()
                out = gated_delta_rule_chunked(*kernel_arguments(inputs), state, chunk_size=chunk_size)
                torch.cuda.synchronize()
                assert frobenius_error(out, ref_out) < 1.5e-2, (name, config)
                assert max_error(out, ref_out) < 2e-2, (name, config)
                assert frobenius_error(state, ref_state) < 1e-2, (name, config)
                normed = gated_delta_rule_chunked(*kernel_arguments(inputs), initial.clone(),
                                                  output_norm=(inputs["z"], weight, 1e-6), chunk_size=chunk_size)
                expected = gated_rms_norm(out, inputs["z"], weight, 1e-6)
                assert frobenius_error(normed.reshape(length, -1), expected) < 4e-3, (name, config)
        finally:
            kernel.configs, kernel.cache = configs, {}


def long_memory_case(length, seed):
    """real_shape_chunked_case with long memory (a as in test_chunked_long_memory): the carried state matters
    across many chunks."""
    inputs = make_inputs(length, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=seed)
    inputs["a"] = (inputs["a"].float() / 6 - 3).to(torch.bfloat16)
    initial = random_state((HEADS, DIM, DIM), "cuda") * 0.2
    float_inputs = dict(inputs, q=inputs["q"].float(), k=inputs["k"].float(), v=inputs["v"].float())
    ref_out, ref_state = reference_chunked(float_inputs, initial.clone())
    return inputs, initial, ref_out, ref_state


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 5, 63, 65, 200, 4096])
@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
def test_gpu_state_pass_in_gluon_equals_triton(length, chunk_size, monkeypatch):
    """Kernel 2 in Gluon (state_pass.py) against the Triton kernel on the same scratch: V', the chunk start
    states and the final state, partial last chunks included (the Gluon kernel reads the next head's rows there
    and zeroes what they feed); long memory, so every chunk's state counts."""
    real_state = torch.empty(HEADS, DIM, DIM, device="cuda")
    assert state_pass.applies(real_state, torch.bfloat16, chunk_size)
    # float32 operands (the "tf32" and "ieee" options) and chunks whose W tiles cannot hold the final state's tile
    # take the Triton kernel
    assert not state_pass.applies(real_state, torch.float32, chunk_size)
    assert not state_pass.applies(real_state, torch.bfloat16, 16)
    inputs, initial, _, ref_state = long_memory_case(length, seed=25)
    q, k, v, a, b, A_log, dt_bias = kernel_arguments(inputs)
    scratch = chunk_module.chunk_scratch(q, v, None, chunk_size)
    chunk_module.launch_prepare(q, k, v, a, b, A_log, dt_bias, scratch)
    results = {}
    for gluon in (False, True):
        scratch.new_values.fill_(float("nan"))
        scratch.chunk_states.fill_(float("nan"))
        state = initial.clone()
        (chunk_module.launch_state_pass if gluon else chunk_module.launch_triton_state_pass)(state, scratch)
        results[gluon] = (scratch.new_values.clone(), scratch.chunk_states.clone(), state)
    for name, ours, triton_kernel in zip(("V'", "chunk states", "final state"), results[True], results[False]):
        assert torch.isfinite(ours).all(), name
        assert frobenius_error(ours, triton_kernel) < 4e-3, name
    assert frobenius_error(results[True][2], ref_state) < 1e-2
    assert frobenius_error(results[True][2], initial) > 0.1  # the state moved


GPU_PACKED_LENGTHS = (1, 5, 63, 64, 65, 130, 700, 1531)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", chunk_module.CHUNK_SIZES)
@pytest.mark.parametrize("split", [False, True])
def test_gpu_chunked_packed_equals_one_call_each(chunk_size, split, monkeypatch):
    """The real shape in bf16 (the Gluon state pass, PACKED): eight prompts of 1 to 1,531 tokens in slots in any
    order, kernel 1 whole or in two parts, the output norm: each prompt's output and final state against one call
    each from its slot's state (the same chunks: within bf16 roundings), the reference, padding rows zero, the
    spare slot untouched; also the Triton state pass on the same scratch."""
    monkeypatch.setattr(chunk_module, "SPLIT_PREPARE_TOKENS", -1 if split else 10**9)
    slots = (3, 0, 7, 1, 6, 2, 5, 4)
    layout = PackedLayout.of(GPU_PACKED_LENGTHS, slots=slots, tokens=PackedLayout.of(GPU_PACKED_LENGTHS).used + 128)
    inputs = make_inputs(layout.tokens, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=27)
    inputs["a"].copy_((inputs["a"].float() / 6 - 1).to(torch.bfloat16))  # long memory
    inputs["z"]._base[layout.token_slots().cuda() < 0] = float("nan")
    states = random_state((9, HEADS, DIM, DIM), "cuda") * 0.2
    weight = torch.linspace(0.5, 1.5, DIM, device="cuda", dtype=torch.bfloat16)
    blocks = layout.blocks().cuda()
    packed_states = states.clone()
    out = chunk_module.gated_delta_rule_chunked_packed(*kernel_arguments(inputs), packed_states, blocks,
                                                       chunk_size=chunk_size)
    normed = chunk_module.gated_delta_rule_chunked_packed(*kernel_arguments(inputs), states.clone(), blocks,
                                                          chunk_size=chunk_size,
                                                          output_norm=(inputs["z"], weight, 1e-6))
    torch.cuda.synchronize()
    for first, length, slot in zip(layout.firsts, layout.lengths, layout.slots):
        rows = slice(first, first + length)
        state = states[slot].clone()
        alone = gated_delta_rule_chunked(*sequence_arguments(inputs, rows), state, chunk_size=chunk_size)
        assert frobenius_error(out[rows], alone) < 1e-2, slot
        assert frobenius_error(packed_states[slot], state) < 1e-2, slot
        expected = gated_rms_norm(out[rows], inputs["z"][rows], weight, 1e-6)
        assert frobenius_error(normed[rows].reshape(length, -1), expected) < 4e-3, slot
        float_inputs = {name: inputs[name][rows].float() for name in ("q", "k", "v")}
        g, beta = fn.gating(inputs["a"][rows], inputs["b"][rows], inputs["A_log"], inputs["dt_bias"])
        ref_out, ref_state = fn.gated_delta_rule_chunked(float_inputs["q"], float_inputs["k"], float_inputs["v"],
                                                         g, beta, states[slot].clone())
        assert frobenius_error(out[rows], ref_out) < 1.5e-2 and frobenius_error(packed_states[slot], ref_state) < 1e-2
    padding = layout.token_slots().cuda() < 0
    assert (out[padding] == 0).all() and (normed[padding] == 0).all()
    assert torch.equal(packed_states[8], states[8])
    # the Triton state pass (the CPU's) on the same scratch as the Gluon one
    q, k, v, a, b, A_log, dt_bias = kernel_arguments(inputs)
    scratch = chunk_module.chunk_scratch(q, v, None, chunk_size)
    chunk_module.launch_prepare(q, k, v, a, b, A_log, dt_bias, scratch, blocks)
    finals = []
    for launch in (chunk_module.launch_state_pass, chunk_module.launch_triton_state_pass):
        final = states.clone()
        launch(final, scratch, blocks)
        finals.append(final)
    assert frobenius_error(finals[0], finals[1]) < 4e-3 and torch.isfinite(finals[0]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("length", [100, 4096])
def test_gpu_chunked_long_memory(length):
    """The whole operator at the real shape with long memory, against the float32 reference."""
    inputs, initial, ref_out, ref_state = long_memory_case(length, seed=26)
    state = initial.clone()
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state)
    assert frobenius_error(out, ref_out) < 1.5e-2
    assert frobenius_error(state, ref_state) < 1e-2


@pytest.mark.gpu
def test_gpu_chunked_grouped_heads():
    """Hv = 2 Hk at Dk = Dv = 128 (the grouping other Qwen3.5 sizes use), crossing chunk boundaries."""
    inputs = make_inputs(300, 8, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=21)
    float_inputs = dict(inputs, q=inputs["q"].float(), k=inputs["k"].float(), v=inputs["v"].float())
    ref_out, ref_state = reference_chunked(float_inputs, torch.zeros(HEADS, DIM, DIM, device="cuda"))
    state = torch.zeros(HEADS, DIM, DIM, device="cuda")
    out = gated_delta_rule_chunked(*kernel_arguments(inputs), state)
    assert frobenius_error(out, ref_out) < 1.5e-2
    assert frobenius_error(state, ref_state) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_recurrent(batch):
    inputs = make_inputs(batch, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=22)
    initial = random_state((batch, HEADS, DIM, DIM), "cuda") * 0.2
    float_inputs = dict(inputs, q=inputs["q"].float(), k=inputs["k"].float(), v=inputs["v"].float())
    ref_out, ref_state = reference_recurrent(float_inputs, initial.clone())
    state = initial.clone()
    out = gated_delta_rule_recurrent(*kernel_arguments(inputs), state)
    assert frobenius_error(out, ref_out) < 5e-3
    assert max_error(out, ref_out) < 1e-2
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_recurrent_cuda_graph():
    """The decode step captured once and replayed: same results as eager, no host reads or allocation."""
    batch = 2
    inputs = make_inputs(batch, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=23)
    state = random_state((batch, HEADS, DIM, DIM), "cuda") * 0.2
    out = torch.empty(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes
            gated_delta_rule_recurrent(*kernel_arguments(inputs), state, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gated_delta_rule_recurrent(*kernel_arguments(inputs), state, out=out)
    eager_state = state.clone()
    graph.replay()
    torch.cuda.synchronize()
    eager_out = gated_delta_rule_recurrent(*kernel_arguments(inputs), eager_state)
    assert torch.equal(out, eager_out)
    assert torch.equal(state, eager_state)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_fused_decode(batch):
    layer = make_decode_layer(batch, HEADS, HEADS, DIM, DIM, 4, torch.bfloat16, "cuda", seed=25)
    unfused = clone_states(layer)
    unfused_out = unfused_decode(unfused)
    out = fused_decode(layer)
    # the same math, but the conv's 4-term float32 sums may associate differently in the two kernels'
    # layouts, and a last-bit difference can flip a bf16 rounding of q, k or v (~1 in 10^4 elements)
    assert frobenius_error(out, unfused_out) < 2e-3
    assert torch.equal(layer["conv_state"], unfused["conv_state"])
    assert frobenius_error(layer["state"], unfused["state"]) < 1e-3


@pytest.mark.gpu
def test_gpu_fused_decode_every_config():
    # every config the autotuner may pick, pinned in turn, against the unfused chain
    kernel = fused_decode_module._fused_step_kernel
    configs = list(kernel.configs)  # the tuning space (one config when QWEN_TRITON_AUTOTUNE=first)
    every = fused_decode_module.STEP_CONFIGS
    layer = make_decode_layer(1, HEADS, HEADS, DIM, DIM, 4, torch.bfloat16, "cuda", seed=27)
    unfused = clone_states(layer)
    unfused_out = unfused_decode(unfused)
    try:
        for config in every:
            kernel.configs, kernel.cache = [config], {}
            pinned = clone_states(layer)
            out = fused_decode(pinned)
            assert frobenius_error(out, unfused_out) < 2e-3, config
            assert torch.equal(pinned["conv_state"], unfused["conv_state"]), config
            assert frobenius_error(pinned["state"], unfused["state"]) < 1e-3, config
    finally:
        kernel.configs, kernel.cache = configs, {}


@pytest.mark.gpu
def test_gpu_fused_decode_cuda_graph():
    layer = make_decode_layer(2, HEADS, HEADS, DIM, DIM, 4, torch.bfloat16, "cuda", seed=26)
    out = torch.empty(2, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    delta_out = torch.empty(2, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes
            fused_decode(layer, out=out, delta_out=delta_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_decode(layer, out=out, delta_out=delta_out)
    for _ in range(3):
        eager = clone_states(layer)
        graph.replay()
        torch.cuda.synchronize()
        eager_out = fused_decode(eager)
        assert torch.equal(out, eager_out)
        assert torch.equal(layer["state"], eager["state"])
        assert torch.equal(layer["conv_state"], eager["conv_state"])


def gathered_step(step, states, slots):
    """step(*row_states, row_slots) on the rows' slots' states gathered into slots 0..B-1 (row_slots 0..B-1; a
    padding row's: a scratch copy of slot 0's), then scattered back: what a step over slots must equal. (Slots
    0..B-1 rather than none: the same kernel specialisation, so the autotuner's choice for the same key.)"""
    index = slots.clamp(min=0).long()
    rows = [state[index].clone() for state in states]
    result = step(*rows, torch.arange(len(slots), device=slots.device, dtype=torch.int32))
    live = slots >= 0
    for state, row_state in zip(states, rows):
        state[index[live]] = row_state[live]
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_decode_step_over_slots_in_a_cuda_graph(fused):
    """The recurrent step, or the fused step, captured once over slots read from a device buffer and replayed with
    new slot sets (a padding row among them): bit for bit the same kernel run on the rows' slots' states gathered
    into slots 0..B-1 (the same batch, so the same config), the other slots untouched; and each row within bf16 rounding
    of its slot stepped alone (a batch of one may tune another config, whose sums associate differently)."""
    batch, slot_count = 3, 6
    layer = slot_states(make_decode_layer(batch, HEADS, HEADS, DIM, DIM, 4, torch.bfloat16, "cuda", seed=28),
                        slot_count, seed=29)
    slots = torch.arange(batch, device="cuda", dtype=torch.int32)
    out = torch.empty(batch, HEADS * DIM, device="cuda", dtype=torch.bfloat16)
    delta_out = torch.empty(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    arguments = kernel_arguments(make_inputs(batch, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=30))

    def step(conv_state, state, slots=slots, row=None):
        """The step of every row (row None) or of one, on these states; returns its output buffer."""
        rows = slice(None) if row is None else slice(row, row + 1)
        if fused:
            inputs = dict(layer, conv_state=conv_state, state=state)
            return fused_decode(inputs if row is None else decode_row(inputs, row), out=out[rows],
                                delta_out=delta_out[rows], slots=slots)
        return gated_delta_rule_recurrent(*[x[rows] for x in arguments[:5]], *arguments[5:], state,
                                          out=delta_out[rows], slots=slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes
            step(layer["conv_state"], layer["state"])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layer["conv_state"], layer["state"])
    for new_slots in ([5, 0, 3], [2, 4, -1], [1, 5, 0]):
        slots.copy_(torch.tensor(new_slots, dtype=torch.int32))
        before = clone_states(layer)
        graph.replay()
        got = (out if fused else delta_out).clone()
        gathered = clone_states(before)
        expected = gathered_step(lambda conv_state, state, rows: step(conv_state, state, slots=rows).clone(),
                                 [gathered["conv_state"], gathered["state"]], slots)
        live = [row for row, slot in enumerate(new_slots) if slot >= 0]
        assert torch.equal(got[live], expected[live]), new_slots
        if fused:
            assert torch.equal(layer["conv_state"], gathered["conv_state"]), new_slots
        assert torch.equal(layer["state"], gathered["state"]), new_slots
        untouched = [slot for slot in range(slot_count) if slot not in new_slots]
        assert torch.equal(layer["state"][untouched], before["state"][untouched])
        assert torch.equal(layer["conv_state"][untouched], before["conv_state"][untouched])
        for row in live:
            alone = clone_states(before)
            single = torch.tensor([new_slots[row]], device="cuda", dtype=torch.int32)
            one = step(alone["conv_state"], alone["state"], slots=single, row=row).clone()
            assert frobenius_error(got[row], one[0]) < 2e-3, (new_slots, row)
            assert frobenius_error(layer["state"][new_slots[row]], alone["state"][new_slots[row]]) < 1e-3
    for counters in fused_decode_module._counters.values():
        assert (counters == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4096])
def test_gpu_gated_rms_norm_and_gating(rows):
    inputs = make_inputs(rows, HEADS, HEADS, DIM, DIM, torch.bfloat16, "cuda", seed=24)
    weight = (1 + 0.3 * torch.randn(DIM, device="cuda")).to(torch.bfloat16)
    out = gated_rms_norm(inputs["v"], inputs["z"], weight, 1e-6)
    ref = fn.gated_rms_norm(inputs["v"], inputs["z"].reshape(rows, HEADS, DIM), weight, 1e-6).reshape(rows, -1)
    # the same roundings as the reference: at most a one-ulp flip where fp32 sums differ in order
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=1e-5)
    assert frobenius_error(out, ref) < 2e-3
    g, beta = gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    ref_g, ref_beta = fn.gating(inputs["a"], inputs["b"], inputs["A_log"], inputs["dt_bias"])
    torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(beta, ref_beta.float(), rtol=0, atol=2**-8)


@pytest.mark.gpu
def test_gpu_benchmark_cases_run():
    for case in benchmark_cases():
        case["fn"]()
        assert case["bytes"] > 0 and case["flops"] > 0, case["name"]
    torch.cuda.synchronize()


SHORT_PROMPT_PICKS = """
import importlib, json
chunk = importlib.import_module("qwen_triton.operators.gated_delta_rule.chunk")
conv = importlib.import_module("qwen_triton.operators.conv.causal_conv1d")
import triton.language as tl
picks, float32 = {}, {}
for name in ("prepare", "state", "output"):
    kernel = getattr(chunk, f"_chunk_{name}_kernel")
    prune = kernel.early_config_prune
    kept = [len(prune(kernel.configs, dict(chunk_bucket=bucket), PRECISION="tf32", CHUNK_ROWS=rows,
                      DOT_DTYPE=tl.bfloat16)) for rows in (64, 32) for bucket in (2, 4, 8, 64)]
    picks[name] = [kept, len(kernel.configs)]
for name in ("prepare", "inverse", "products", "state", "output"):
    kernel = getattr(chunk, f"_chunk_{name}_kernel")
    float32[name] = [[c is kernel.configs[0] for c in kernel.early_config_prune(
                          kernel.configs, dict(chunk_bucket=64), PRECISION=precision, CHUNK_ROWS=64,
                          DOT_DTYPE=tl.float32)]
                     for precision in ("tf32", "ieee")]
    float32[name].append(len(kernel.early_config_prune(kernel.configs, dict(chunk_bucket=64), PRECISION="tf32",
                                                       CHUNK_ROWS=64, DOT_DTYPE=tl.bfloat16)))
picks["float32"] = float32
long = {}
for name in ("inverse", "products"):
    kernel = getattr(chunk, f"_chunk_{name}_kernel")
    long[name] = [[[c.num_warps, c.num_stages, c.maxnreg] for c in kernel.early_config_prune(
                       kernel.configs, dict(chunk_bucket=bucket), PRECISION="tf32", CHUNK_ROWS=64,
                       DOT_DTYPE=tl.bfloat16)] for bucket in (32, 64, 128)]
picks["long"] = [long, {name: [pick[key] for key in ("num_warps", "num_stages", "maxnreg")]
                        for name, pick in chunk.LONG_PROMPT_PICKS.items()}]
kernel = conv._causal_conv1d_kernel
kept = [kernel.early_config_prune(kernel.configs, dict(length_bucket=n)) for n in (128, 256, 512, 4096)]
picks["conv"] = [[[(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_C"], c.kwargs["WALK_BLOCKS"], c.num_warps) for c in configs]
                  for configs in kept], len(kernel.configs)]
print(json.dumps(picks))
"""


def test_short_prompts_run_the_swept_configs():
    # outside the interpreter (which keeps one config), with every config: prompts of up to 256 tokens get
    # exactly the pinned config of each chunk kernel (chunks of 64: up to 4 chunks; of 32: up to 8), longer ones
    # the whole tuning space; the prefill conv
    # one pinned config at every length: the tile up to 512 tokens, the walk beyond
    picks = run_without_interpreter(SHORT_PROMPT_PICKS, timeout=300)
    # float32 operands (the "tf32" and "ieee" options): every chunk kernel its first config alone, untuned (their
    # tuning at 4096 tokens faulted on the H200); 16-bit operands: all configs at 64 chunks but kernel 1's parts,
    # whose pins (LONG_PROMPT_PICKS) serve 4096 tokens and more (64 chunks of 64 and more), the whole space below
    for name, (tf32, ieee, sixteen_bit) in picks.pop("float32").items():
        assert tf32 == ieee == [True] and sixteen_bit >= 1, (name, tf32, ieee, sixteen_bit)
        assert (sixteen_bit == 1) == (name in ("inverse", "products")), (name, sixteen_bit)
    long, pinned = picks.pop("long")
    for name, (below, at, above) in long.items():
        assert len(below) > 1 and at == above == [pinned[name]], (name, below, at, above)
    conv_kept, conv_every = picks.pop("conv")
    assert conv_every > 1 and conv_kept == [[[16, 128, 0, 4]]] * 3 + [[[8, 512, 4, 4]]], conv_kept
    for name, (kept, every) in picks.items():
        assert every > 1 and kept == [1, 1, every, every] + [1, 1, 1, every], (name, kept, every)
