"""Registers, spills and SASS instruction counts of the chunked delta rule's kernels compiled for sm_90, on the CPU.

No GPU: Triton compiles the kernel for an H100/H200 target with its bundled ptxas, and cuobjdump (bundled
too) reports the registers and stack (spills) per thread and disassembles it; the shared memory per program
is the compiler's (what decides, with the registers, how many programs share an SM). The arguments are
specialised as the engine's are (pointers and strides divisible by 16, the real shape, bf16). A static count,
not a timing: fewer instructions on a latency-bound kernel's critical path is a prediction to measure on the
GPU.

    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py prepare [--warps 8 4] [--stages 3] [--chunk 64]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py inverse [--maxnreg 168]  (or products: kernel 1 in two parts)
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py state --block-v 32 [--warps 8]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py output [--warps 4] [--constant SCORES_HERE=True]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py state --block-v 32 --warps 8 --stages 3 --sequence \
        [--constant NAME=VALUE]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py gemm-epilogues [--variant "in-projection folded" --sequence]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py resident [--sequence]
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py argmax-tiled
    TRITON_INTERPRET=0 python3 benchmarks/sass_counts.py bucket-picks

gemm-epilogues: the GEMM's code with and without the folded norm's epilogues, for the tiles a prefill of 4096
tokens runs (TMA loads, 8 warps, 3 stages): the DeltaNet in-projection (128 x 128, with and without the folded
norm's 1/rms), gate/up (the same), down (128 x 256, residual, with and without the sums of squares); and a short
prompt's down split in four over pointer loads (64 x 64, 4 warps), with the sums. One line of JSON of each
variant's counts (the CPU test `tests/operators/test_linear.py::test_gemm_folded_norm_epilogues_compile_for_hopper`
runs it); with --variant NAME --sequence that variant's PTX operations in order.

resident: the resident-weights GEMM's code for the 0.8B's projections with the engine's configs (the CPU test
`tests/operators/test_resident_gemm.py::test_resident_gemm_compiles_for_hopper_without_spills` runs it).

bucket-picks: the decode GEMM's code for the 0.8B's projections with each decode bucket's own picks in the tuning
table (the CPU test `tests/operators/test_linear.py::test_bucket_picks_compile_for_hopper` runs it).

argmax-tiled: the tiled LM head's kernel (lm_head/argmax.py) at the 0.8B's head with the tuning table's pin of each
bucket of rows, greedy and sampling (the CPU test `tests/operators/test_lm_head.py::test_tiled_head_compiles_for_hopper`
runs it).

--sequence prints the PTX's shared-memory, tensor-core, barrier and global-memory operations in program order (runs
of one operation collapsed to `op xN`): what a loop's step waits on. --constant NAME=VALUE sets a constexpr of the
kernel (a Python literal), e.g. the flag of a variant under study (TRANSPOSED=True at commit b732384:
docs/decisions.md, D70; ONE_PRODUCT=True with this script run on commit ca65ef3's chunk.py: D71).
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from qwen_triton.operators.gated_delta_rule import chunk
from qwen_triton.operators.linear import gemm

FLOAT32_POINTERS = {"decay_ptr", "state_ptr", "a_log_ptr", "dt_bias_ptr", "system_ptr"}
INTEGERS = {"length", "chunks", "chunk_bucket"}


SEQUENCE_OPERATIONS = ("wgmma.mma_async", "wgmma.wait_group", "mma.sync", "ldmatrix", "st.shared", "ld.shared",
                       "bar.sync", "cp.async.wait", "cp.async.commit", "cp.async", "st.global", "ld.global", "shfl")


def operation_sequence(ptx: str) -> str:
    """The PTX's operations of SEQUENCE_OPERATIONS, its labels and branches, in order, runs collapsed."""
    runs: list[list] = []
    for line in ptx.splitlines():
        text = line.strip()
        if not text or text.startswith(("//", ".")):
            continue
        words = text.split()
        operation = words[1] if text.startswith("@") and len(words) > 1 else words[0]
        if text.startswith("$L__BB"):
            name = text.split(":")[0]
        elif operation.startswith("bra"):
            name = "bra"
        else:
            name = next((o for o in SEQUENCE_OPERATIONS if operation.startswith(o)), None)
        if name is None:
            continue
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return " ".join(f"{name} x{count}" if count > 1 else name for name, count in runs)


def compile_counts(kernel, constants: dict, warps: int, stages: int, sequence: bool = False,
                   types: dict | None = None, divisible: tuple = (), maxnreg: int | None = None) -> dict:
    """The kernel compiled for sm_90 with `constants` (its constexprs): registers, stack, shared memory, SASS opcode
    counts (and with `sequence` the PTX's, see operation_sequence). Argument types follow the names (pointers bf16
    but FLOAT32_POINTERS, INTEGERS and strides i32) unless `types` names them (e.g. a tensor descriptor's
    `mangle_type`). Pointers named *_ptr and strides are specialised as divisible by 16, as Triton specialises the
    engine's; `divisible` names more arguments so (pointers named otherwise, sizes that are multiples of 16).
    maxnreg: a config's register cap."""
    types = types or {}
    signature, constexprs = {}, {}
    for name in kernel.arg_names:
        if name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in FLOAT32_POINTERS else "*bf16"
        elif name in ("scale", "eps"):
            signature[name] = "fp32"
        elif name in INTEGERS or name.startswith("stride"):
            signature[name] = "i32"
        else:
            signature[name], constexprs[name] = "constexpr", constants[name]
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if (name.endswith("_ptr") and signature[name].startswith("*")) or name.startswith("stride")
                 or name in divisible}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=divisible),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages,
                                           **({"maxnreg": maxnreg} if maxnreg else {})))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(tempfile.mkdtemp(), "kernel.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                           check=True).stdout
    sass = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", path], capture_output=True, text=True,
                          check=True).stdout
    opcodes = collections.Counter(
        match.group(1).split(".")[0] for match in
        (re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line) for line in sass.splitlines()) if match)
    registers, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    counts = dict(registers=registers, stack_bytes=stack, shared_bytes=compiled.metadata.shared,
                  instructions=sum(opcodes.values()), shared_stores=opcodes["STS"], shared_loads=opcodes["LDS"],
                  barriers=opcodes["BAR"],
                  tensor_core={name: opcodes[name] for name in ("HGMMA", "HMMA")}, top=dict(opcodes.most_common(8)))
    if sequence:
        counts["sequence"] = operation_sequence(compiled.asm["ptx"])
    return counts


GEMM_VARIANTS = (  # name, ACTIVATION, HAS_RESIDUAL, FOLDED_NORM, WRITE_SQUARES, BLOCK_M, BLOCK_N, SPLIT_K, TMA, warps
    ("in-projection", 0, False, False, False, 128, 128, 1, True, 8),
    ("in-projection folded", 0, False, True, False, 128, 128, 1, True, 8),
    ("gate/up", 1, False, False, False, 128, 128, 1, True, 8),
    ("gate/up folded", 1, False, True, False, 128, 128, 1, True, 8),
    ("down", 0, True, False, False, 128, 256, 1, True, 8),
    ("down squares", 0, True, False, True, 128, 256, 1, True, 8),
    ("down squares split", 0, True, False, True, 64, 64, 4, False, 4),
)


def gemm_epilogues(variant: str | None, sequence: bool) -> None:
    """The GEMM variants' counts as one line of JSON (or one variant's PTX sequence)."""
    import json

    import torch
    from triton.runtime.jit import mangle_type
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(4096, 1024, dtype=torch.bfloat16)
    results = {}
    for name, activation, residual, folded, squares, block_m, block_n, split_k, tma, warps in GEMM_VARIANTS:
        if variant and name != variant:
            continue
        types = dict({pointer: "*fp32" for pointer in ("partial_ptr", "norm_squares_ptr", "squares_ptr")},
                     counter_ptr="*i32", **{integer: "i32" for integer in ("M", "N", "K", "M_BUCKET", "PARTS")})
        if tma:
            types["x_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_m, 64]))
            types["w_ptr"] = mangle_type(TensorDescriptor(x, [4096, 1024], [1024, 1], [block_n, 64]))
        constants = dict(ACTIVATION=activation, HAS_RESIDUAL=residual, SPLIT_ALLOWED=split_k > 1, FOLDED_NORM=folded,
                         WRITE_SQUARES=squares, BLOCK_PARTS=32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
                         GROUP_M=8, SPLIT_K=split_k, TMA=tma, USE_PDL=False)
        counts = compile_counts(gemm._gemm_kernel, constants, warps, 3, sequence=sequence, types=types)
        if sequence:
            print(counts["sequence"])
            return
        results[name] = {key: counts[key] for key in ("registers", "stack_bytes", "shared_bytes", "shared_stores",
                                                      "shared_loads", "barriers", "tensor_core")}
    print(json.dumps(results))


def resident(sequence: bool) -> None:
    """The resident-weights GEMM's counts (linear/resident_gemm.py) for the 0.8B's projections with the configs the
    engine launches them with (`config_for`), as one line of JSON (or the first one's PTX sequence)."""
    import json

    from qwen_triton.operators.linear import resident_gemm

    types = dict({pointer: "*fp32" for pointer in ("partial_ptr", "norm_squares_ptr", "squares_ptr")},
                 counter_ptr="*i32", **{integer: "i32" for integer in ("M", "N", "K", "K_PER_SPLIT", "PARTS")})
    results = {}
    for name, K, pair, residual, folded in RESIDENT_VARIANTS:
        config = resident_gemm.config_for(K, pair)
        columns = resident_gemm.split_columns(K, config["SPLIT_K"])
        constants = dict(ACTIVATION=int(pair), HAS_RESIDUAL=residual, FOLDED_NORM=folded, WRITE_SQUARES=residual,
                         BLOCK_PARTS=32, BLOCK_M=resident_gemm.BLOCK_M, BLOCK_N=config["BLOCK_N"],
                         BLOCK_K=triton.next_power_of_2(columns), SPLIT_K=config["SPLIT_K"], USE_PDL=True)
        counts = compile_counts(resident_gemm._resident_kernel, constants, config["num_warps"], 1, sequence=sequence,
                                types=types, divisible=("N", "K", "K_PER_SPLIT"))
        if sequence:
            print(counts["sequence"])
            return
        results[name] = {key: counts[key] for key in ("registers", "stack_bytes", "shared_bytes", "tensor_core")}
    print(json.dumps(results))


def argmax_tiled() -> None:
    """The tiled LM head's counts (lm_head/argmax.py, `_lm_head_argmax_tiled_kernel`) for each bucket of rows of the
    tuning table's pins (tuning/h200.py, lm_head_tiled_by_rows), greedy and sampling, as one line of JSON."""
    import json

    from qwen_triton.operators.common import preferred_entry
    from qwen_triton.operators.lm_head import argmax
    from qwen_triton.tuning import H200

    types = {"temperature_ptr": "*fp32", "seed_ptr": "*i64", "step_ptr": "*i64", "value_ptr": "*fp32",
             "index_ptr": "*i32", "tiles_ptr": "*i32", **{n: "i32" for n in ("M", "V", "K", "M_BUCKET", "MAX_TILES")}}
    results = {}
    for rows in (16, 32, 64, 128):
        pin = preferred_entry(H200.lm_head_tiled_by_rows, rows, argmax.TILED_FIELDS)
        for sample in (False, True):
            constants = dict(SAMPLE=sample, SEED_PER_ROW=False, BLOCK_M=rows, BLOCK_V=pin["BLOCK_V"],
                             BLOCK_K=pin["BLOCK_K"], USE_PDL=True)
            counts = compile_counts(argmax._lm_head_argmax_tiled_kernel.fn, constants, pin["num_warps"],
                                    pin["num_stages"], types=types)
            results[f"{rows} rows" + (", sampling" if sample else "")] = {
                key: counts[key] for key in ("registers", "stack_bytes", "shared_bytes", "tensor_core")}
    print(json.dumps(results))


def bucket_picks() -> None:
    """The decode GEMM's counts (linear/gemm.py, `_gemm_kernel` over pointer loads, PDL) for the 0.8B's projections
    with each decode bucket's own picks in the tuning table (tuning/h200.py, gemm_decode_by_rows) and, beside them,
    the one pick per K they replace there, as one line of JSON."""
    import json

    from qwen_triton.operators.common import preferred_entry
    from qwen_triton.operators.linear import gemm
    from qwen_triton.tuning import H200

    types = dict({pointer: "*fp32" for pointer in ("partial_ptr", "norm_squares_ptr", "squares_ptr")},
                 counter_ptr="*i32", **{integer: "i32" for integer in ("M", "N", "K", "M_BUCKET", "PARTS")})
    results = {}
    for bucket, table in H200.gemm_decode_by_rows:
        for name, K, pair, residual, folded in RESIDENT_VARIANTS:
            one_per_k = preferred_entry(H200.gemm_decode_by_k, K, gemm.DECODE_FIELDS)
            for variant, pick in (("", gemm.bucket_pick(bucket, K, int(pair), residual)),
                                  (", one pick per K", dict(one_per_k, BLOCK_M=min(bucket, 64)))):
                constants = dict(ACTIVATION=int(pair), HAS_RESIDUAL=residual, SPLIT_ALLOWED=True, FOLDED_NORM=folded,
                                 WRITE_SQUARES=residual, BLOCK_PARTS=32, BLOCK_M=pick["BLOCK_M"],
                                 BLOCK_N=pick["BLOCK_N"], BLOCK_K=pick["BLOCK_K"], GROUP_M=8, SPLIT_K=pick["SPLIT_K"],
                                 TMA=False, USE_PDL=True)
                counts = compile_counts(gemm._gemm_kernel, constants, pick["num_warps"], pick["num_stages"],
                                        types=types)
                results[f"{bucket} rows {name}{variant}"] = {key: counts[key] for key in (
                    "registers", "stack_bytes", "shared_bytes", "tensor_core")}
    print(json.dumps(results))


RESIDENT_VARIANTS = (  # name, K, SwiGLU pair, residual (+ the sums of squares), folded norm
    ("in-projection", 1024, False, False, True),
    ("gate/up", 1024, True, False, True),
    ("down", 3584, False, True, False),
    ("out-projection", 2048, False, True, False),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kernel", choices=["prepare", "inverse", "products", "state", "output", "gemm-epilogues",
                                           "resident", "argmax-tiled", "bucket-picks"])
    parser.add_argument("--variant", choices=[variant[0] for variant in GEMM_VARIANTS],
                        help="gemm-epilogues: this variant alone")
    parser.add_argument("--warps", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--maxnreg", type=int, help="a register cap (a config's maxnreg)")
    parser.add_argument("--block-v", type=int, default=32, help="the state pass's BLOCK_V")
    parser.add_argument("--chunk", type=int, default=chunk.CHUNK, choices=chunk.CHUNK_SIZES, help="the chunk's rows")
    parser.add_argument("--sequence", action="store_true", help="the PTX's operation sequence (see above)")
    parser.add_argument("--constant", action="append", default=[], metavar="NAME=VALUE",
                        help="a constexpr of the kernel (a Python literal); repeatable")
    args = parser.parse_args()
    if args.kernel == "gemm-epilogues":
        gemm_epilogues(args.variant, args.sequence)
        return
    if args.kernel == "resident":
        resident(args.sequence)
        return
    if args.kernel == "argmax-tiled":
        argmax_tiled()
        return
    if args.kernel == "bucket-picks":
        bucket_picks()
        return
    kernel = getattr(chunk, f"_chunk_{args.kernel}_kernel").fn
    constants = dict(V_HEADS=16, GROUP=1, K_DIM=128, V_DIM=128, BLOCK_K=128, CHUNK_ROWS=args.chunk, PRECISION="tf32",
                     BLOCK_V=args.block_v if args.kernel == "state" else 128, DOT_DTYPE=tl.bfloat16,
                     BLOCK_D=128, NORM=True, ROUND_PRODUCT=True,  # the output kernel as the engine runs it
                     SCORES_HERE=False, SCORES_DTYPE=tl.bfloat16)  # (--constant SCORES_HERE=True: it forms the scores)
    for item in args.constant:
        name, value = item.split("=", 1)
        if name not in kernel.arg_names:
            raise SystemExit(f"{kernel.__name__} has no argument {name}")
        constants[name] = ast.literal_eval(value)
    for warps in args.warps:
        counts = compile_counts(kernel, constants, warps, args.stages, args.sequence, maxnreg=args.maxnreg)
        sequence = counts.pop("sequence", None)
        cap = f", at most {args.maxnreg} registers" if args.maxnreg else ""
        print(f"{args.kernel}, chunks of {args.chunk}, {warps} warps, {args.stages} stages{cap}:", counts)
        if sequence:
            print("  PTX sequence:", sequence)


if __name__ == "__main__":
    main()
