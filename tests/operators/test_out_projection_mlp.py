"""`out_projection_mlp`: a decode layer's out-projection + residual and MLP, one program per SM per phase.

CPU (interpreter): float32 and float16 against the three `linear` calls it replaces and against the float64
math, sizes that no program count divides, M = 1 and 3, with and without the attention's output gate, with
the DeltaNet output norm as phase 1's prologue (head_norm), and every argument check.
Also on the CPU: the kernel compiles for the H200 (sm_90, through ptxas) at the real shapes, each phase,
without spilling more than a few registers (the interpreter never compiles it).
GPU (bfloat16, Qwen3.5-0.8B's shapes): as close to the float64 math as the `linear` chain, head_norm as
close as norming first, and a CUDA graph with PDL replays the eager result.
"""

from __future__ import annotations

import pytest
import torch

from qwen_triton.operators.gated_delta_rule import gated_rms_norm
from qwen_triton.operators.linear import linear
from qwen_triton.operators.linear.out_projection_mlp import out_projection_mlp

from qwen_triton.reference import functional as fn
from tests.support import graph_replays_as_eager, run_without_interpreter

EPS = 1e-6


def make(shape, dtype, device, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)


def make_block(rows, size, attended, intermediate, dtype, device, gated, seed=0):
    block = dict(
        x=make((rows, attended), dtype, device, seed),
        out_weight=make((size, attended), dtype, device, seed + 1, scale=attended ** -0.5),
        hidden=make((rows, size), dtype, device, seed + 2),
        norm_weight=make((size,), dtype, device, seed + 3, scale=0.3),
        gate_up_weight=make((2 * intermediate, size), dtype, device, seed + 4, scale=size ** -0.5),
        down_weight=make((size, intermediate), dtype, device, seed + 5, scale=intermediate ** -0.5),
    )
    if gated:  # a strided row view, as the engine passes the gate columns of the attention in-projection
        block["gate"] = make((rows, attended + 5), dtype, device, seed + 6, scale=2.0)[:, 5:]
    return block


def run(block, **options):
    hidden = block["hidden"].clone()
    names = ("x", "out_weight", "hidden", "norm_weight", "gate_up_weight", "down_weight")
    arguments = [hidden if name == "hidden" else block[name] for name in names]
    assert out_projection_mlp(*arguments, EPS, gate=block.get("gate"), **options) is hidden
    return hidden


def linear_chain(block):
    """The three projections as the engine ran them before (GEMV path)."""
    hidden = block["hidden"].clone()
    hidden = linear(block["x"], block["out_weight"], gate=block.get("gate"), residual=hidden, out=hidden)
    act = linear(hidden, block["gate_up_weight"], norm_weight=block["norm_weight"], eps=EPS, activation="swiglu")
    return linear(act, block["down_weight"], residual=hidden, out=hidden)


def reference(block):
    """float64 math, rounded to the activation dtype where the engine stores a tensor."""
    dtype = block["x"].dtype
    x = block["x"]
    if "gate" in block:
        x = (x.double() * torch.sigmoid(block["gate"].double())).to(dtype)
    hidden = (block["hidden"].double() + x.double() @ block["out_weight"].double().T).to(dtype)
    normed = fn.rms_norm(hidden, block["norm_weight"], EPS)
    gate_up = normed.double() @ block["gate_up_weight"].double().T
    gate, up = gate_up.chunk(2, dim=-1)
    act = (torch.nn.functional.silu(gate) * up).to(dtype)
    return hidden.double() + act.double() @ block["down_weight"].double().T


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, gated", [(1, False), (1, True), (3, True)])
def test_matches_linear_chain_and_reference(device, dtype, rows, gated):
    # 8 programs under the interpreter: 40 hidden rows are 5 per program, 52 intermediate rows 7 (the last
    # program gets 3); attended 72 and intermediate 52 are no multiple of any tile
    block = make_block(rows, 40, 72, 52, dtype, device, gated, seed=rows)
    out = run(block)
    chain = linear_chain(block)
    ref = reference(block)
    if dtype == torch.float32:
        torch.testing.assert_close(out, chain, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    else:  # a last-bit difference in a rounded intermediate can move an output by an ulp or two
        torch.testing.assert_close(out, chain, rtol=4e-3, atol=4e-3)
        torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_rows_are_batch_invariant(device):
    block = make_block(3, 40, 72, 52, torch.float32, device, gated=True, seed=9)
    together = run(block)
    for row in range(3):
        alone = {name: tensor[row:row + 1] if name in ("x", "hidden", "gate") else tensor
                 for name, tensor in block.items()}
        assert torch.equal(run(alone), together[row:row + 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3])
def test_head_norm_prologue_equals_the_gated_norm_before(device, dtype, rows):
    # head_norm: x is a delta rule's output, normed per head (gated_rms_norm) by each program itself, with
    # the norm kernel's roundings (5 heads of 20: padded heads and padded values)
    block = make_block(rows, 40, 100, 52, dtype, device, gated=False, seed=10 + rows)
    z = make((rows, 100 + 3), dtype, device, 30, scale=2.0)[:, 3:]  # a strided row view, as the engine's
    weight = make((20,), dtype, device, 31, scale=0.5) + 1
    normed = gated_rms_norm(block["x"].view(rows, 5, 20), z, weight, EPS)
    expected = run(dict(block, x=normed))
    got = run(block, head_norm=(z, weight))
    # the products summed per head, then over the heads: float32 sums in another order
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="exclude each other"):
        run(dict(block, gate=z), head_norm=(z, weight))
    with pytest.raises(ValueError, match="divisor"):
        run(block, head_norm=(z, weight[:7]))
    with pytest.raises(ValueError, match="head_norm z"):
        run(block, head_norm=(z[:, 1:], weight))


def test_head_norm_a_few_heads_a_step(device):
    # 256 hidden rows over 2 programs: 128 rows each, so a step's tile takes 2 of the 5 heads of 64 values
    # (16,384 weights): three K steps, the last with one head, as the larger sizes' tiles do
    from qwen_triton.operators.linear.out_projection_mlp import _head_step

    assert _head_step(128, 5, 64) == 2 and _head_step(8, 16, 128) == 16
    block = make_block(2, 256, 320, 52, torch.float32, device, gated=False, seed=14)
    z = make((2, 320), torch.float32, device, 32, scale=2.0)
    weight = make((64,), torch.float32, device, 33, scale=0.5) + 1
    normed = gated_rms_norm(block["x"].view(2, 5, 64), z, weight, EPS)
    expected = run(dict(block, x=normed), programs=2)
    got = run(block, head_norm=(z, weight), programs=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_fewer_and_more_programs(device):
    # no program waits on another: any grid, down to programs without rows (100 > 72)
    block = make_block(2, 40, 72, 52, torch.float32, device, gated=False, seed=3)
    expected = run(block)
    for programs in (3, 20, 100):
        torch.testing.assert_close(run(block, programs=programs), expected, rtol=1e-6, atol=1e-6)


def test_argument_errors(device):
    block = make_block(1, 40, 72, 52, torch.float32, device, gated=True)
    with pytest.raises(ValueError, match="programs"):
        run(block, programs=0)
    with pytest.raises(ValueError, match="out_weight"):  # x's width is A: the out-projection must match it
        run(dict(block, x=block["x"][:, :-1]))
    with pytest.raises(ValueError, match="^x "):
        run(dict(block, x=block["x"].double()))
    with pytest.raises(ValueError, match="gate_up_weight"):
        run(dict(block, gate_up_weight=block["gate_up_weight"][:-1]))
    with pytest.raises(ValueError, match="down_weight"):
        run(dict(block, down_weight=block["down_weight"][:, :-2].contiguous()))
    with pytest.raises(ValueError, match="gate"):
        run(dict(block, gate=block["gate"][:, :-1]))
    with pytest.raises(ValueError, match="hidden"):
        run(dict(block, hidden=block["hidden"].half()))


COMPILE_FOR_HOPPER = """
import importlib, json, os, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
block = importlib.import_module("qwen_triton.operators.linear.out_projection_mlp")
kernel = block._out_projection_mlp_kernel
strides = ("stride_xm", "stride_gm", "stride_hm", "stride_am", "stride_zm")
signature = {name: "*bf16" if name.endswith("_ptr") else
             "fp32" if name == "eps" else "i32" if name in strides else "constexpr" for name in kernel.arg_names}
# as the launch specialises it for one row: M = 1 a constant, pointers and strides multiples of 16 (without these
# the loads are not vectorised, and the compile is not the one that runs)
attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in kernel.arg_names
         if name.endswith("_ptr") or name in strides}
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
H, A, I, HEADS = 1024, 2048, 3584, 16  # SIZES
stacks = {}
for phase, head_norm in ((1, False), (1, True), (2, False), (3, False)):
    constants = dict(M=1, HIDDEN=H, ATTENDED=A, INTERMEDIATE=I, HAS_GATE=not head_norm, PHASE=phase,
                     USE_PDL=True, HEAD_NORM=head_norm, HEADS=HEADS if head_norm else 1,
                     HEAD_DIM=128 if head_norm else 1, ROUND_PRODUCT=True,
                     BLOCK_D=128 if head_norm else 1)
    for suffix, (N, K, pair) in dict(OUT=(H, A, False), UP=(I, H, True), DOWN=(H, I, False)).items():
        constants["BLOCK_N_" + suffix], constants["BLOCK_K_" + suffix] = block._tile(N, K, 132, pair)
    constants["BLOCK_H"] = block._head_step(constants["BLOCK_N_OUT"], HEADS, 128) if head_norm else 1
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=block.WARPS, num_stages=1))
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    open(path, "wb").write(compiled.asm["cubin"])
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    stacks[f"{phase}" + ("-head-norm" if head_norm else "")] = int(usage.split("STACK:")[1].split()[0])
print(json.dumps(stacks))
"""


# the family's sizes: (hidden, attended, MLP, DeltaNet value heads); the attended width of the 27B's attention (24
# heads of 256) equals its DeltaNet's (48 of 128)
FAMILY_SIZES = {"0.8b": (1024, 2048, 3584, 16), "4b": (2560, 4096, 9216, 32), "9b": (4096, 4096, 12288, 32),
                "27b": (5120, 6144, 17408, 48)}


@pytest.mark.parametrize("size", list(FAMILY_SIZES))
def test_compiles_for_hopper(size):
    # the interpreter never compiles a kernel: compile this one for sm_90 (Triton's bundled ptxas) in a
    # process without it at each size's (hidden, attended, MLP, DeltaNet value heads), and read the per-thread
    # stack (register spills) from cuobjdump's resource usage. (Until the head-normed out-projection took a few
    # heads a K step, it spilled 2,208 stack bytes at the 4B and the 9B, 10,336 at the 27B, and the 27B's up phase,
    # its tile then twice the others, 120.)
    sizes = FAMILY_SIZES[size]
    script = COMPILE_FOR_HOPPER.replace("1024, 2048, 3584, 16  # SIZES", ", ".join(map(str, sizes)))
    stacks = run_without_interpreter(script)
    assert set(stacks) == {"1", "1-head-norm", "2", "3"}
    assert all(stack == 0 for stack in stacks.values()), stacks


@pytest.mark.gpu
@pytest.mark.parametrize("gated", [False, True])
def test_gpu_real_shape(gated):
    block = make_block(1, 1024, 2048, 3584, torch.bfloat16, "cuda", gated, seed=11)
    ref = reference(block)

    def error(out):
        return ((out.double() - ref).norm() / ref.norm()).item()

    chain_error = error(linear_chain(block))
    out_error = error(run(block))
    print(f"out_projection_mlp relative error {out_error:.2e} (the linear chain's {chain_error:.2e})")
    assert out_error < 5e-3 and out_error < 1.5 * chain_error + 1e-4


def head_norm_block():
    """A Gated DeltaNet layer's tail at the real shape, its input o [1, 16 x 128] to be normed by (z, weight)
    first: (block, z, weight)."""
    block = make_block(1, 1024, 2048, 3584, torch.bfloat16, "cuda", gated=False, seed=12)
    z = make((1, 2048), torch.bfloat16, "cuda", 40, scale=2.0)
    weight = make((128,), torch.bfloat16, "cuda", 41, scale=0.3) + 1
    return block, z, weight


@pytest.mark.gpu
def test_gpu_head_norm_real_shape():
    # 16 heads of 128, as a Gated DeltaNet layer: the norm in phase 1's prologue against norming first
    block, z, weight = head_norm_block()
    expected = run(dict(block, x=gated_rms_norm(block["x"].view(1, 16, 128), z, weight, EPS)))
    got = run(block, head_norm=(z, weight))
    error = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
    print(f"head_norm against norming first: relative difference {error:.2e}")
    assert error < 2e-3


@pytest.mark.gpu
def test_gpu_cuda_graph_with_pdl():
    layers = [make_block(2, 1024, 2048, 3584, torch.bfloat16, "cuda", gated=i % 2 == 1, seed=20 + i) for i in range(4)]
    hidden = layers[0]["hidden"].clone()
    act = torch.empty(2, 3584, device="cuda", dtype=torch.bfloat16)

    def step():  # four layers back to back on one residual stream, as a decode step chains them
        for block in layers:
            out_projection_mlp(block["x"], block["out_weight"], hidden, block["norm_weight"],
                               block["gate_up_weight"], block["down_weight"], EPS, gate=block.get("gate"),
                               act=act, pdl=True)

    graph_replays_as_eager(step, hidden)  # each replay from the same start gives the eager result
