"""The DeltaNet layer's in-projection and decode step in one kernel (projected_decode.py), against the chain it
replaces: the GEMV with its norm prologue, then the fused step without its norm (fused_decode.py).

On the CPU (interpreter) the chain's GEMV runs its interpreter tile (64 x 64), the kernel the GEMV's in-graph
tile (16 x 256): the sums differ in order, so the comparison has a tolerance there; on the GPU the projection
is compared bit for bit with the GEMV at the engine's pinned tile.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.gated_delta_rule import gated_delta_rule_decode_fused
from qwen_triton.operators.gated_delta_rule import projected_decode
from qwen_triton.operators.gated_delta_rule.projected_decode import gated_delta_rule_decode_projected
from qwen_triton.operators.linear import linear
from tests.support import run_without_interpreter

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def make_layer(key_heads, value_heads, key_dim, value_dim, hidden_size, dtype, device, width=4, seed=0):
    """One DeltaNet layer's decode inputs at batch 1: the row, the weights, non-zero conv and recurrent states."""
    generator = torch.Generator().manual_seed(seed)

    def random(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    channels = 2 * key_heads * key_dim + value_heads * value_dim
    rows = channels + value_heads * value_dim + 2 * value_heads
    return dict(
        hidden=random(1, hidden_size),
        input_norm=random(hidden_size, scale=0.2),
        weight=random(rows, hidden_size, scale=hidden_size**-0.5),
        conv_weight=random(channels, width, scale=0.5),
        conv_state=random(1, channels, width - 1),
        A_log=torch.empty(value_heads).uniform_(1, 16, generator=generator).log().to(device),
        dt_bias=(torch.randn(value_heads, generator=generator) - 2).to(device),
        state=(torch.randn(1, value_heads, key_dim, value_dim, generator=generator) * 0.2).to(device),
        heads=(key_heads, value_heads, key_dim, value_dim),
    )


def clone_states(layer):
    return dict(layer, conv_state=layer["conv_state"].clone(), state=layer["state"].clone())


def chain(layer, eps=1e-6):
    """The GEMV (norm prologue) then the fused step without its norm: (projection, o), states updated."""
    key_heads, value_heads, key_dim, value_dim = layer["heads"]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    projection = linear(layer["hidden"], layer["weight"], norm_weight=layer["input_norm"], eps=eps)
    z = projection[:, channels:channels + value_heads * value_dim]
    b = projection[:, channels + value_heads * value_dim:channels + value_heads * value_dim + value_heads]
    a = projection[:, channels + value_heads * value_dim + value_heads:]
    norm_weight = torch.ones(value_dim, device=projection.device, dtype=projection.dtype)
    o = gated_delta_rule_decode_fused(projection[:, :channels], z, a, b, layer["conv_weight"], layer["conv_state"],
                                      layer["A_log"], layer["dt_bias"], norm_weight, eps, layer["state"],
                                      normalize=False)
    return projection, o


def projected(layer, eps=1e-6, pdl=False, slots=None):
    """The one kernel: (projection, q | k after the conv, o), states updated (at slots[0], or slot 0)."""
    key_heads, value_heads, key_dim, value_dim = layer["heads"]
    hidden = layer["hidden"]
    projection = torch.full((1, layer["weight"].shape[0]), 7.0, device=hidden.device, dtype=hidden.dtype)
    qk = torch.empty(1, 2 * key_heads * key_dim, device=hidden.device, dtype=hidden.dtype)
    o = torch.empty(1, value_heads, value_dim, device=hidden.device, dtype=hidden.dtype)
    result = gated_delta_rule_decode_projected(hidden, layer["input_norm"], eps, layer["weight"], layer["conv_weight"],
                                               layer["conv_state"], layer["A_log"], layer["dt_bias"], layer["state"],
                                               projection, qk, o, pdl=pdl, slots=slots)
    assert result is o
    return projection, qk, o


def conv_output(layer_before, projection, channels_count):
    """silu(conv) of the first channels_count channels, from the states before the step (float32)."""
    window = torch.cat([layer_before["conv_state"][0, :channels_count].float(),
                        projection[0, :channels_count, None].float()], dim=1)
    out = (window * layer_before["conv_weight"][:channels_count].float()).sum(dim=1)
    return (out * torch.sigmoid(out))[None]


@pytest.mark.parametrize("heads, hidden_size, dtype", [
    ((2, 4, 16, 32), 96, torch.float32),    # two value heads per key head, K under one 256-column tile
    ((2, 2, 32, 16), 300, torch.float16),   # one per key head, K over two tiles with a masked end
])
def test_projected_decode_matches_the_gemv_and_the_fused_step(device, heads, hidden_size, dtype):
    layer = make_layer(*heads, hidden_size, dtype, device, seed=hidden_size)
    key_heads, value_heads, key_dim, value_dim = heads
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    expected = clone_states(layer)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for step in range(3):  # the counters are reset by each launch: later steps wait again
        before = clone_states(layer)
        want_projection, want_o = chain(expected)
        got_projection, got_qk, got_o = projected(layer)
        # z, b and a are written; q | k | v are not (the conv output of q | k goes to qk instead)
        torch.testing.assert_close(got_projection[:, channels:], want_projection[:, channels:], **tolerance)
        assert (got_projection[:, :channels] == 7.0).all()
        torch.testing.assert_close(got_qk.float(), conv_output(before, want_projection, 2 * key_heads * key_dim),
                                   **tolerance)
        torch.testing.assert_close(got_o, want_o, **tolerance)
        torch.testing.assert_close(layer["conv_state"], expected["conv_state"], **tolerance)
        torch.testing.assert_close(layer["state"], expected["state"], **tolerance)
        assert not torch.equal(layer["state"], before["state"]), step
        for counters in projected_decode._counters.values():
            assert all((counter == 0).all() for counter in counters)


def with_slots(layer, slot_count, slot, seed=1):
    """The layer's states placed in slot `slot` of `slot_count` (the others random)."""
    generator = torch.Generator().manual_seed(seed)
    placed = {}
    for name in ("conv_state", "state"):
        state = layer[name]
        placed[name] = torch.randn((slot_count,) + state.shape[1:], generator=generator).to(state)
        placed[name][slot] = state[0]
    return dict(layer, **placed)


def test_projected_decode_over_a_slot_equals_slot_zero_alone(device):
    """The sequence in slot 2 of 4 (slots [2]): the outputs and that slot's states as the same states in a
    one-slot state without slots, bit for bit, two steps in a row; the other slots untouched."""
    layer = make_layer(2, 4, 16, 32, 96, torch.float32, device, seed=3)
    placed = with_slots(layer, 4, 2)
    initial = clone_states(placed)
    slots = torch.tensor([2], device=device, dtype=torch.int32)
    for _ in range(2):
        got = projected(placed, slots=slots)
        want = projected(layer)
        for got_buffer, want_buffer in zip(got, want):
            assert torch.equal(got_buffer, want_buffer)
        for name in ("conv_state", "state"):
            assert torch.equal(placed[name][2], layer[name][0])
            assert torch.equal(placed[name][[0, 1, 3]], initial[name][[0, 1, 3]])


def test_projected_decode_argument_errors(device):
    layer = make_layer(2, 2, 16, 16, 64, torch.float32, device)
    good = dict(hidden=layer["hidden"], input_norm=layer["input_norm"], eps=1e-6, weight=layer["weight"],
                conv_weight=layer["conv_weight"], conv_state=layer["conv_state"], A_log=layer["A_log"],
                dt_bias=layer["dt_bias"], state=layer["state"],
                projection=torch.empty(1, layer["weight"].shape[0], device=device),
                qk=torch.empty(1, 64, device=device), delta_out=torch.empty(1, 2, 16, device=device))
    gated_delta_rule_decode_projected(**good)  # the arguments below differ from these in one place each
    bad = [
        (dict(state=layer["state"].expand(2, -1, -1, -1).contiguous()), "conv_state has shape"),  # 2 slots, 1
        (dict(slots=torch.zeros(2, device=device, dtype=torch.int32)), "slots has shape"),
        (dict(hidden=layer["hidden"].expand(2, -1)), "hidden has shape"),
        (dict(weight=layer["weight"][:-2]), "weight has"),
        (dict(state=torch.zeros(1, 2, 16, 24, device=device)), "multiples of 16"),
        (dict(conv_weight=layer["conv_weight"][:, :1].contiguous()), "width 1"),
        (dict(qk=torch.empty(1, 63, device=device)), "qk has shape"),
        (dict(A_log=layer["A_log"].double()), "A_log has dtype"),
        (dict(input_norm=layer["input_norm"][:32]), "input_norm has shape"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            gated_delta_rule_decode_projected(**dict(good, **change))


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_projected_decode_at_the_real_shape(pdl):
    """Qwen3.5-0.8B's shape in bf16: the projection bit for bit as the GEMV stores it (the engine's pinned tile),
    the step within bf16 rounding of the fused step (its sums over Dk run in another warp layout), five steps
    in a row, and a CUDA-graph replay equal to the eager launch."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    layer = make_layer(16, 16, 128, 128, 1024, torch.bfloat16, "cuda", seed=5)
    channels = 2 * 16 * 128 + 16 * 128
    expected = clone_states(layer)
    for _ in range(5):
        before = clone_states(layer)
        want_projection, want_o = chain(expected)
        got_projection, got_qk, got_o = projected(layer, pdl=pdl)
        assert torch.equal(got_projection[:, channels:], want_projection[:, channels:])
        assert torch.equal(got_qk, conv_output(before, want_projection, 4096).to(torch.bfloat16))
        torch.testing.assert_close(got_o, want_o, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(layer["conv_state"], expected["conv_state"], rtol=0, atol=0)
        torch.testing.assert_close(layer["state"], expected["state"], rtol=1e-3, atol=1e-3)
    # a graph of the launch replays as the eager launch computes
    graphed = clone_states(layer)
    eager = clone_states(layer)
    buffers = (torch.empty(1, layer["weight"].shape[0], device="cuda", dtype=torch.bfloat16),
               torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16),
               torch.empty(1, 16, 128, device="cuda", dtype=torch.bfloat16))

    def launch(states):
        gated_delta_rule_decode_projected(layer["hidden"], layer["input_norm"], 1e-6, layer["weight"],
                                          layer["conv_weight"], states["conv_state"], layer["A_log"],
                                          layer["dt_bias"], states["state"], *buffers, pdl=pdl)

    launch(graphed)  # compiled before capture
    graphed["conv_state"].copy_(eager["conv_state"])
    graphed["state"].copy_(eager["state"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(graphed)
    for _ in range(3):
        graph.replay()
        _, _, want = projected(eager, pdl=pdl)
        torch.cuda.synchronize()
        assert torch.equal(buffers[2], want)
        assert torch.equal(graphed["state"], eager["state"])
        assert torch.equal(graphed["conv_state"], eager["conv_state"])


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_projected_decode_over_slots_in_a_cuda_graph(pdl):
    """At the real shape in bf16: the launch captured once with its slot read from a device buffer, replayed with
    the slot changed between replays: each replay equals the eager launch on that slot, bit for bit, and leaves
    every other slot's states as they were."""
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    slot_count = 4
    layer = with_slots(make_layer(16, 16, 128, 128, 1024, torch.bfloat16, "cuda", seed=6), slot_count, 0, seed=7)
    slots = torch.zeros(1, device="cuda", dtype=torch.int32)
    buffers = (torch.empty(1, layer["weight"].shape[0], device="cuda", dtype=torch.bfloat16),
               torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16),
               torch.empty(1, 16, 128, device="cuda", dtype=torch.bfloat16))

    def launch(states, slots):
        gated_delta_rule_decode_projected(layer["hidden"], layer["input_norm"], 1e-6, layer["weight"],
                                          layer["conv_weight"], states["conv_state"], layer["A_log"],
                                          layer["dt_bias"], states["state"], *buffers, pdl=pdl, slots=slots)

    launch(clone_states(layer), slots)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(layer, slots)
    for slot in (3, 1, 3, 0):
        slots.fill_(slot)
        before, eager = clone_states(layer), clone_states(layer)
        graph.replay()
        got = buffers[2].clone()
        launch(eager, torch.tensor([slot], device="cuda", dtype=torch.int32))
        torch.cuda.synchronize()
        assert torch.equal(got, buffers[2]), slot
        for name in ("conv_state", "state"):
            # the slot advanced as the eager launch advances it, the others as they were (eager's before it)
            assert torch.equal(layer[name], eager[name]), (slot, name)
            assert not torch.equal(layer[name][slot], before[name][slot]), (slot, name)
        for counters in projected_decode._counters.values():
            assert all((counter == 0).all() for counter in counters)


COMPILE_FOR_HOPPER = """
import json, os, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from qwen_triton.operators.gated_delta_rule import projected_decode as module
kernel = module._projected_step_kernel
types = dict(a_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32", arrival_ptr="*i32", departure_ptr="*i32",
             slots_ptr="*i32", eps="fp32", scale="fp32")
signature = {name: types.get(name, "*bf16" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
constants = dict(K_HEADS=16, V_HEADS=16, GROUP=1, K_DIM=128, V_DIM=128, WIDTH=4, BLOCK_W=4, BLOCK_DK=128,
                 BLOCK_HK=16, ROWS=module.ROWS, TILE_K=module.TILE_K, HAS_SLOTS=True, USE_PDL=True)
for name in constants:
    signature[name] = "constexpr"
compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=module.WARPS, num_stages=module.STAGES, maxnreg=module.MAX_REGISTERS))
path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
open(path, "wb").write(compiled.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
print(json.dumps(dict(registers=int(usage.split("REG:")[1].split()[0]), stack=int(usage.split("STACK:")[1].split()[0]))))
"""


@pytest.mark.parametrize("value_heads", [16, 32, 48])  # 0.8B; 4B and 9B; 27B (over 16 key heads)
def test_compiles_for_hopper(value_heads):
    # the interpreter never compiles the kernel: compile it for sm_90 at the real shapes (Triton's bundled ptxas)
    # and read its registers and stack: no spills under the register bound that puts four programs on an SM
    heads = f"V_HEADS={value_heads}, GROUP={value_heads // 16}"
    script = COMPILE_FOR_HOPPER.replace("V_HEADS=16, GROUP=1", heads)
    usage = run_without_interpreter(script)
    assert usage["stack"] == 0 and usage["registers"] <= 128, usage
