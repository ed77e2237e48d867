"""The `qwen-triton` command line.

    qwen-triton make-checkpoint --preset {tiny,0.8b} --out DIR [--seed N]
    qwen-triton generate [--model DIR] "prompt"
    qwen-triton chat [--model DIR]
    qwen-triton ops [--preset 0.8b|tiny | --model DIR] [--gpu h200|cpu] [--rows 1,4] [--tokens 1500]
    qwen-triton bench [--variants ...] [--quick] [--ops]
    qwen-triton profile [--context N] [--prefill N] [--out FILE.json]

Without --model, generate and chat run a random-weight model (the 0.8b shape on a GPU, the tiny preset on
a CPU), made once and kept under ~/.cache/qwen-triton. Errors are one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .progress import progress_printer

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen-triton"


class CommandError(Exception):
    """An error reported as one line, without a traceback."""


def default_model(device: str) -> Path:
    """The random-weight checkpoint used when no --model is given: made once, then reused."""
    from .checkpoint import make_preset_checkpoint

    preset = "0.8b" if device == "cuda" else "tiny"
    directory = DEFAULT_CACHE / "checkpoints" / f"{preset}-seed0"
    print(f"no --model given: using a random-weight {preset} model; its text is meaningless", file=sys.stderr)
    if not (directory / "config.json").exists():
        partial = directory.with_name(directory.name + ".partial")
        make_preset_checkpoint(preset, partial, seed=0, progress=progress_printer(f"making the {preset} checkpoint"))
        partial.rename(directory)
    return directory


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def command_make_checkpoint(args) -> None:
    from .checkpoint import make_preset_checkpoint

    out = make_preset_checkpoint(args.preset, args.out, seed=args.seed, progress=progress_printer("tensors"))
    print(f"wrote a random {args.preset} checkpoint to {out}")


def _load(args):
    device = args.device or _default_device()
    backend = args.backend or ("triton" if device == "cuda" else "reference")
    if backend == "triton" and device == "cpu":
        # the kernels run on the CPU only under Triton's interpreter, chosen before they are imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    args.backend = backend
    from . import LLM

    model = Path(args.model) if args.model else default_model(device)
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    print(f"loading {model} ({args.backend} backend, {device}, {dtype})", file=sys.stderr)
    return LLM(model, backend=args.backend, device=device, dtype=dtype, max_length=args.max_length, progress=True)


def command_generate(args) -> None:
    llm = _load(args)
    prompt = args.prompt
    if args.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    for piece in llm.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop):
        print(piece, end="", flush=True)
    result = llm.last_generation
    timings = result.timings
    print(file=sys.stdout)
    print(
        f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}; time to first token "
        f"{timings['time_to_first_token_s'] * 1e3:.1f} ms, {timings['decode_tokens_per_s']:.1f} tokens/s]",
        file=sys.stderr,
    )


def command_chat(args) -> None:
    llm = _load(args)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("chat: type a message; an empty line or Ctrl-D ends the chat", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = []
        for piece in llm.stream(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def command_ops(args) -> None:
    import torch

    from .checkpoint import PRESETS, official_config
    from .config import load_config, parse_config
    from .engine.plan import DEVICES, DeviceProperties, Options, resolve_plan
    from .operators.table import format_table

    print(format_table())
    config = load_config(args.model) if args.model else parse_config(official_config(PRESETS[args.preset]))
    if args.gpu:
        device = DEVICES[args.gpu]
    elif torch.cuda.is_available():
        device = DeviceProperties.of("cuda")
    else:
        device = DEVICES["h200"]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    plan = resolve_plan(config, device, Options(), dtype)
    buckets = {}
    if args.rows:
        buckets["decode_rows"] = [int(rows) for rows in args.rows.split(",")]
    if args.tokens:
        buckets["prefill_tokens"] = [int(tokens) for tokens in args.tokens.split(",")]
    print()
    print(plan.describe(config, **buckets))


def _measuring_device(args, cpu_warning: str) -> str:
    """The device of bench / profile: a missing GPU is an error; on the CPU the kernels are interpreted."""
    import torch

    device = args.device or _default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("device 'cuda' was asked for, but no CUDA GPU is available on this machine")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(cpu_warning, file=sys.stderr)
    return device


def command_bench(args) -> None:
    import json

    device = _measuring_device(args, "benchmarking on the CPU (Triton interpreted): the harness runs, "
                                     "its numbers mean nothing")
    steps = args.steps or (20 if args.quick else 200)
    if args.ops:
        if device != "cuda":
            raise CommandError("the operator benchmark needs a CUDA GPU")
        from .benchmark.operators import format_operator_table, run_operator_benchmark

        report = run_operator_benchmark(steps=min(steps, 100))
        out = Path(args.out) / "operators-latest.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(format_operator_table(report))
        return
    from .benchmark.harness import DECODE_CONTEXTS, PREFILL_LENGTHS, VARIANTS, format_table, run_benchmark

    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise CommandError(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    prefill = [int(n) for n in args.prefill.split(",")] if args.prefill else list(PREFILL_LENGTHS)
    contexts = [int(n) for n in args.contexts.split(",")] if args.contexts else list(DECODE_CONTEXTS)
    report = run_benchmark(variants, preset=args.preset, prefill_lengths=prefill, decode_contexts=contexts,
                           steps=steps, out_dir=args.out, device=device)
    print(format_table(report))


def command_profile(args) -> None:
    import json

    device = _measuring_device(args, "profiling on the CPU (Triton interpreted, operators timed on the host): "
                                     "its numbers mean nothing")
    for name in ("context", "prefill", "steps"):
        if getattr(args, name) <= 0:
            raise CommandError(f"--{name} must be positive, got {getattr(args, name)}")
    from .benchmark.profile import format_profile, run_profile

    report = run_profile(preset=args.preset, context=args.context, prefill_tokens=args.prefill, steps=args.steps,
                         device=device, pdl=False if args.no_pdl else None)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_profile(report))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen-triton", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser("make-checkpoint", help="write a random checkpoint in the official layout")
    make.add_argument("--preset", choices=["tiny", "0.8b"], required=True)
    make.add_argument("--out", required=True, type=Path)
    make.add_argument("--seed", type=int, default=0)
    make.set_defaults(run=command_make_checkpoint)

    def model_options(sub):
        sub.add_argument("--model", help="checkpoint directory (default: a random-weight model)")
        sub.add_argument("--backend", choices=["reference", "triton"],
                         help="default: triton on cuda, reference on cpu (triton runs there interpreted, slowly)")
        sub.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
        sub.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
        sub.add_argument("--max-length", type=int, default=4096, help="tokens of context (prompt + reply)")
        sub.add_argument("--max-new-tokens", type=int, default=64)
        sub.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        sub.add_argument("--top-k", type=int, default=0, help="0 = off")
        sub.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
        sub.add_argument("--seed", type=int, default=0)

    generate = commands.add_parser("generate", help="generate text from a prompt, streaming")
    generate.add_argument("prompt")
    model_options(generate)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--chat-template", action="store_true", help="wrap the prompt as one user turn")
    generate.set_defaults(run=command_generate)

    chat = commands.add_parser("chat", help="an interactive multi-turn chat")
    model_options(chat)
    chat.add_argument("--system", help="a system message")
    chat.set_defaults(run=command_chat)

    bench = commands.add_parser("bench", help="latency of each variant against the measured floor (GPU)")
    bench.add_argument("--variants", help="comma-separated subset of the variants (default: all)")
    bench.add_argument("--quick", action="store_true", help="20 timed steps instead of 200")
    bench.add_argument("--ops", action="store_true", help="time each operator instead of the whole model")
    bench.add_argument("--out", default="benchmarks/results", help="where the JSON and the plot go")
    bench.add_argument("--preset", choices=["0.8b", "tiny"], default="0.8b")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    bench.add_argument("--steps", type=int, help="timed decode steps per measurement (default 200)")
    bench.add_argument("--prefill", help="comma-separated prefill lengths (default 128,4096)")
    bench.add_argument("--contexts", help="comma-separated decode contexts (default 128,4096,32768)")
    bench.set_defaults(run=command_bench)

    profile = commands.add_parser("profile", help="one decode step and one prefill, kernel by kernel (GPU)")
    profile.add_argument("--context", type=int, default=128, help="decode context in tokens (default 128)")
    profile.add_argument("--prefill", type=int, default=128, help="prefill length in tokens (default 128)")
    profile.add_argument("--steps", type=int, default=20, help="decode steps profiled; medians are reported")
    profile.add_argument("--preset", choices=["0.8b", "tiny"], default="0.8b")
    profile.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    profile.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    profile.add_argument("--out", help="write the full report (every kernel) as JSON here")
    profile.set_defaults(run=command_profile)

    ops = commands.add_parser("ops", help="the table of operators and the plan: which kernel runs at which size")
    ops.add_argument("--preset", choices=["0.8b", "tiny"], default="0.8b", help="the model shape (default 0.8b)")
    ops.add_argument("--model", help="a checkpoint directory: its config.json's shape instead of a preset")
    ops.add_argument("--gpu", choices=["h200", "cpu"],
                     help="the device to resolve the plan for (default: the present GPU, else the H200)")
    ops.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ops.add_argument("--rows", help="decode batch buckets to show, e.g. 1,4 (default 1,2,4,8,16,32)")
    ops.add_argument("--tokens", help="prefill lengths to show, e.g. 1500 (default 16 to 8192)")
    ops.set_defaults(run=command_ops)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, NotImplementedError, CommandError) as error:
        print(f"qwen-triton: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
