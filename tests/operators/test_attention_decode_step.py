"""attention_decode_step (q/k norm + rotary + KV write + split attention + merge in one launch) against the three
kernels it replaces and against the reference math.

CPU (interpreter): float32 / float16 at small awkward shapes, as tests/operators/test_attention.py. GPU: bfloat16
at the real Qwen3.5-0.8B shapes, error bounds as that file explains.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.attention import attention_decode, qk_norm_rotary, rotary_table
from qwen_triton.operators.attention import decode_step as decode_step_module
from qwen_triton.operators.attention.decode_step import attention_decode_step
from tests.operators.test_attention import (
    DIM, EPS, HEADS, KV_HEADS, ROTARY, THETA, assert_bf16_close, reference_decode, reference_qk_norm_rotary,
    tolerance,
)

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_inputs(heads, kv_heads, dim, rotary_dim, gated, dtype, lengths, max_length, device, theta=1e4, scale=1.0):
    """A qkv row per slot (strided inside a wider buffer), norm weights, the table and random caches."""
    batch = len(lengths)
    width = (heads * (2 if gated else 1) + 2 * kv_heads) * dim
    buffer = torch.randn(batch, width + 24, device=device, dtype=torch.float32) * scale
    qkv = buffer.to(dtype)[:, 8:8 + width]
    q_weight = (torch.randn(dim, device=device) * 0.2).to(dtype)
    k_weight = (torch.randn(dim, device=device) * 0.2).to(dtype)
    table = rotary_table(max_length, rotary_dim, theta, device)
    lengths = torch.tensor(lengths, device=device, dtype=torch.int32)
    positions = lengths - 1
    key_cache = torch.randn(batch + 1, kv_heads, max_length, dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    return qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache


def three_kernels(qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache, shape, **options):
    """What the step replaces: qk_norm_rotary, then attention_decode (slot b = row b)."""
    slots = torch.arange(qkv.shape[0], device=qkv.device, dtype=torch.int32)
    q = qk_norm_rotary(qkv, q_weight, k_weight, table, positions, slots, key_cache, value_cache, eps=EPS, **shape)
    return attention_decode(q, key_cache, value_cache, lengths, **options), q


def check_against_reference(out, caches_before, inputs, shape, rotary_dim, theta, dtype, close):
    """out and the written caches against the float32 reference: q and k normed and rotated, k and v written at
    each row's position, nothing else written, the attention over the updated cache."""
    qkv, q_weight, k_weight, _, positions, lengths, key_cache, value_cache = inputs
    ref_q, ref_k, ref_v = reference_qk_norm_rotary(qkv, q_weight, k_weight, positions, rotary_dim, theta, EPS,
                                                   shape["num_heads"], shape["num_kv_heads"], shape["head_dim"],
                                                   shape["gated"])
    written = torch.zeros(key_cache.shape[0], key_cache.shape[2], dtype=torch.bool, device=key_cache.device)
    ref_key, ref_value = caches_before[0].float(), caches_before[1].float()
    for row, position in enumerate(positions.tolist()):
        written[row, position] = True
        ref_key[row, :, position], ref_value[row, :, position] = ref_k[row], ref_v[row]
    close(key_cache.transpose(1, 2)[written], ref_key.transpose(1, 2)[written])
    assert torch.equal(value_cache.transpose(1, 2)[written], ref_value.to(value_cache.dtype).transpose(1, 2)[written])
    assert torch.equal(key_cache.transpose(1, 2)[~written], caches_before[0].transpose(1, 2)[~written])
    assert torch.equal(value_cache.transpose(1, 2)[~written], caches_before[1].transpose(1, 2)[~written])
    ref = reference_decode(ref_q, ref_key, ref_value, lengths)
    close(out, ref)


# ---- CPU / interpreter -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv_heads, dim, rotary_dim, gated, dtype, num_splits, split_align",
    [
        (8, 2, 64, 16, True, torch.float32, 3, 16),   # group 4, splits of 48 keys at length 100
        (4, 4, 40, 24, False, torch.float16, 5, 16),  # group 1, head dim not a power of two
        (4, 2, 48, 48, True, torch.float32, None, 16),  # the default split count, rotary over the whole head
        (2, 1, 64, 16, False, torch.float32, 1, 64),  # a single split
        (4, 2, 32, 16, True, torch.float32, 20, 8),   # more splits than a merge step folds (8)
    ],
)
def test_decode_step_matches_the_three_kernels(heads, kv_heads, dim, rotary_dim, gated, dtype, num_splits,
                                               split_align, device):
    torch.manual_seed(20)
    max_length = 160
    inputs = make_inputs(heads, kv_heads, dim, rotary_dim, gated, dtype, [1, 100, 33, 48, 49, 160], max_length,
                         device)
    qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache = inputs
    shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, gated=gated)
    caches_before = key_cache.clone(), value_cache.clone()
    options = dict(num_splits=num_splits, split_align=split_align)

    out = attention_decode_step(*inputs, eps=EPS, **shape, **options)

    assert out.shape == (qkv.shape[0], heads, dim) and out.dtype == dtype
    check_against_reference(out.float(), caches_before, inputs, shape, rotary_dim, 1e4, dtype,
                            lambda a, b: torch.testing.assert_close(a.float(), b, **tolerance(dtype)))
    # the three kernels from the same caches: the same writes, the same attention within rounding
    key_three, value_three = caches_before[0].clone(), caches_before[1].clone()
    three, _ = three_kernels(qkv, q_weight, k_weight, table, positions, lengths, key_three, value_three, shape,
                             **options)
    assert torch.equal(key_cache, key_three) and torch.equal(value_cache, value_three)
    torch.testing.assert_close(out, three, **tolerance(dtype))
    # the counters are left zero; a second launch gives the same bits
    assert all(int(counters.abs().sum()) == 0 for counters in decode_step_module._arrivals.values())
    assert torch.equal(attention_decode_step(*inputs, eps=EPS, **shape, **options), out)


def test_decode_step_out_argument_and_errors(device):
    heads, kv_heads, dim = 4, 2, 32
    inputs = make_inputs(heads, kv_heads, dim, 16, True, torch.float32, [3, 9], 16, device)
    qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache = inputs
    shape = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    out = torch.empty(2, heads, dim, device=device)
    assert attention_decode_step(*inputs, out=out, num_splits=2, split_align=4, **shape) is out

    with pytest.raises(ValueError, match="positions"):
        attention_decode_step(qkv, q_weight, k_weight, table, positions.long(), lengths, key_cache, value_cache,
                              **shape)
    with pytest.raises(ValueError, match="lengths"):
        attention_decode_step(qkv, q_weight, k_weight, table, positions, lengths[:1], key_cache, value_cache,
                              **shape)
    with pytest.raises(ValueError, match="qkv"):
        attention_decode_step(qkv[:, :-1], q_weight, k_weight, table, positions, lengths, key_cache, value_cache,
                              **shape)
    with pytest.raises(ValueError, match="3 rows, more than key_cache's 2 slots"):
        three = lambda t: torch.cat([t, t[:1]])  # noqa: E731
        attention_decode_step(three(qkv), q_weight, k_weight, table, three(positions), three(lengths),
                              key_cache[:2], value_cache[:2], **shape)
    with pytest.raises(ValueError, match="out"):
        attention_decode_step(*inputs, out=out.half(), **shape)
    with pytest.raises(ValueError, match="num_splits"):
        attention_decode_step(*inputs, num_splits=0, **shape)


# ---- GPU, bfloat16, the real shapes ---------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [[128], [4096], [32768], [1, 130, 4097, 32768]])
def test_gpu_attention_decode_step(lengths):
    torch.manual_seed(21)
    inputs = make_inputs(HEADS, KV_HEADS, DIM, ROTARY, True, torch.bfloat16, lengths, 32768, "cuda", theta=THETA,
                         scale=3.0)
    qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache = inputs
    shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, gated=True)
    caches_before = key_cache.clone(), value_cache.clone()
    out = attention_decode_step(*inputs, eps=EPS, **shape)
    check_against_reference(out, caches_before, inputs, shape, ROTARY, THETA, torch.bfloat16, assert_bf16_close)
    key_three, value_three = caches_before[0].clone(), caches_before[1].clone()
    three, _ = three_kernels(qkv, q_weight, k_weight, table, positions, lengths, key_three, value_three, shape)
    assert_bf16_close(out, three.float())
    assert torch.equal(out, attention_decode_step(*inputs, eps=EPS, **shape))


@pytest.mark.gpu
def test_gpu_attention_decode_step_cuda_graph():
    """Captured once with PDL, replayed at new positions: each replay equals the eager launch bit for bit and the
    reference within bf16 rounding."""
    torch.manual_seed(22)
    inputs = make_inputs(HEADS, KV_HEADS, DIM, ROTARY, True, torch.bfloat16, [6, 701], 8192, "cuda", theta=THETA)
    qkv, q_weight, k_weight, table, positions, lengths, key_cache, value_cache = inputs
    shape = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, gated=True)
    out = torch.empty(2, HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    def step():
        attention_decode_step(*inputs, eps=EPS, out=out, pdl=True, **shape)

    step()  # autotunes and allocates the workspace
    for new_positions in ([6, 701], [4000, 8191], [0, 64]):
        positions.copy_(torch.tensor(new_positions, dtype=torch.int32))
        torch.add(positions, 1, out=lengths)
        qkv.copy_(torch.randn_like(qkv))
        caches_before = key_cache.clone(), value_cache.clone()
        graph_replays_eager = _graph_replays_as_eager(step, out, (key_cache, value_cache), caches_before)
        check_against_reference(graph_replays_eager, caches_before, inputs, shape, ROTARY, THETA, torch.bfloat16,
                                assert_bf16_close)


def _graph_replays_as_eager(step, out, caches, caches_before):
    """tests.support.graph_replays_as_eager, with the caches restored before each run (the step writes them)."""
    from tests.support import graph_replays_as_eager

    def restored_step():
        for cache, before in zip(caches, caches_before):
            cache.copy_(before)
        step()

    return graph_replays_as_eager(restored_step, out)
