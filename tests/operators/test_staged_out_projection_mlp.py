"""`staged_out_projection_mlp`: a decode layer's out-projection and MLP in one launch, its weights in shared memory.

The kernel is Gluon, which the interpreter does not run. On the CPU: the launch plan at the real and at
unsupported sizes, every argument check, and the kernel compiled for the H200 (sm_90, Triton's ptxas) at the
real shapes, with and without the DeltaNet head norm, each way of pacing the weight copies: its shared memory within a Hopper program's limit, no
register spills, and one TMA copy per planned weight tile.
GPU (bfloat16): at Qwen3.5-0.8B's shapes as close to the float64 math as the three-launch kernel it replaces
(gated and head-normed), at sizes no program count divides (programs with no rows of a phase), the counters
left zero with no barrier given up, and a CUDA graph of four layers with PDL replaying the eager result bit for
bit (the counters reset themselves between launches).
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.gated_delta_rule import gated_rms_norm
from qwen_triton.operators.linear import staged_out_projection_mlp as staged
from qwen_triton.operators.linear.staged_out_projection_mlp import staged_out_projection_mlp
from tests.operators.test_out_projection_mlp import EPS, head_norm_block, linear_chain, make_block, reference
from tests.operators.test_out_projection_mlp import run as run_three_launches
from tests.support import graph_replays_as_eager, run_without_interpreter


def run(block, counters=None, **options):
    hidden = block["hidden"].clone()
    counters = staged.new_counters(hidden.device)[0] if counters is None else counters
    names = ("x", "out_weight", "hidden", "norm_weight", "gate_up_weight", "down_weight")
    arguments = [hidden if name == "hidden" else block[name] for name in names]
    assert staged_out_projection_mlp(*arguments, EPS, counters, gate=block.get("gate"), **options) is hidden
    if hidden.is_cuda:
        torch.cuda.synchronize()
        assert counters.tolist() == [0, 0, 0, 0], counters  # reset, and no barrier gave up
    return hidden


def test_plan():
    # Qwen3.5-0.8B on the H200's 132 SMs: 8 rows of W_o and W_d and 28 gate/up rows a program, 128 programs
    launch = staged.plan(1024, 2048, 3584, 132)
    assert (launch["grid"], launch["out_groups"], launch["up_groups"]) == (128, 2, 7)
    # 7 gate/up groups of 4 rows held as 8 (registers want a power of two): 216 KiB of tiles, 200 KiB copied
    assert (launch["out_padded"], launch["up_padded"], launch["copies"]) == (2, 8, 2 * (8 + 14) + 2 * 7 * 4)
    assert launch["shared_bytes"] == (2 * (8 + 14) + 2 * 8 * 4) * 2048 + 16 * 256 * 2 + 64
    # on half the SMs the weights no longer fit in shared memory; sizes off the 256-column tiles; K too long
    assert staged.plan(1024, 2048, 3584, 64) is None
    assert staged.plan(1000, 2048, 3584, 132) is None
    assert staged.plan(1024, 2048, 8192, 132) is None
    # an uneven split: 20 hidden rows a program (the 39th program has none), 32 intermediate rows
    launch = staged.plan(768, 512, 1280, 40)
    assert (launch["grid"], launch["out_groups"], launch["up_groups"]) == (40, 5, 8)
    assert (launch["out_padded"], launch["up_padded"]) == (8, 8)
    assert [staged.padded_groups(groups) for groups in (1, 2, 3, 7, 8)] == [2, 2, 4, 8, 8]


def test_argument_checks():
    block = make_block(1, 1024, 2048, 3584, torch.bfloat16, "cpu", gated=True)
    counters = staged.new_counters("cpu")[0]

    def call(block, counters=counters, **options):
        names = ("x", "out_weight", "hidden", "norm_weight", "gate_up_weight", "down_weight")
        staged_out_projection_mlp(*[block[name] for name in names], EPS, counters, gate=block.get("gate"),
                                  programs=132, **options)

    with pytest.raises(ValueError, match="x"):  # one token only
        call(make_block(2, 1024, 2048, 3584, torch.bfloat16, "cpu", gated=False))
    with pytest.raises(ValueError, match="x"):
        call(make_block(1, 1024, 2048, 3584, torch.float32, "cpu", gated=False))
    with pytest.raises(ValueError, match="counters"):
        call(block, counters=staged.new_counters("cpu", 2))
    with pytest.raises(ValueError, match="gate_up_weight"):
        call(dict(block, gate_up_weight=block["gate_up_weight"][:-1]))
    with pytest.raises(ValueError, match="exclude"):
        call(block, head_norm=(block["x"], block["norm_weight"][:128]))
    plain = dict(block)
    del plain["gate"]
    with pytest.raises(ValueError, match="head_norm weight"):
        call(plain, head_norm=(block["x"], block["norm_weight"][:96]))
    with pytest.raises(ValueError, match="does not apply"):
        call(make_block(1, 1024, 2048, 4096 + 256, torch.bfloat16, "cpu", gated=False))


COMPILE_FOR_HOPPER = """
import json, os, subprocess, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qwen_triton.operators.linear import staged_out_projection_mlp as staged
kernel = staged._staged_kernel
H, A, I = 1024, 2048, 3584
descriptors = dict(zip(("out_descriptor", "gate_up_descriptor", "down_descriptor"), staged.weight_descriptors(
    torch.zeros(H, A, dtype=torch.bfloat16), torch.zeros(2 * I, H, dtype=torch.bfloat16),
    torch.zeros(H, I, dtype=torch.bfloat16))))
launch = staged.plan(H, A, I, 132)
signature = {name: mangle_type(descriptors[name]) if name in descriptors else "*i32" if name == "counter_ptr" else
             "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "constexpr" for name in kernel.arg_names}
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
results = {}
for head_norm in (False, True):
    constants = dict(HIDDEN=H, ATTENDED=A, INTERMEDIATE=I, OUT_GROUPS=launch["out_groups"],
                     UP_GROUPS=launch["up_groups"], OUT_PADDED=launch["out_padded"], UP_PADDED=launch["up_padded"],
                     HAS_GATE=not head_norm, HEAD_NORM=head_norm,
                     HEAD_DIM=128 if head_norm else 256, ROUND_PRODUCT=True, USE_PDL=True,
                     WARPS=staged.WARPS.value)
    compiled = triton.compile(GluonASTSource(fn=kernel, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=staged.WARPS.value))
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    results["head-norm" if head_norm else "gate"] = dict(
        shared=compiled.metadata.shared, stack=int(usage.split("STACK:")[1].split()[0]),
        copies=compiled.asm["ptx"].count("cp.async.bulk.tensor"))
print(json.dumps(dict(results, plan=launch)))
"""


def test_compiles_for_hopper():
    results = run_without_interpreter(COMPILE_FOR_HOPPER)
    launch = results.pop("plan")
    for name, result in results.items():
        assert launch["shared_bytes"] <= result["shared"] <= staged.SHARED_MEMORY_LIMIT, (name, result)
        assert result["stack"] == 0, (name, result)
        assert result["copies"] == launch["copies"], (name, result)


def relative_error(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_real_shape(gated):
    block = make_block(1, 1024, 2048, 3584, torch.bfloat16, "cuda", gated, seed=11)
    ref = reference(block)
    three_launches = relative_error(run_three_launches(block), ref)
    chain = relative_error(linear_chain(block), ref)
    error = relative_error(run(block), ref)
    print(f"staged relative error {error:.2e} (three launches {three_launches:.2e}, linear chain {chain:.2e})")
    assert error < 5e-3 and error < 1.5 * max(chain, three_launches) + 1e-4


@pytest.mark.gpu
def test_gpu_head_norm_real_shape():
    block, z, weight = head_norm_block()
    expected = run_three_launches(dict(block, x=gated_rms_norm(block["x"].view(1, 16, 128), z, weight, EPS)))
    got = run(block, head_norm=(z, weight))
    difference = relative_error(got, expected.double())
    print(f"staged head_norm against norming first: relative difference {difference:.2e}")
    assert difference < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_uneven_split(gated):
    # 40 programs: 20 hidden rows each (the last has none), 32 intermediate rows (the last gets 32 of 1280)
    block = make_block(1, 768, 512, 1280, torch.bfloat16, "cuda", gated, seed=13)
    ref = reference(block)
    error = relative_error(run(block, programs=40), ref)
    assert error < 1.5 * relative_error(linear_chain(block), ref) + 1e-4


@pytest.mark.gpu
def test_gpu_cuda_graph_with_pdl():
    layers = [make_block(1, 1024, 2048, 3584, torch.bfloat16, "cuda", gated=i % 2 == 1, seed=20 + i) for i in range(4)]
    hidden = layers[0]["hidden"].clone()
    act = torch.empty(1, 3584, device="cuda", dtype=torch.bfloat16)
    counters = staged.new_counters("cuda", len(layers))
    descriptors = [staged.weight_descriptors(b["out_weight"], b["gate_up_weight"], b["down_weight"]) for b in layers]

    def step():  # four layers back to back on one residual stream, as a decode step chains them
        for i, block in enumerate(layers):
            staged_out_projection_mlp(block["x"], block["out_weight"], hidden, block["norm_weight"],
                                      block["gate_up_weight"], block["down_weight"], EPS, counters[i],
                                      gate=block.get("gate"), act=act, pdl=True, descriptors=descriptors[i])

    expected = hidden.clone()
    for block in layers:  # the three-launch kernel, layer after layer
        expected = run_three_launches(dict(block, hidden=expected))
    eager = graph_replays_as_eager(step, hidden)  # each replay from the same start gives the eager result
    assert relative_error(eager, expected.double()) < 5e-3
    assert not counters.any(), counters
