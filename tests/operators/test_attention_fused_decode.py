"""attention_decode_fused (one launch: q/k norm + rotary, KV write, split-KV attention, merge) against the
separate kernels it replaces (qk_norm_rotary, then attention_decode) and the reference math.

CPU (interpreter) tests in float32 at small shapes with several splits active; GPU tests in bf16 at the real
Qwen3.5-0.8B shapes, in a CUDA graph with programmatic dependent launch (the arrival counters reset
themselves between replays)."""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.attention import attention_decode, qk_norm_rotary, rotary_table
from qwen_triton.operators.attention import fused_decode as fused_module
from qwen_triton.operators.attention.fused_decode import attention_decode_fused
from tests.operators.test_attention import assert_bf16_close, reference_decode, reference_qk_norm_rotary

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_case(heads, kv_heads, dim, rotary_dim, positions, max_length, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    batch = len(positions)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    return dict(
        qkv=randn(batch, (heads + 2 * kv_heads) * dim),
        q_weight=randn(dim, scale=0.3), k_weight=randn(dim, scale=0.3),
        table=rotary_table(max_length, rotary_dim, 1.0e4, device),
        positions=torch.tensor(positions, device=device, dtype=torch.int32),
        key_cache=randn(batch + 1, kv_heads, max_length, dim), value_cache=randn(batch + 1, kv_heads, max_length, dim),
        heads=heads, kv_heads=kv_heads, dim=dim,
    )


def run_fused(case, key_cache, value_cache, **options):
    return attention_decode_fused(case["qkv"], case["q_weight"], case["k_weight"], case["table"], case["positions"],
                                  key_cache, value_cache, num_heads=case["heads"], num_kv_heads=case["kv_heads"],
                                  eps=1e-6, **options)


def run_separate(case, key_cache, value_cache, **options):
    rows = case["qkv"].shape[0]
    q = qk_norm_rotary(case["qkv"], case["q_weight"], case["k_weight"], case["table"], case["positions"],
                       torch.arange(rows, device=case["qkv"].device, dtype=torch.int32), key_cache, value_cache,
                       num_heads=case["heads"], num_kv_heads=case["kv_heads"], head_dim=case["dim"], gated=False,
                       eps=1e-6)
    return attention_decode(q, key_cache, value_cache, case["positions"] + 1, **options)


@pytest.mark.parametrize("heads, kv_heads, dim, rotary_dim, num_splits, split_align", [
    (8, 2, 64, 16, 4, 16),    # group 4; at position 70, 4 splits of 32 keys, 3 active
    (4, 4, 40, 24, 3, 8),     # group 1, a head dim that is no power of two
    (2, 1, 32, 32, 1, 64),    # a single split, full rotary
])
def test_matches_the_separate_kernels(heads, kv_heads, dim, rotary_dim, num_splits, split_align):
    positions = [0, 70, 5, 63]  # a first token, keys across several splits, a split boundary
    case = make_case(heads, kv_heads, dim, rotary_dim, positions, 80, torch.float32, "cpu", seed=heads + dim)
    options = dict(num_splits=num_splits, split_align=split_align)
    fused_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    separate_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    fused = run_fused(case, *fused_caches, **options)
    separate = run_separate(case, *separate_caches, **options)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-5)
    # the same k and v written at each position, nothing else touched
    for got, want in zip(fused_caches, separate_caches):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(fused_caches[0], case["key_cache"])
    # and the reference math: q and k normed and rotated, attention over keys 0..p
    q, k, v = reference_qk_norm_rotary(case["qkv"], case["q_weight"], case["k_weight"], case["positions"], rotary_dim,
                                       1.0e4, 1e-6, heads, kv_heads, dim, gated=False)
    for b, p in enumerate(positions):
        torch.testing.assert_close(fused_caches[0][b, :, p], k[b], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fused_caches[1][b, :, p], v[b], rtol=0, atol=0)
    expected = reference_decode(q, fused_caches[0], fused_caches[1], case["positions"] + 1)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_repeats_bit_for_bit_and_resets_its_counters():
    case = make_case(4, 2, 32, 16, [50, 9], 64, torch.float32, "cpu", seed=3)
    first = run_fused(case, case["key_cache"], case["value_cache"], num_splits=4, split_align=8).clone()
    counters = [entry[3] for entry in fused_module._WORKSPACES.values()]
    assert counters and all(int(c.abs().sum()) == 0 for c in counters)
    second = run_fused(case, case["key_cache"], case["value_cache"], num_splits=4, split_align=8)
    assert torch.equal(first, second)


def test_errors_name_the_argument():
    case = make_case(4, 2, 32, 16, [3], 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="qkv has shape"):
        run_fused(dict(case, qkv=case["qkv"][:, :-1]), case["key_cache"], case["value_cache"])
    with pytest.raises(ValueError, match="positions has dtype"):
        run_fused(dict(case, positions=case["positions"].long()), case["key_cache"], case["value_cache"])
    with pytest.raises(ValueError, match="num_heads 3"):
        run_fused(dict(case, heads=3), case["key_cache"], case["value_cache"])
    with pytest.raises(ValueError, match="value_cache"):
        run_fused(case, case["key_cache"], case["value_cache"][:, :, :8])
    with pytest.raises(ValueError, match="rotary dim"):
        run_fused(dict(case, table=case["table"][:, :3]), case["key_cache"], case["value_cache"])
    with pytest.raises(ValueError, match="num_splits"):
        run_fused(case, case["key_cache"], case["value_cache"], num_splits=0)


# ---- GPU: bf16, the real shapes --------------------------------------------------------------------------

HEADS, KV_HEADS, DIM, ROTARY = 8, 2, 256, 64


@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[127], [4095], [32767], [0, 129, 4096, 32767]])
def test_gpu_matches_the_separate_kernels(positions):
    case = make_case(HEADS, KV_HEADS, DIM, ROTARY, positions, 32768, torch.bfloat16, "cuda", seed=12)
    fused_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    separate_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    fused = run_fused(case, *fused_caches)
    separate = run_separate(case, *separate_caches)
    assert torch.equal(fused_caches[0], separate_caches[0]) and torch.equal(fused_caches[1], separate_caches[1])
    assert_bf16_close(fused, separate.double())
    q = qk_norm_rotary(case["qkv"], case["q_weight"], case["k_weight"], case["table"], case["positions"],
                       torch.arange(len(positions), device="cuda", dtype=torch.int32), *separate_caches,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, gated=False, eps=1e-6)
    ref = reference_decode(q.double(), fused_caches[0].double(), fused_caches[1].double(), case["positions"] + 1)
    assert_bf16_close(fused, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_cuda_graph_replays(pdl):
    """Captured once with its neighbours, replayed at new positions: each replay equals an eager call (the
    counters reset themselves; with PDL the next kernel may start early and waits for this one)."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    case = make_case(HEADS, KV_HEADS, DIM, ROTARY, [5, 700], 8192, torch.bfloat16, "cuda", seed=13)
    out = torch.empty(2, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    after = torch.empty_like(out)

    def step():
        run_fused(case, case["key_cache"], case["value_cache"], out=out, pdl=pdl)
        torch.mul(out, 2, out=after)  # a reader of the output right behind it

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new_positions in ([6, 701], [4000, 8191], [0, 64]):
        case["positions"].copy_(torch.tensor(new_positions, dtype=torch.int32))
        case["qkv"].copy_(torch.randn_like(case["qkv"]))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (out.clone(), after.clone())
        step()
        torch.cuda.synchronize()
        assert torch.equal(replayed[0], out) and torch.equal(replayed[1], after)
        assert torch.equal(after, out * 2)


COMPILE_FOR_HOPPER = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from qwen_triton.operators.attention import fused_decode
kernel = fused_decode._fused_decode_kernel
pointers = dict(qkv="*bf16", q_weight="*bf16", k_weight="*bf16", table="*fp32", positions="*i32", key="*bf16",
                value="*bf16", partial_acc="*fp32", partial_max="*fp32", partial_sum="*fp32", counters="*i32",
                out="*bf16")
signature = {name: pointers.get(name) or ("fp32" if name in ("scale_log2", "eps") else
             "constexpr" if name.isupper() else "i32") for name in kernel.fn.arg_names}
compiled = []
for config in kernel.configs:
    constants = dict(config.kwargs, HEAD_DIM=256, ROTARY_DIM=64, NUM_HEADS=8, NUM_KV_HEADS=2, GROUP=4, BLOCK_H=16,
                     BLOCK_D=256, IEEE=False, USE_PDL=True)
    triton.compile(ASTSource(fn=kernel.fn, signature=signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    compiled.append(config.kwargs["BLOCK_N"])
print(json.dumps(compiled))
"""


def test_compiles_for_hopper():
    # the interpreter never compiles a kernel: compile every tuning config for sm_90 at the real shape, with
    # programmatic dependent launch, in a process without it (Triton's bundled ptxas; no GPU needed)
    from tests.support import run_without_interpreter

    assert len(run_without_interpreter(COMPILE_FOR_HOPPER)) > 1  # outside the interpreter: every config
