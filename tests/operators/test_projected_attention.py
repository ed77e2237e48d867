"""An attention layer's decode in-projection with its q/k norms, rotary and KV write in one kernel
(attention/projected_decode.py), against the chain it replaces: the GEMV with its norm prologue, then
qk_norm_rotary.

On the CPU (interpreter) the chain's GEMV runs its interpreter tile, the kernel the GEMV's in-graph tile (16 x
256): the sums differ in order, so the comparison has a tolerance there; on the GPU every output is compared bit
for bit with the chain at the engine's pinned GEMV tile (launched with it explicitly, whatever the autotuner
keeps), and a CUDA graph of the launch replays the eager one.
"""

from __future__ import annotations

import pytest
import torch
import triton

from qwen_triton.operators.attention import projected_decode, qk_norm_rotary, rotary_table
from qwen_triton.operators.attention.projected_decode import attention_projected_qkv
from qwen_triton.operators.linear import gemv, linear
from tests.support import run_without_interpreter

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_layer(heads, kv_heads, head_dim, hidden_size, rotary_dim, dtype, device, gated=True, length=40, seed=0):
    """One attention layer's decode inputs at batch 1 (slot 1 of 2, position 17) and random caches."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    width = (2 if gated else 1) * heads * head_dim + 2 * kv_heads * head_dim
    return dict(
        hidden=random(1, hidden_size), input_norm=random(hidden_size, scale=0.2),
        weight=random(width, hidden_size, scale=hidden_size**-0.5),
        q_norm_weight=random(head_dim, scale=0.2), k_norm_weight=random(head_dim, scale=0.2),
        cos_sin=rotary_table(length, rotary_dim, 1e7, device), positions=torch.tensor([17], dtype=torch.int32,
                                                                                      device=device),
        slots=torch.tensor([1], dtype=torch.int32, device=device),
        key_cache=random(2, kv_heads, length, head_dim), value_cache=random(2, kv_heads, length, head_dim),
        shape=dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, gated=gated),
    )


def clone_caches(layer):
    return dict(layer, key_cache=layer["key_cache"].clone(), value_cache=layer["value_cache"].clone())


def pinned_gemv(hidden, weight, norm_weight, eps):
    """The GEMV at the engine's pinned tile for K <= 1024 (gemv.PREFERRED_BY_K: 16 x 256, 4 warps, 3 stages),
    whatever QWEN_TRITON_AUTOTUNE keeps: the tile the projected kernel sums as."""
    out = torch.empty(1, weight.shape[0], device=hidden.device, dtype=hidden.dtype)
    gemv._gemv_kernel[(triton.cdiv(weight.shape[0], projected_decode.ROWS), 1, 1)](
        hidden, weight, out, out, hidden, norm_weight, out, out, 1, weight.shape[0], hidden.shape[1],
        hidden.stride(0), weight.stride(0), out.stride(0), 0, 0, eps, ACTIVATION=0, HAS_RESIDUAL=False,
        HAS_GATE=False, HAS_NORM=True, USE_PDL=False, BLOCK_N=projected_decode.ROWS, BLOCK_K=projected_decode.TILE_K,
        SPLIT_K=1, num_warps=projected_decode.WARPS, num_stages=projected_decode.STAGES)
    return out


def chain(layer, eps=1e-6):
    """The GEMV (norm prologue), then qk_norm_rotary on the row's q | k | v: (qkv, q), the caches written. On
    the GPU the GEMV at its pinned tile (`pinned_gemv`), else as `linear` picks it."""
    shape = layer["shape"]
    if layer["hidden"].is_cuda:
        qkv = pinned_gemv(layer["hidden"], layer["weight"], layer["input_norm"], eps)
    else:
        qkv = linear(layer["hidden"], layer["weight"], norm_weight=layer["input_norm"], eps=eps)
    gate_width = shape["num_heads"] * shape["head_dim"] if shape["gated"] else 0
    q = qk_norm_rotary(qkv[:, gate_width:], layer["q_norm_weight"], layer["k_norm_weight"], layer["cos_sin"],
                       layer["positions"], layer["slots"], layer["key_cache"], layer["value_cache"],
                       num_heads=shape["num_heads"], num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                       gated=False, eps=eps)
    return qkv, q


def projected(layer, eps=1e-6, pdl=False, buffers=None):
    """The one kernel: (qkv, q), the caches written."""
    shape = layer["shape"]
    hidden = layer["hidden"]
    qkv, q = buffers or (torch.full((1, layer["weight"].shape[0]), 7.0, device=hidden.device, dtype=hidden.dtype),
                         torch.empty(1, shape["num_heads"], shape["head_dim"], device=hidden.device,
                                     dtype=hidden.dtype))
    result = attention_projected_qkv(hidden, layer["input_norm"], eps, layer["weight"], layer["q_norm_weight"],
                                     layer["k_norm_weight"], layer["cos_sin"], layer["positions"], layer["slots"],
                                     layer["key_cache"], layer["value_cache"], qkv, q, pdl=pdl, **shape)
    assert result is q
    return qkv, q


@pytest.mark.parametrize("heads, kv_heads, head_dim, hidden_size, rotary_dim, dtype, gated", [
    (4, 2, 32, 96, 16, torch.float32, True),     # K under one 256-column tile, a partial rotary
    (2, 1, 16, 300, 16, torch.float16, False),   # K over two tiles with a masked end, every dim rotated, no gate
])
def test_projected_qkv_matches_the_gemv_and_qk_norm_rotary(device, heads, kv_heads, head_dim, hidden_size,
                                                           rotary_dim, dtype, gated):
    layer = make_layer(heads, kv_heads, head_dim, hidden_size, rotary_dim, dtype, device, gated=gated,
                       seed=hidden_size)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for step in range(3):  # the counters are reset by each launch: later launches finish their heads again
        expected, got = clone_caches(layer), clone_caches(layer)
        expected["hidden"] = got["hidden"] = layer["hidden"] * (step + 1)
        want_qkv, want_q = chain(expected)
        got_qkv, got_q = projected(got)
        torch.testing.assert_close(got_qkv, want_qkv, **tolerance)
        torch.testing.assert_close(got_q, want_q, **tolerance)
        torch.testing.assert_close(got["key_cache"], expected["key_cache"], **tolerance)
        torch.testing.assert_close(got["value_cache"], expected["value_cache"], **tolerance)
        # the rows written are the slot's position only
        assert not torch.equal(got["key_cache"][1, :, 17], layer["key_cache"][1, :, 17])
        untouched = torch.ones(2, layer["key_cache"].shape[2], dtype=torch.bool)
        untouched[1, 17] = False
        for name in ("key_cache", "value_cache"):
            assert torch.equal(got[name].transpose(1, 2)[untouched], layer[name].transpose(1, 2)[untouched])
        for counters in projected_decode._counters.values():
            assert not counters.any()


def test_projected_qkv_argument_errors(device):
    layer = make_layer(2, 1, 16, 64, 16, torch.float32, device)
    shape = layer["shape"]
    good = dict(hidden=layer["hidden"], input_norm=layer["input_norm"], eps=1e-6, weight=layer["weight"],
                q_norm_weight=layer["q_norm_weight"], k_norm_weight=layer["k_norm_weight"], cos_sin=layer["cos_sin"],
                positions=layer["positions"], slots=layer["slots"], key_cache=layer["key_cache"],
                value_cache=layer["value_cache"], qkv=torch.empty(1, layer["weight"].shape[0], device=device),
                q_out=torch.empty(1, 2, 16, device=device), **shape)
    attention_projected_qkv(**good)  # the arguments below differ from these in one place each
    bad = [
        (dict(hidden=layer["hidden"].expand(2, -1)), "hidden has shape"),
        (dict(weight=layer["weight"][:-16]), "weight has shape"),
        (dict(head_dim=8, q_norm_weight=layer["q_norm_weight"][:8]), "multiple of 16"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(positions=layer["positions"].long()), "positions has dtype"),
        (dict(qkv=torch.empty(1, 7, device=device)), "qkv has shape"),
        (dict(value_cache=layer["value_cache"][:, :, :20]), "value_cache has shape"),
        (dict(cos_sin=layer["cos_sin"][:, :15]), "rotary dim"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            attention_projected_qkv(**dict(good, **change))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_projected_qkv_at_the_real_shape(pdl):
    """Qwen3.5-0.8B's attention shape in bf16: qkv, q and both caches bit for bit as the chain writes them,
    five launches in a row, and a CUDA-graph replay equal to the eager launch."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layer = make_layer(8, 2, 256, 1024, 64, torch.bfloat16, "cuda", length=4096, seed=3)
    for step in range(5):
        expected, got = clone_caches(layer), clone_caches(layer)
        expected["hidden"] = got["hidden"] = layer["hidden"] * (1 + step / 4)
        want_qkv, want_q = chain(expected)
        got_qkv, got_q = projected(got, pdl=pdl)
        assert torch.equal(got_qkv, want_qkv)
        assert torch.equal(got_q, want_q)
        assert torch.equal(got["key_cache"], expected["key_cache"])
        assert torch.equal(got["value_cache"], expected["value_cache"])
    graphed, eager = clone_caches(layer), clone_caches(layer)
    buffers = (torch.empty(1, layer["weight"].shape[0], device="cuda", dtype=torch.bfloat16),
               torch.empty(1, 8, 256, device="cuda", dtype=torch.bfloat16))
    projected(graphed, pdl=pdl, buffers=buffers)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        projected(graphed, pdl=pdl, buffers=buffers)
    for _ in range(3):
        graph.replay()
        _, want = projected(eager, pdl=pdl)
        torch.cuda.synchronize()
        assert torch.equal(buffers[1], want)
        assert torch.equal(graphed["key_cache"], eager["key_cache"])
    assert not projected_decode._counters[(torch.device("cuda", torch.cuda.current_device()), 10)].any()


COMPILE_FOR_HOPPER = """
import json, os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from qwen_triton.operators.attention import projected_decode as module
kernel = module._projected_qkv_kernel
types = dict(table_ptr="*fp32", positions_ptr="*i32", slots_ptr="*i32", counter_ptr="*i32", eps="fp32")
signature = {name: types.get(name, "*bf16" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
constants = dict(HEAD_DIM=256, ROTARY_DIM=64, NUM_HEADS=8, NUM_KV_HEADS=2, GATED=True, BLOCK_D=256,
                 ROWS=module.ROWS, TILE_K=module.TILE_K, USE_PDL=True)
for name in constants:
    signature[name] = "constexpr"
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=module.WARPS, num_stages=module.STAGES))
path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
open(path, "wb").write(compiled.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
print(json.dumps(dict(registers=int(usage.split("REG:")[1].split()[0]), stack=int(usage.split("STACK:")[1].split()[0]))))
"""


def test_compiles_for_hopper():
    # the interpreter never compiles the kernel: compile it for sm_90 at the real shape and read its stack
    result = run_without_interpreter(COMPILE_FOR_HOPPER)
    assert result["stack"] == 0, result
