"""The attention kernels against the reference math (qwen_triton.reference.functional).

CPU (interpreter) tests use float32 / float16 at small, deliberately awkward shapes (head_dim 40/48/64,
rotary_dim 16/24, groups 1..4, lengths that are not multiples of any block). GPU tests use bfloat16 at
the real Qwen3.5-0.8B shapes (Hq 8, Hkv 2, D 256, rotary 64, theta 1e7).

GPU error bounds: bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3). The kernels round once
at the output (<= u relative per element) and, in attention, round the probabilities to bf16 before P.V
(each weight off by <= u relative, errors that average out over the keys); scores and softmax are fp32.
The reference is computed in float64/float32 from the same bf16 inputs, so the expected relative error
(Frobenius) is ~1e-3; we bound it by 1e-2 (a masking or indexing bug gives O(1)), and every element by
2e-2 + 1e-2 |ref| (a bf16 rounding of values up to ~4 is <= 1.6e-2).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import triton

from qwen_triton.operators.attention import (
    attention_decode,
    attention_prefill,
    benchmark_cases,
    qk_norm_rotary,
    rotary_table,
)
from qwen_triton.operators import attention
from qwen_triton.operators.attention import decode as decode_module
from qwen_triton.reference import functional as fn
from qwen_triton.operators.linear.gemm import apply_prologue

# the interpreter converts one-element arrays to scalars in runtime-bounded loops (numpy deprecation)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# ---- helpers -------------------------------------------------------------------------------------


def tolerance(dtype):
    return {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}[dtype]


def split_qkv(qkv, num_heads, num_kv_heads, head_dim, gated):
    """The reference's view of the fused projection row: q [M, Hq, D], k, v [M, Hkv, D]."""
    rows = qkv.shape[0]
    q_width = num_heads * head_dim * (2 if gated else 1)
    q = qkv[:, :q_width]
    if gated:
        q = q.reshape(rows, num_heads, 2 * head_dim).chunk(2, dim=-1)[0]
    q = q.reshape(rows, num_heads, head_dim)
    k = qkv[:, q_width:q_width + num_kv_heads * head_dim].reshape(rows, num_kv_heads, head_dim)
    v = qkv[:, q_width + num_kv_heads * head_dim:].reshape(rows, num_kv_heads, head_dim)
    return q, k, v


def reference_qk_norm_rotary(qkv, q_weight, k_weight, positions, rotary_dim, theta, eps, heads, kv_heads, dim, gated):
    """Reference q and k in float32 (from the kernel's inputs, upcast), and v."""
    q, k, v = split_qkv(qkv.float(), heads, kv_heads, dim, gated)
    cos, sin = fn.rotary_cos_sin(positions.long(), rotary_dim, theta)
    q = fn.apply_rotary(fn.rms_norm(q, q_weight.float(), eps), cos, sin)
    k = fn.apply_rotary(fn.rms_norm(k, k_weight.float(), eps), cos, sin)
    return q, k, v


def reference_decode(q, key_cache, value_cache, lengths):
    out = []
    for b in range(q.shape[0]):
        length = int(lengths[b])
        if length == 0:
            out.append(torch.zeros_like(q[b]))
            continue
        position = torch.tensor([length - 1], device=q.device)
        out.append(fn.attention(q[b:b + 1], key_cache[b], value_cache[b], position, length)[0])
    return torch.stack(out)


def assert_bf16_close(actual, expected):
    actual, expected = actual.double(), expected.double()
    relative = (actual - expected).norm() / expected.norm()
    assert relative < 1e-2, f"relative error {relative:.2e}"
    bound = 2e-2 + 1e-2 * expected.abs()
    worst = ((actual - expected).abs() - bound).max()
    assert worst <= 0, f"an element exceeds its bound by {worst:.2e}"


# ---- CPU / interpreter -----------------------------------------------------------------------------


def test_rotary_table_matches_reference():
    table = rotary_table(50, 24, 1e7)
    cos, sin = fn.rotary_cos_sin(torch.arange(50), 24, 1e7)
    assert table.dtype == torch.float32 and table.shape == (50, 24)
    torch.testing.assert_close(table[:, :12], cos[:, :12], rtol=0, atol=0)
    torch.testing.assert_close(table[:, 12:], sin[:, :12], rtol=0, atol=0)


@pytest.mark.parametrize(
    "heads, kv_heads, dim, rotary_dim, gated, dtype",
    [
        (4, 2, 40, 16, True, torch.float32),
        (4, 1, 48, 24, False, torch.float16),
        (2, 2, 64, 64, True, torch.float32),
        (8, 2, 64, 16, True, torch.float16),
    ],
)
def test_qk_norm_rotary(heads, kv_heads, dim, rotary_dim, gated, dtype, device):
    torch.manual_seed(0)
    rows, max_batch, max_length, theta, eps = 5, 3, 40, 1e4, 1e-6
    width = (heads * (2 if gated else 1) + 2 * kv_heads) * dim
    # rows strided inside a wider buffer, as a view of a fused projection output would be
    buffer = torch.randn(rows, width + 24, device=device, dtype=dtype)
    qkv = buffer[:, 8:8 + width]
    q_weight = (torch.randn(dim, device=device) * 0.2).to(dtype)
    k_weight = (torch.randn(dim, device=device) * 0.2).to(dtype)
    table = rotary_table(max_length, rotary_dim, theta, device)
    positions = torch.tensor([0, 7, 39, 7, 12], device=device, dtype=torch.int32)
    slots = torch.tensor([0, 0, 1, 2, 2], device=device, dtype=torch.int32)
    key_cache = torch.randn(max_batch, kv_heads, max_length, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    key_before, value_before = key_cache.clone(), value_cache.clone()

    q = qk_norm_rotary(qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, gated=gated, eps=eps)

    ref_q, ref_k, ref_v = reference_qk_norm_rotary(
        qkv, q_weight, k_weight, positions, rotary_dim, theta, eps, heads, kv_heads, dim, gated)
    assert q.shape == (rows, heads, dim) and q.dtype == dtype
    torch.testing.assert_close(q.float(), ref_q, **tolerance(dtype))
    written = torch.zeros(max_batch, max_length, dtype=torch.bool)
    for row in range(rows):
        slot, position = int(slots[row]), int(positions[row])
        written[slot, position] = True
        torch.testing.assert_close(key_cache[slot, :, position].float(), ref_k[row], **tolerance(dtype))
        torch.testing.assert_close(value_cache[slot, :, position], ref_v[row].to(dtype), rtol=0, atol=0)
    untouched = ~written.to(device)
    assert torch.equal(key_cache.transpose(1, 2)[untouched], key_before.transpose(1, 2)[untouched])
    assert torch.equal(value_cache.transpose(1, 2)[untouched], value_before.transpose(1, 2)[untouched])


@pytest.mark.parametrize("rows_per_program", [4, 16])
def test_qk_norm_rotary_rows_per_program(rows_per_program, device, monkeypatch):
    """A program taking several rows (the prompt configs) writes exactly what one program per row does: 5 and 21
    rows, neither a multiple of the rows per program, the last program's missing rows untouched."""
    kernel = importlib.import_module("qwen_triton.operators.attention.qk_norm_rotary")._qk_norm_rotary_kernel
    heads, kv_heads, dim, rotary_dim, max_length = 4, 2, 32, 16, 40
    width = (2 * heads + 2 * kv_heads) * dim
    for rows in (5, 21):
        generator = torch.Generator().manual_seed(rows)
        qkv = torch.randn(rows, width, generator=generator).to(device)
        weight = (torch.randn(dim, generator=generator) * 0.2).to(device)
        table = rotary_table(max_length, rotary_dim, 1e4, device)
        positions = torch.arange(rows, device=device, dtype=torch.int32) % max_length
        slots = (torch.arange(rows, device=device, dtype=torch.int32) % 2)
        results = []
        for per_program in (1, rows_per_program):
            monkeypatch.setattr(kernel, "configs", [triton.Config({"ROWS": per_program}, num_warps=2)])
            monkeypatch.setattr(kernel, "cache", {})
            cache = [torch.zeros(2, kv_heads, max_length, dim, device=device) for _ in range(2)]
            q = qk_norm_rotary(qkv, weight, weight, table, positions, slots, *cache,
                               num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
            results.append((q, *cache))
        for one, several in zip(*results):
            assert torch.equal(one, several)


def test_qk_norm_rotary_out_argument(device):
    heads, kv_heads, dim = 2, 1, 32
    qkv = torch.randn(3, (2 * heads + 2 * kv_heads) * dim, device=device)
    weight = torch.zeros(dim, device=device)
    table = rotary_table(8, 16, 1e4, device)
    positions = torch.arange(3, device=device, dtype=torch.int32)
    slots = torch.zeros(3, device=device, dtype=torch.int32)
    cache = torch.zeros(1, kv_heads, 8, dim, device=device), torch.zeros(1, kv_heads, 8, dim, device=device)
    out = torch.empty(3, heads, dim, device=device)
    result = qk_norm_rotary(qkv, weight, weight, table, positions, slots, *cache,
                            num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, out=out)
    assert result is out


@pytest.mark.parametrize(
    "heads, kv_heads, dim, length, start, dtype",
    [
        (4, 4, 40, 70, 0, torch.float32),   # group 1, two token blocks
        (4, 2, 48, 37, 0, torch.float16),   # group 2
        (8, 2, 64, 45, 30, torch.float32),  # group 4, a cached prefix (unmasked key tiles)
        (6, 2, 40, 29, 11, torch.float32),  # group 3: rows of a block not a multiple of the group
        (4, 1, 64, 1, 50, torch.float16),   # one token after a long prefix
    ],
)
def test_attention_prefill(heads, kv_heads, dim, length, start, dtype, device):
    torch.manual_seed(1)
    max_batch, max_length, slot = 3, 96, 1
    q = torch.randn(length, heads, dim, device=device, dtype=dtype)
    key_cache = torch.randn(max_batch, kv_heads, max_length, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    out = attention_prefill(q, key_cache, value_cache, slot, start)
    positions = torch.arange(start, start + length, device=device)
    ref = fn.attention(q.float(), key_cache[slot].float(), value_cache[slot].float(), positions, start + length)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))


def test_attention_prefill_strided_q_and_out(device):
    torch.manual_seed(2)
    heads, kv_heads, dim, length = 4, 2, 32, 20
    wide = torch.randn(length, heads, dim + 16, device=device)
    q = wide[:, :, :dim]
    key_cache = torch.randn(1, kv_heads, 32, dim, device=device)
    value_cache = torch.randn_like(key_cache)
    out_buffer = torch.zeros(length, heads, 2 * dim, device=device)
    out = out_buffer[:, :, dim:]
    attention_prefill(q, key_cache, value_cache, 0, 0, out=out)
    ref = fn.attention(q, key_cache[0], value_cache[0], torch.arange(length, device=device), length)
    torch.testing.assert_close(out, ref, **tolerance(torch.float32))
    assert torch.equal(out_buffer[:, :, :dim], torch.zeros_like(q))


@pytest.mark.parametrize(
    "heads, kv_heads, dim, dtype, num_splits, split_align",
    [
        (8, 2, 64, torch.float32, 3, 16),   # group 4, splits of 48 keys at length 100
        (4, 4, 40, torch.float16, 5, 16),   # group 1
        (4, 2, 48, torch.float32, None, 16),  # default split count
        (2, 1, 64, torch.float32, 1, 64),   # a single split
    ],
)
def test_attention_decode(heads, kv_heads, dim, dtype, num_splits, split_align, device):
    torch.manual_seed(3)
    max_length = 100
    lengths = torch.tensor([1, 100, 33, 48, 49, 0], device=device, dtype=torch.int32)
    batch = lengths.shape[0]
    q = torch.randn(batch, heads, dim, device=device, dtype=dtype)
    key_cache = torch.randn(batch + 1, kv_heads, max_length, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    out = attention_decode(q, key_cache, value_cache, lengths, num_splits=num_splits, split_align=split_align)
    ref = reference_decode(q.float(), key_cache.float(), value_cache.float(), lengths)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **tolerance(dtype))


def test_attention_decode_matches_prefill_last_row(device):
    torch.manual_seed(4)
    heads, kv_heads, dim, length = 4, 2, 32, 41
    q = torch.randn(length, heads, dim, device=device)
    key_cache = torch.randn(1, kv_heads, 64, dim, device=device)
    value_cache = torch.randn_like(key_cache)
    prefill = attention_prefill(q, key_cache, value_cache, 0, 0)
    lengths = torch.tensor([length], device=device, dtype=torch.int32)
    decode = attention_decode(q[-1:], key_cache, value_cache, lengths, num_splits=4, split_align=8)
    torch.testing.assert_close(decode[0], prefill[-1], rtol=1e-5, atol=1e-5)


def test_attention_decode_over_slots(device):
    """Row b attends over cache slot slots[b] (slots [3, 1] among 5, a padding row of slot -1): each row equals
    that slot decoded alone, bit for bit, and the padding row gets zeros."""
    torch.manual_seed(6)
    heads, kv_heads, dim, max_length = 4, 2, 40, 50
    q = torch.randn(3, heads, dim, device=device)
    key_cache = torch.randn(5, kv_heads, max_length, dim, device=device)
    value_cache = torch.randn_like(key_cache)
    lengths = torch.tensor([37, 9, 20], device=device, dtype=torch.int32)
    slots = torch.tensor([3, 1, -1], device=device, dtype=torch.int32)
    options = dict(num_splits=3, split_align=16)
    out = torch.full_like(q, float("nan"))
    attention_decode(q, key_cache, value_cache, lengths, out=out, slots=slots, **options)
    for row, slot in enumerate([3, 1]):
        alone = attention_decode(q[row:row + 1], key_cache, value_cache, lengths[row:row + 1],
                                 slots=slots[row:row + 1], **options)
        assert torch.equal(out[row], alone[0])
        ref = reference_decode(q[row:row + 1], key_cache[slot:slot + 1], value_cache[slot:slot + 1],
                               lengths[row:row + 1])
        torch.testing.assert_close(out[row:row + 1], ref, **tolerance(torch.float32))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    with pytest.raises(ValueError, match="slots has dtype"):
        attention_decode(q, key_cache, value_cache, lengths, slots=slots.long())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_decode_gate_in_the_merge(dtype, device):
    """With gate, out is the ungated output times sigmoid(gate), bit for bit the out-projection's gate prologue
    (gemm.apply_prologue) (so the decode step's bits do not change when the gate moves into the merge); a strided gate (q | gate columns
    of one projection) reads its own columns; a gate of the wrong shape is refused."""
    torch.manual_seed(8)
    heads, kv_heads, dim, max_length = 4, 2, 40, 50
    q = torch.randn(3, heads, dim, device=device, dtype=dtype)
    key_cache = torch.randn(5, kv_heads, max_length, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lengths = torch.tensor([37, 9, 20], device=device, dtype=torch.int32)
    slots = torch.tensor([3, 1, -1], device=device, dtype=torch.int32)
    projection = torch.randn(3, 2 * heads * dim, device=device, dtype=dtype) * 3
    gate = projection[:, heads * dim:]  # row stride 2 * heads * dim
    options = dict(slots=slots, num_splits=3, split_align=16)
    plain = attention_decode(q, key_cache, value_cache, lengths, **options)
    gated = attention_decode(q, key_cache, value_cache, lengths, gate=gate, **options)
    assert torch.equal(gated.view(3, -1), apply_prologue(plain.view(3, -1), gate, None, 1e-6))
    torch.testing.assert_close(gated.float(), plain.float() * torch.sigmoid(gate.float()).view_as(plain),
                               **tolerance(dtype))
    with pytest.raises(ValueError, match="gate"):
        attention_decode(q, key_cache, value_cache, lengths, gate=gate[:, :-1], **options)


PACKED_LENGTHS = (1, 5, 63, 64, 65, 130)
PACKED_STARTS = (0, 7, 0, 30, 2, 41)  # cached tokens before each sequence: unmasked key tiles
PACKED_SLOTS = (4, 0, 6, 2, 5, 1)  # any order


@pytest.mark.parametrize(
    "heads, kv_heads, dim, dtype",
    [
        (4, 2, 48, torch.float32),  # group 2: 32 rows a program, two parts a block
        (6, 2, 40, torch.float32),  # group 3: 21 rows a part, a block in four parts, the last of one row
        (4, 4, 32, torch.float16),  # group 1: a part of 64 rows
    ],
)
def test_attention_prefill_packed_equals_one_call_each(heads, kv_heads, dim, dtype, device):
    """Six sequences of 1 to 130 tokens after 0 to 41 cached ones, in slots in any order, a bucket's tail of one
    block after them: each sequence's rows as one call of attention_prefill on its slot (bit for bit where the
    parts are its blocks: groups 1 and 2), against the reference; padding rows zero; q's padding rows (NaN) never
    read."""
    from qwen_triton.operators.packed import PackedLayout

    torch.manual_seed(8)
    layout = PackedLayout.of(PACKED_LENGTHS, PACKED_STARTS, PACKED_SLOTS, tokens=704)
    key_cache = torch.randn(7, kv_heads, 200, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    q = layout.pack([torch.randn(n, heads, dim, device=device, dtype=dtype) for n in PACKED_LENGTHS],
                    fill=float("nan"))
    out = torch.full_like(q, 5.0)
    assert attention.attention_prefill_packed(q, key_cache, value_cache, layout.blocks().to(device), out=out) is out
    for rows, result, start, slot in zip(layout.unpack(q), layout.unpack(out), layout.starts, layout.slots):
        positions = torch.arange(start, start + rows.shape[0], device=device)
        ref = fn.attention(rows.float(), key_cache[slot].float(), value_cache[slot].float(), positions,
                           start + rows.shape[0])
        torch.testing.assert_close(result.float(), ref, **tolerance(dtype))
        if heads // kv_heads in (1, 2):
            assert torch.equal(result, attention_prefill(rows, key_cache, value_cache, slot, start))
    padding = layout.token_slots().to(device) < 0
    assert (out[padding] == 0).all()


def test_attention_prefill_packed_argument_errors(device):
    from qwen_triton.operators.packed import PackedLayout

    layout = PackedLayout.of([3, 70])
    q = torch.randn(layout.tokens, 4, 32, device=device)
    key_cache = torch.zeros(2, 2, 160, 32, device=device)
    blocks = layout.blocks().to(device)
    with pytest.raises(ValueError, match="blocks"):
        attention.attention_prefill_packed(q, key_cache, key_cache, blocks[1:])
    with pytest.raises(ValueError, match="multiple of 64"):
        attention.attention_prefill_packed(q[:100], key_cache, key_cache, blocks)
    with pytest.raises(ValueError, match="value_cache"):
        attention.attention_prefill_packed(q, key_cache, key_cache[:1], blocks)
    with pytest.raises(ValueError, match="q has 3 heads"):
        attention.attention_prefill_packed(q[:, :3], key_cache, key_cache, blocks)


def test_qk_norm_rotary_writes_no_cache_for_a_padding_row(device):
    torch.manual_seed(7)
    heads, kv_heads, dim, max_length = 2, 1, 32, 8
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim, device=device)
    weight = torch.zeros(dim, device=device)
    table = rotary_table(max_length, 16, 1e4, device)
    key_cache = torch.randn(3, kv_heads, max_length, dim, device=device)
    value_cache = torch.randn_like(key_cache)
    before = key_cache.clone(), value_cache.clone()
    positions = torch.tensor([2, 0], device=device, dtype=torch.int32)
    slots = torch.tensor([2, -1], device=device, dtype=torch.int32)
    q = qk_norm_rotary(qkv, weight, weight, table, positions, slots, key_cache, value_cache,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, gated=False)
    assert torch.isfinite(q).all()
    for cache, old in zip((key_cache, value_cache), before):
        assert not torch.equal(cache[2, :, 2], old[2, :, 2])  # the real row's write
        cache[2, :, 2] = old[2, :, 2]
        assert torch.equal(cache, old)  # and nothing else


def test_deterministic_and_allocation_free(device):
    torch.manual_seed(5)
    heads, kv_heads, dim = 4, 2, 32
    q = torch.randn(2, heads, dim, device=device)
    key_cache = torch.randn(2, kv_heads, 80, dim, device=device)
    value_cache = torch.randn_like(key_cache)
    lengths = torch.tensor([77, 5], device=device, dtype=torch.int32)
    out = torch.empty_like(q)
    first = attention_decode(q, key_cache, value_cache, lengths, out=out, num_splits=4, split_align=16).clone()
    workspaces = dict(decode_module._WORKSPACES)
    second = attention_decode(q, key_cache, value_cache, lengths, out=out, num_splits=4, split_align=16)
    assert second is out and torch.equal(first, second)
    assert all(decode_module._WORKSPACES[k] is v for k, v in workspaces.items())
    assert len(decode_module._WORKSPACES) == len(workspaces)
    prompt = torch.randn(30, heads, dim, device=device)
    assert torch.equal(attention_prefill(prompt, key_cache, value_cache, 1, 9),
                       attention_prefill(prompt, key_cache, value_cache, 1, 9))


def test_errors_name_the_tensor(device):
    heads, kv_heads, dim = 4, 2, 32
    qkv = torch.randn(3, (2 * heads + 2 * kv_heads) * dim, device=device)
    weight = torch.zeros(dim, device=device)
    table = rotary_table(16, 16, 1e4, device)
    positions = torch.arange(3, device=device, dtype=torch.int32)
    slots = torch.zeros(3, device=device, dtype=torch.int32)
    key_cache = torch.zeros(2, kv_heads, 16, dim, device=device)
    value_cache = torch.zeros_like(key_cache)
    shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)

    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rotary(qkv[:, :-1], weight, weight, table, positions, slots, key_cache, value_cache, **shape)
    with pytest.raises(ValueError, match="positions"):
        qk_norm_rotary(qkv, weight, weight, table, positions.long(), slots, key_cache, value_cache, **shape)
    with pytest.raises(ValueError, match="slots"):
        qk_norm_rotary(qkv, weight, weight, table, positions, slots[:2], key_cache, value_cache, **shape)
    with pytest.raises(ValueError, match="cos_sin"):
        qk_norm_rotary(qkv, weight, weight, table.double(), positions, slots, key_cache, value_cache, **shape)
    with pytest.raises(ValueError, match="k_norm_weight"):
        qk_norm_rotary(qkv, weight, weight[:-1], table, positions, slots, key_cache, value_cache, **shape)
    with pytest.raises(ValueError, match="key_cache"):
        qk_norm_rotary(qkv, weight, weight, table, positions, slots, key_cache.half(), value_cache, **shape)
    with pytest.raises(ValueError, match="value_cache"):
        qk_norm_rotary(qkv, weight, weight, table, positions, slots, key_cache, value_cache[:1], **shape)

    q = torch.randn(5, heads, dim, device=device)
    with pytest.raises(ValueError, match="q "):
        attention_prefill(q[0], key_cache, value_cache, 0, 0)
    with pytest.raises(ValueError, match="value_cache"):
        attention_prefill(q, key_cache, value_cache.half(), 0, 0)
    with pytest.raises(ValueError, match="max_length"):
        attention_prefill(q, key_cache, value_cache, 0, 12)
    with pytest.raises(ValueError, match="out"):
        attention_prefill(q, key_cache, value_cache, 0, 0, out=torch.empty(5, heads, dim + 1, device=device))
    with pytest.raises(ValueError, match="q has 3 heads"):
        attention_prefill(q[:, :3], key_cache, value_cache, 0, 0)

    lengths = torch.ones(2, device=device, dtype=torch.int32)
    with pytest.raises(ValueError, match="lengths"):
        attention_decode(q[:2], key_cache, value_cache, lengths.long())
    with pytest.raises(ValueError, match="key_cache"):
        attention_decode(q[:2], key_cache[..., :-1], value_cache, lengths)
    with pytest.raises(ValueError, match="q has batch 3"):
        attention_decode(q[:3], key_cache, value_cache, torch.ones(3, device=device, dtype=torch.int32))
    with pytest.raises(ValueError, match="out"):
        attention_decode(q[:2], key_cache, value_cache, lengths, out=torch.empty(2, heads, dim, device=device).half())


def test_benchmark_cases_listing():
    cases = benchmark_cases(device="cpu")
    names = [case["name"] for case in cases]
    for expected in ("prefill T=128", "prefill T=4096", "decode L=128", "decode L=4096", "decode L=32768"):
        assert any(expected in name for name in names)
    for case in cases:
        assert callable(case["fn"]) and case["bytes"] > 0 and case["flops"] > 0


# ---- GPU, bfloat16, the real shapes ---------------------------------------------------------------

HEADS, KV_HEADS, DIM, ROTARY, THETA, EPS = 8, 2, 256, 64, 1e7, 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4096])
def test_gpu_qk_norm_rotary(rows):
    torch.manual_seed(10)
    device, dtype = "cuda", torch.bfloat16
    width = (2 * HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(rows, width, device=device, dtype=dtype) * 3
    q_weight = (torch.randn(DIM, device=device) * 0.3).to(dtype)
    k_weight = (torch.randn(DIM, device=device) * 0.3).to(dtype)
    max_length = 32768
    table = rotary_table(max_length, ROTARY, THETA, device)
    positions = (torch.arange(rows, device=device, dtype=torch.int32) * 7 + 3) % max_length
    slots = (torch.arange(rows, device=device, dtype=torch.int32) % 2)
    if rows == 4096:  # distinct (slot, position) pairs
        positions = torch.arange(rows, device=device, dtype=torch.int32) * 8 + slots
    key_cache = torch.zeros(2, KV_HEADS, max_length, DIM, device=device, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    q = qk_norm_rotary(qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS)
    ref_q, ref_k, ref_v = reference_qk_norm_rotary(
        qkv, q_weight, k_weight, positions, ROTARY, THETA, EPS, HEADS, KV_HEADS, DIM, True)
    assert_bf16_close(q, ref_q)
    slots_long, positions_long = slots.long(), positions.long()
    assert_bf16_close(key_cache[slots_long, :, positions_long], ref_k)
    assert torch.equal(value_cache[slots_long, :, positions_long], ref_v.to(dtype))
    written = torch.zeros(2, max_length, dtype=torch.bool, device=device)
    written[slots_long, positions_long] = True
    assert torch.count_nonzero(key_cache.transpose(1, 2)[~written]) == 0


@pytest.mark.gpu
def test_gpu_qk_norm_rotary_every_config():
    """Every config (rows per program, warps) pinned in turn at 4097 rows writes what one row per program at the
    same warps does."""
    module = importlib.import_module("qwen_triton.operators.attention.qk_norm_rotary")
    kernel, configs = module._qk_norm_rotary_kernel, list(module._qk_norm_rotary_kernel.configs)
    rows, max_length, dtype = 4097, 8200, torch.bfloat16
    generator = torch.Generator().manual_seed(11)
    qkv = (torch.randn(rows, (2 * HEADS + 2 * KV_HEADS) * DIM, generator=generator) * 3).to("cuda", dtype)
    weight = (torch.randn(DIM, generator=generator) * 0.3).to("cuda", dtype)
    table = rotary_table(max_length, ROTARY, THETA, "cuda")
    positions = torch.arange(rows, device="cuda", dtype=torch.int32) * 2 % max_length
    slots = torch.zeros(rows, device="cuda", dtype=torch.int32)

    def run(config):
        kernel.configs, kernel.cache = [config], {}
        cache = [torch.zeros(1, KV_HEADS, max_length, DIM, device="cuda", dtype=dtype) for _ in range(2)]
        q = qk_norm_rotary(qkv, weight, weight, table, positions, slots, *cache,
                           num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS)
        return q, *cache

    try:
        # the warps change the norm's reduction order, the rows per program nothing
        expected = {warps: run(triton.Config({"ROWS": 1}, num_warps=warps)) for warps in (1, 2, 4)}
        for config in module.CONFIGS:
            for got, want in zip(run(config), expected[config.num_warps]):
                assert torch.equal(got, want), (config.kwargs, config.num_warps)
    finally:
        kernel.configs, kernel.cache = configs, {}


@pytest.mark.gpu
@pytest.mark.parametrize("length, start", [(128, 0), (4096, 0), (1000, 3000)])
def test_gpu_attention_prefill(length, start):
    torch.manual_seed(11)
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(length, HEADS, DIM, device=device, dtype=dtype) * 2
    key_cache = torch.randn(2, KV_HEADS, 4096, DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    out = attention_prefill(q, key_cache, value_cache, 1, start)
    positions = torch.arange(start, start + length, device=device)
    ref = fn.attention(q.double(), key_cache[1].double(), value_cache[1].double(), positions, start + length)
    assert_bf16_close(out, ref)
    assert torch.equal(out, attention_prefill(q, key_cache, value_cache, 1, start))


@pytest.mark.gpu
def test_gpu_attention_prefill_packed():
    """The real shape in bf16: eight prompts of 1 to 1,531 tokens after 0 to 500 cached, in slots in any order: each
    as one call of attention_prefill on its slot (bit for bit where the two autotuners chose the same tiles: within
    bf16 roundings), and the reference; padding rows zero."""
    from qwen_triton.operators.packed import PackedLayout

    torch.manual_seed(9)
    lengths, starts = (1, 5, 63, 64, 65, 130, 700, 1531), (0, 7, 0, 30, 2, 41, 500, 0)
    layout = PackedLayout.of(lengths, starts, (3, 0, 7, 1, 6, 2, 5, 4))
    key_cache = torch.randn(8, 2, 2048, 256, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn_like(key_cache)
    q = layout.pack([torch.randn(n, 8, 256, device="cuda", dtype=torch.bfloat16) for n in lengths], fill=float("nan"))
    out = attention.attention_prefill_packed(q, key_cache, value_cache, layout.blocks().cuda())
    for rows, result, start, slot in zip(layout.unpack(q), layout.unpack(out), layout.starts, layout.slots):
        assert_bf16_close(result, attention_prefill(rows, key_cache, value_cache, slot, start))
        positions = torch.arange(start, start + rows.shape[0], device="cuda")
        assert_bf16_close(result, fn.attention(rows.double(), key_cache[slot].double(), value_cache[slot].double(),
                                               positions, start + rows.shape[0]))
    assert (out[layout.token_slots().cuda() < 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[128], [4096], [32768], [1, 130, 4097, 32768]])
def test_gpu_attention_decode(lengths):
    torch.manual_seed(12)
    device, dtype = "cuda", torch.bfloat16
    max_length, batch = 32768, len(lengths)
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=dtype) * 2
    key_cache = torch.randn(batch, KV_HEADS, max_length, DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lengths = torch.tensor(lengths, device=device, dtype=torch.int32)
    out = attention_decode(q, key_cache, value_cache, lengths)
    ref = reference_decode(q.double(), key_cache.double(), value_cache.double(), lengths)
    assert_bf16_close(out, ref)
    assert torch.equal(out, attention_decode(q, key_cache, value_cache, lengths))


@pytest.mark.gpu
def test_gpu_attention_decode_gate_in_the_merge():
    """bf16 at the 0.8B's heads: the gated merge equals the ungated output through the out-projection's gate prologue
    (gemm.apply_prologue), bit for bit."""
    torch.manual_seed(14)
    device, dtype = "cuda", torch.bfloat16
    q = torch.randn(16, HEADS, DIM, device=device, dtype=dtype) * 2
    key_cache = torch.randn(16, KV_HEADS, 512, DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    lengths = torch.randint(1, 513, (16,), device=device, dtype=torch.int32)
    gate = torch.randn(16, 2 * HEADS * DIM, device=device, dtype=dtype)[:, :HEADS * DIM]
    plain = attention_decode(q, key_cache, value_cache, lengths)
    gated = attention_decode(q, key_cache, value_cache, lengths, gate=gate)
    assert torch.equal(gated.view(16, -1), apply_prologue(plain.view(16, -1), gate, None, 1e-6))


@pytest.mark.gpu
def test_gpu_decode_over_slots_in_a_cuda_graph():
    """qk_norm_rotary + attention_decode over slots read from a device buffer, captured once and replayed with
    new slot sets written into it (a padding row among them): each row writes its key and value at its slot and
    attends as that slot alone does, bit for bit (the split count of batch 1 for every batch, as the engine
    runs it); the padding row writes no cache and gets zeros."""
    torch.manual_seed(14)
    device, dtype, batch, max_batch, max_length = "cuda", torch.bfloat16, 3, 6, 4096
    width = (2 * HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(batch, width, device=device, dtype=dtype)
    weight = (torch.randn(DIM, device=device) * 0.3).to(dtype)
    table = rotary_table(max_length, ROTARY, THETA, device)
    key_cache = torch.randn(max_batch, KV_HEADS, max_length, DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    positions = torch.tensor([100, 4000, 7], device=device, dtype=torch.int32)
    lengths = positions + 1
    slots = torch.tensor([0, 1, 2], device=device, dtype=torch.int32)
    splits = attention.decode_splits(1, KV_HEADS, max_length, device)
    q_out = torch.empty(batch, HEADS, DIM, device=device, dtype=dtype)
    out = torch.empty_like(q_out)

    def step():
        qk_norm_rotary(qkv, weight, weight, table, positions, slots, key_cache, value_cache,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS, out=q_out)
        attention_decode(q_out, key_cache, value_cache, lengths, out=out, slots=slots, num_splits=splits)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes and allocates the workspace
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_slots in ([5, 0, 3], [2, 4, -1], [1, 5, 0]):
        slots.copy_(torch.tensor(new_slots, device=device, dtype=torch.int32))
        before = key_cache.clone(), value_cache.clone()
        graph.replay()
        written = [tensor.clone() for tensor in before]
        for row, slot in enumerate(new_slots):
            if slot < 0:
                assert torch.equal(out[row], torch.zeros_like(out[row]))
                continue
            position = int(positions[row])
            for cache, expected, old in zip((key_cache, value_cache), written, before):
                assert not torch.equal(cache[slot, :, position], old[slot, :, position])
                expected[slot, :, position] = cache[slot, :, position]
            alone = attention_decode(q_out[row:row + 1], key_cache, value_cache, lengths[row:row + 1],
                                     slots=slots[row:row + 1], num_splits=splits)
            assert torch.equal(out[row], alone[0]), (new_slots, row)
        # the rows' writes and nothing else (none by the padding row)
        assert torch.equal(key_cache, written[0]) and torch.equal(value_cache, written[1])


@pytest.mark.gpu
def test_gpu_decode_step_cuda_graph():
    """qk_norm_rotary + attention_decode captured once, replayed at new positions without host reads."""
    torch.manual_seed(13)
    device, dtype, batch, max_length = "cuda", torch.bfloat16, 2, 8192
    width = (2 * HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(batch, width, device=device, dtype=dtype)
    weight = (torch.randn(DIM, device=device) * 0.3).to(dtype)
    table = rotary_table(max_length, ROTARY, THETA, device)
    key_cache = torch.randn(batch, KV_HEADS, max_length, DIM, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    positions = torch.tensor([5, 700], device=device, dtype=torch.int32)
    lengths = positions + 1
    slots = torch.arange(batch, device=device, dtype=torch.int32)
    q_out = torch.empty(batch, HEADS, DIM, device=device, dtype=dtype)
    out = torch.empty_like(q_out)

    def step():
        qk_norm_rotary(qkv, weight, weight, table, positions, slots, key_cache, value_cache,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, eps=EPS, out=q_out)
        torch.add(positions, 1, out=lengths)
        attention_decode(q_out, key_cache, value_cache, lengths, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # autotunes and allocates the workspace
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for new_positions in ([6, 701], [4000, 8191], [0, 64]):
        positions.copy_(torch.tensor(new_positions, dtype=torch.int32))
        qkv.copy_(torch.randn_like(qkv))
        graph.replay()
        torch.cuda.synchronize()
        graph_out = out.clone()
        step()
        assert torch.equal(graph_out, out)
        ref = reference_decode(q_out.double(), key_cache.double(), value_cache.double(), lengths)
        assert_bf16_close(out, ref)


def test_decode_split_count(monkeypatch):
    """About PROGRAMS_PER_SM split programs per SM at full length, never a split shorter than split_align."""
    from qwen_triton.operators.attention import decode

    monkeypatch.setattr(decode, "sm_count", lambda device: 132)
    assert decode.decode_splits(1, 2, 32980, "cpu") == 132  # 2 per SM over the 2 KV heads
    assert decode.decode_splits(1, 2, 100, "cpu") == 2  # 64-key splits
    assert decode.decode_splits(4, 2, 32980, "cpu") == 33
    monkeypatch.setattr(decode, "PROGRAMS_PER_SM", 0.5)
    assert decode.decode_splits(1, 2, 32980, "cpu") == 33


def test_decode_kernels_tune_over_every_config(monkeypatch):
    """No pin: the split and merge kernels' autotuners hold their whole config spaces (on a GPU) and prune none."""
    from qwen_triton.operators.attention import decode

    monkeypatch.setattr(decode, "autotune_configs", lambda configs: configs)
    for kernel, space in ((decode._decode_split_kernel, decode._split_configs()),
                          (decode._decode_merge_kernel, decode._merge_configs())):
        assert len(space) > 1 and kernel.early_config_prune is None
