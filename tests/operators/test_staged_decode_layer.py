"""`staged_decode_layer`: a Gated DeltaNet layer's whole decode step in one launch, its weights in shared memory.

The kernel is Gluon, which the interpreter does not run. On the CPU: the launch plan at the real shape and where
it does not apply, the argument checks, and the kernel compiled for the H200 (sm_90, Triton's ptxas) at the real
shape: its shared memory within a Hopper program's limit, no register spills, one TMA copy per planned tile.
GPU (bfloat16, Qwen3.5-0.8B's shape): the layer's output and both states as close to the float64 math as the two
kernels it replaces (gated_delta_rule_decode_projected, then staged_out_projection_mlp with the head norm), and
close to what those two compute; three layers in a CUDA graph with PDL replaying the eager launches bit for bit,
states included, the counters left zero.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.gated_delta_rule import staged_decode_layer as staged_layer
from qwen_triton.operators.gated_delta_rule.projected_decode import gated_delta_rule_decode_projected
from qwen_triton.operators.gated_delta_rule.staged_decode_layer import staged_decode_layer
from qwen_triton.operators.linear import staged_out_projection_mlp as staged_tail
from qwen_triton.reference import functional as fn
from tests.operators.test_out_projection_mlp import EPS, make, make_block
from tests.operators.test_projected_decode import clone_states, make_layer
from tests.support import graph_replays_as_eager, run_without_interpreter

H, HEADS, D, I = 1024, 16, 128, 3584
A = HEADS * D


def make_full_layer(device, seed):
    """A DeltaNet layer at the real shape: projected_decode's test layer, the tail's weights, a head norm."""
    layer = make_layer(HEADS, HEADS, D, D, H, torch.bfloat16, device, seed=seed)
    block = make_block(1, H, A, I, torch.bfloat16, device, gated=False, seed=seed + 100)
    layer.update(out_weight=block["out_weight"], norm_weight=block["norm_weight"],
                 gate_up_weight=block["gate_up_weight"], down_weight=block["down_weight"],
                 head_norm_weight=make((D,), torch.bfloat16, device, seed + 200, scale=0.3) + 1)
    return layer


def buffers(layer):
    device, dtype = layer["hidden"].device, layer["hidden"].dtype
    return dict(projection=torch.zeros(1, layer["weight"].shape[0], device=device, dtype=dtype),
                mixed=torch.zeros(1, 3 * A, device=device, dtype=dtype),
                delta_out=torch.zeros(1, HEADS, D, device=device, dtype=dtype),
                act=torch.zeros(1, I, device=device, dtype=dtype))


def run(layer, hidden, counters, scratch, **options):
    """The one launch on hidden (in place) and the layer's states."""
    result = staged_decode_layer(hidden, layer["input_norm"], EPS, layer["weight"], layer["conv_weight"],
                                 layer["conv_state"], layer["A_log"], layer["dt_bias"], layer["state"],
                                 layer["head_norm_weight"], layer["out_weight"], layer["norm_weight"],
                                 layer["gate_up_weight"], layer["down_weight"], counters, scratch["projection"],
                                 scratch["mixed"], scratch["delta_out"], scratch["act"], **options)
    assert result is hidden
    return hidden


def run_two_kernels(layer, hidden):
    """What it replaces: the projected step, then the staged tail with the head norm."""
    projection = torch.zeros(1, layer["weight"].shape[0], device="cuda", dtype=torch.bfloat16)
    qk = torch.empty(1, 2 * A, device="cuda", dtype=torch.bfloat16)
    o = torch.empty(1, HEADS, D, device="cuda", dtype=torch.bfloat16)
    gated_delta_rule_decode_projected(hidden, layer["input_norm"], EPS, layer["weight"], layer["conv_weight"],
                                      layer["conv_state"], layer["A_log"], layer["dt_bias"], layer["state"],
                                      projection, qk, o)
    staged_tail.staged_out_projection_mlp(o.view(1, A), layer["out_weight"], hidden, layer["norm_weight"],
                                          layer["gate_up_weight"], layer["down_weight"], EPS,
                                          staged_tail.new_counters("cuda")[0],
                                          head_norm=(projection[:, 3 * A:4 * A], layer["head_norm_weight"]))
    return hidden


def reference(layer):
    """The layer in float64 (the reference functions' float32 inner steps): (hidden, conv_state, state)."""
    def wide(name):
        return layer[name].double()

    h = wide("hidden")
    projection = fn.rms_norm(h, wide("input_norm"), EPS) @ wide("weight").T
    mixed, conv_state = fn.causal_conv1d_step(projection[:, :3 * A], wide("conv_weight"), wide("conv_state"))
    q, k, v = (mixed[:, i * A:(i + 1) * A].view(1, HEADS, D) for i in range(3))
    z = projection[:, 3 * A:4 * A]
    b, a = projection[:, 4 * A:4 * A + HEADS], projection[:, 4 * A + HEADS:]
    g, beta = fn.gating(a, b, layer["A_log"], layer["dt_bias"])
    o, state = fn.gated_delta_rule_recurrent(q, k, v.double(), g, beta, layer["state"].double())
    normed = fn.gated_rms_norm(o.double(), z.view(1, HEADS, D), wide("head_norm_weight"), EPS).view(1, A)
    h = h + normed @ wide("out_weight").T
    gate, up = (fn.rms_norm(h, wide("norm_weight"), EPS) @ wide("gate_up_weight").T).chunk(2, dim=-1)
    h = h + (torch.nn.functional.silu(gate) * up) @ wide("down_weight").T
    return h, conv_state, state


def relative_error(out, ref, start):
    """Of the layer's update (out - start) against the reference's."""
    return ((out.double() - ref).norm() / (ref - start.double()).norm()).item()


def test_plan():
    # Qwen3.5-0.8B on the H200: the tail's 128 programs, one per 16 value columns; its copies plus 64 rows of the
    # in-projection (16 tiles of 4 rows x 4 column slices) a program
    launch = staged_layer.plan(H, HEADS, HEADS, D, D, 4, I, 132)
    tail = staged_tail.plan(H, A, I, 132)
    assert launch["grid"] == 128 == HEADS * D // 16
    assert launch["copies"] == tail["copies"] + 64
    assert tail["shared_bytes"] < launch["shared_bytes"] <= staged_tail.SHARED_MEMORY_LIMIT
    # where it does not apply: key heads unlike value heads, unequal head dims, another conv width, a grid the
    # tail plans otherwise (fewer SMs), a head dim not a power of two
    assert staged_layer.plan(H, 8, HEADS, D, D, 4, I, 132) is None
    assert staged_layer.plan(H, HEADS, HEADS, 64, D, 4, I, 132) is None
    assert staged_layer.plan(H, HEADS, HEADS, D, D, 3, I, 132) is None
    assert staged_layer.plan(H, HEADS, HEADS, D, D, 4, I, 100) is None
    assert staged_layer.plan(H, 12, 12, 96, 96, 4, I, 132) is None
    assert staged_layer.counter_count(HEADS) == 21
    assert staged_layer.new_counters("cpu", HEADS, 3).shape == (3, 21)


def test_argument_checks():
    layer = make_full_layer("cpu", 1)
    counters = staged_layer.new_counters("cpu", HEADS)[0]
    scratch = buffers(layer)

    def call(**changes):
        arguments = dict(layer, **changes)
        run(arguments, changes.get("hidden", layer["hidden"]), changes.get("counters", counters),
            dict(scratch, **{name: changes[name] for name in scratch if name in changes}), programs=132)

    with pytest.raises(ValueError, match="hidden"):
        call(hidden=layer["hidden"].float())
    with pytest.raises(ValueError, match="weight has"):
        call(weight=layer["weight"][:-1])
    with pytest.raises(ValueError, match="does not apply"):
        call(conv_weight=layer["conv_weight"][:, :3], conv_state=layer["conv_state"][:, :, :2])
    with pytest.raises(ValueError, match="counters"):
        call(counters=staged_tail.new_counters("cpu")[0])
    with pytest.raises(ValueError, match="mixed"):
        call(mixed=scratch["mixed"][:, :-1])
    with pytest.raises(ValueError, match="head_norm_weight"):
        call(head_norm_weight=layer["head_norm_weight"][:64])
    with pytest.raises(ValueError, match="A_log"):
        call(A_log=layer["A_log"].to(torch.bfloat16))


COMPILE_FOR_HOPPER = """
import json, os, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qwen_triton.operators.gated_delta_rule import staged_decode_layer as layer
kernel = layer._layer_kernel
H, A, I, heads, D = 1024, 2048, 3584, 16, 128
names = ("in_descriptor", "out_descriptor", "gate_up_descriptor", "down_descriptor")
descriptors = dict(zip(names, layer.weight_descriptors(*(torch.zeros(*shape, dtype=torch.bfloat16) for shape in
                                                         ((4 * A + 2 * heads, H), (H, A), (2 * I, H), (H, I))))))
launch = layer.plan(H, heads, heads, D, D, 4, I, 132)
types = dict(counter_ptr="*i32", trace_ptr="*i64", a_log_ptr="*fp32", dt_bias_ptr="*fp32", state_ptr="*fp32",
             eps="fp32", scale="fp32", stride_wc="i32", stride_cc="i32")
signature = {name: mangle_type(descriptors[name]) if name in descriptors else types.get(name, "*bf16" if
             name.endswith("_ptr") else "constexpr") for name in kernel.arg_names}
constants = dict(HIDDEN=H, HEADS=heads, HEAD_DIM=D, INTERMEDIATE=I, OUT_GROUPS=launch["out_groups"],
                 UP_GROUPS=launch["up_groups"], OUT_PADDED=launch["out_padded"], UP_PADDED=launch["up_padded"],
                 BLOCK_HIDDEN=H, USE_PDL=True, WARPS=layer.WARPS.value, PACED=True, GATE_UP_AFTER=0, TRACE=False, UNROLLED=True)
compiled = triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=constants),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=layer.WARPS.value))
path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
open(path, "wb").write(compiled.asm["cubin"])
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
print(json.dumps(dict(shared=compiled.metadata.shared, stack=int(usage.split("STACK:")[1].split()[0]),
                      copies=compiled.asm["ptx"].count("cp.async.bulk.tensor"), plan=launch)))
"""


def test_compiles_for_hopper():
    result = run_without_interpreter(COMPILE_FOR_HOPPER)
    launch = result["plan"]
    assert launch["shared_bytes"] <= result["shared"] <= staged_tail.SHARED_MEMORY_LIMIT, result
    assert result["stack"] == 0, result
    assert result["copies"] == launch["copies"], result


@pytest.mark.gpu
def test_gpu_real_shape_against_float64_and_the_two_kernels():
    layer = make_full_layer("cuda", 7)
    ref_hidden, ref_conv, ref_state = reference(layer)
    two = clone_states(layer)
    two_hidden = run_two_kernels(two, layer["hidden"].clone())
    one = clone_states(layer)
    counters = staged_layer.new_counters("cuda", HEADS)[0]
    hidden = run(one, layer["hidden"].clone(), counters, buffers(layer))
    torch.cuda.synchronize()
    assert not counters.any(), counters  # reset, and no barrier gave up
    start = layer["hidden"]
    error, two_error = relative_error(hidden, ref_hidden, start), relative_error(two_hidden, ref_hidden, start)
    difference = relative_error(hidden, two_hidden.double(), start)
    state_error = ((one["state"].double() - ref_state).norm() / ref_state.norm()).item()
    two_state_error = ((two["state"].double() - ref_state).norm() / ref_state.norm()).item()
    print(f"update error {error:.2e} (two kernels {two_error:.2e}, between them {difference:.2e}); state "
          f"{state_error:.2e} (two kernels {two_state_error:.2e})")
    assert error < 1e-2 and error < 1.5 * two_error + 1e-4
    assert state_error < 1.5 * two_state_error + 1e-5
    # the conv state holds the projection rounded to bf16: as the GEMV's, up to its summation order
    torch.testing.assert_close(one["conv_state"].double(), ref_conv, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(one["conv_state"], two["conv_state"], rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gpu_cuda_graph_with_pdl():
    layers = [make_full_layer("cuda", 30 + i) for i in range(3)]
    hidden = layers[0]["hidden"].clone()
    counters = staged_layer.new_counters("cuda", HEADS, len(layers))
    scratch = buffers(layers[0])
    descriptors = [staged_layer.weight_descriptors(layer["weight"], layer["out_weight"], layer["gate_up_weight"],
                                                   layer["down_weight"]) for layer in layers]
    states = [tensor for layer in layers for tensor in (layer["conv_state"], layer["state"])]

    def step():  # three layers back to back on one residual stream, as a decode step chains them
        for i, layer in enumerate(layers):
            run(layer, hidden, counters[i], scratch, pdl=True, descriptors=descriptors[i])

    expected = hidden.clone()
    copies = [clone_states(layer) for layer in layers]
    for layer in copies:  # the two kernels, layer after layer
        expected = run_two_kernels(layer, expected)
    eager = graph_replays_as_eager(step, hidden, states=states)
    assert relative_error(eager, expected.double(), layers[0]["hidden"]) < 2e-2
    assert not counters.any(), counters
