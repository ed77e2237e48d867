"""Compile workers: a cold warm-up's compiling spread over processes.

On a machine whose Triton cache does not hold them yet, `LLM(...)`'s warm-up (engine/warmup.py) spends almost all
its time compiling some 170 kernel variants one after another: `LLM(...)` for 128 sequences of 2,304 tokens was
ready in 116.8 s on the H200 against issue 34's 90 s (BENCHMARKS.md), the recorded picks (tuning/picks.py) already
sparing most keys their timing (D143, D157). Compiling from threads gained nothing (the compiler holds the
interpreter lock), so the compiles run in processes:

    main process                                           worker i of N (a process of its own)
    its model built (the checkpoint's weights)
    the cache cold (no marker)? spawn N workers  ------->  a model of the same config, dtype, plan options,
                                                           max_length and max_batch, random weights made on the
                                                           GPU (no checkpoint read); the autotuners' results
                                                           kept off the disk; warm_up(share=(i, N)): the items
    wait for all (a progress line, a time limit)  <------  at positions i, i + N, ... of the warm-up's list; exit
    the whole warm-up, as without workers: each kernel now loads from the Triton cache the workers filled
    the marker written: later starts spawn no workers

What the workers leave is the Triton cache on disk, nothing else: they compile into the same cache directory
(TRITON_CACHE_DIR or Triton's default, inherited from the environment), and each of the main process's compiles
then loads its binary. A key with a recorded pick compiles one config in a worker and takes it in the main process
without timing; a key without one is timed in a worker over all its configs (so all are compiled) while the other
workers load the GPU, which is why no worker writes an autotuner's choice to disk (`Autotuner.cache_results` off):
the main process times that key itself on an idle GPU, every config already compiled. The main process's warm-up
also captures the CUDA graphs, which no cache keeps.

Cold or warm: a marker file, <cache>/qwen-triton-warm/<key>, written after a successful warm-up on a GPU; the key
is a digest of everything the warm-up's kernels depend on (`Identity`: the package's version and source files,
Triton's and PyTorch's versions, the GPU, the config, the dtype, the plan with its options, the recorded picks,
max_length and max_batch). With the marker present no worker starts, so a later start costs what it cost before
(4.9 s on a warm cache on the H100, D143) and the digest's reading of the package's files; without it (a new
machine, shape, version or picks file, an emptied cache) the workers run again.

How many (`worker_count`): QWEN_TRITON_COMPILE_WORKERS (0 turns them off), else min(8, half the CPUs: ptxas and
the LLVM passes each take a CPU); at most as many as fit the GPU's free memory, each counted as 1.5 times what the
main process has allocated (the model's weights and caches, plus the warm-up's buffers and graphs) and 1.5 GiB
(a process's CUDA context and kernels); fewer than 2 are not worth their start, so then none. A Ray replica on a
fraction of a GPU runs none unless the variable says otherwise (server/ray_app.py, `limit_compile_workers`).

What it costs: each worker starts Python, PyTorch and the package (a few seconds) and makes its model's weights on
the GPU (no disk read), holding its share of the GPU's memory while it runs; a kernel that every item launches
(the embedding, the norms, the reset) may compile in several workers at once; the rest of the work is divided. A worker that fails or outlives the time limit is reported on stderr and fails nothing: the main process
compiles what it left.

Workers are started as `python -m qwen_triton.engine.compile_workers` with their task pickled on stdin, not
through multiprocessing's spawn: spawn re-runs the main script of the parent in each child, and a script that
calls `LLM(...)` at its top level, as the README's does, would then load and warm up the model again in every
worker. Neither way forks the parent's CUDA context.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..progress import progress_printer
from . import warmup

WORKERS_VARIABLE = "QWEN_TRITON_COMPILE_WORKERS"
MOST_WORKERS = 8  # the default's ceiling: half the 16 CPUs of the H100 and H200 machines the targets are measured on
WAIT_SECONDS = 900.0  # a worker still running then is stopped (a whole cold warm-up alone: 116.8 s on the H200)
MARKERS = "qwen-triton-warm"  # the markers' folder in the Triton cache directory
CONTEXT_BYTES = 3 << 29  # 1.5 GiB: a worker's CUDA context, cuBLAS's workspace and its loaded kernels
# the command that starts a worker (its task on stdin)
WORKER_COMMAND = (sys.executable, "-m", "qwen_triton.engine.compile_workers")
PACKAGE = Path(__file__).resolve().parents[1]


# ---- cold or warm: the marker -------------------------------------------------------------------------------------
def source_digest() -> str:
    """A digest of the package's source and data files (its kernels, tables and picks): a change of any of them is
    a new warm-up, also where the version number stays."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        if path.suffix in (".py", ".json") and path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class Identity:
    """Everything a warm-up's kernels in the Triton cache depend on; two models of equal identities warm up the same
    kernels at the same keys."""

    package: str  # the version and `source_digest`
    triton: str
    torch: str
    gpu: str  # the device's name ("cpu" for the CPU)
    config: str  # the ModelConfig's repr
    dtype: str
    plan: str  # the resolved plan's repr: its options, the device's properties, the tuning table
    picks: str  # a digest of the recorded picks installed (tuning/picks.py; "none": no file)
    max_length: int
    max_batch: int

    @classmethod
    def of(cls, model) -> "Identity":
        import triton

        from .. import __version__
        from ..tuning.picks import install as install_picks

        device = model.device
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        # the picks file this process's kernels take (tuning/picks.py; none with QWEN_TRITON_PICKS=off)
        picks = install_picks(gpu) if device.type == "cuda" else None
        return cls(f"{__version__}+{source_digest()}", triton.__version__, torch.__version__, gpu, repr(model.config),
                   str(model.dtype), repr(model.plan),
                   "none" if picks is None else hashlib.sha256(picks.read_bytes()).hexdigest(),
                   model.max_length, model.max_batch)

    def key(self) -> str:
        fields = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:32]


def cache_directory() -> Path:
    """Triton's cache directory: TRITON_CACHE_DIR, else its default (~/.triton/cache)."""
    import triton

    return Path(triton.knobs.cache.dir)


def marker_path(identity: Identity, cache: Path | None = None) -> Path:
    return (cache_directory() if cache is None else Path(cache)) / MARKERS / identity.key()


def is_warm(identity: Identity, cache: Path | None = None) -> bool:
    """Whether a warm-up of this identity has completed on this cache (its marker is there)."""
    return marker_path(identity, cache).is_file()


def mark_warm(identity: Identity, cache: Path | None = None) -> None:
    """Write the marker (the identity's fields, readable); a cache that cannot be written goes without one (the
    next start's workers cost time, not correctness)."""
    path = marker_path(identity, cache)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(dataclasses.asdict(identity), indent=1) + "\n")
        temporary.replace(path)
    except OSError as error:
        print(f"warm-up: the warm-up's marker could not be written ({error}): the next start compiles in workers "
              "again", file=sys.stderr, flush=True)


# ---- how many workers ---------------------------------------------------------------------------------------------
def requested_workers(environment=None) -> int:
    """QWEN_TRITON_COMPILE_WORKERS (a count, 0: none), else min(8, half the CPUs)."""
    environment = os.environ if environment is None else environment
    chosen = environment.get(WORKERS_VARIABLE, "").strip()
    if not chosen:
        return min(MOST_WORKERS, (os.cpu_count() or 1) // 2)
    if not chosen.isdigit():
        raise ValueError(f"{WORKERS_VARIABLE} must be a count of processes (0: none), got {chosen!r}")
    return int(chosen)


def workers_that_fit(requested: int, free_bytes: int, worker_bytes: int) -> int:
    """At most `requested`, at most as many as fit `free_bytes` (nine tenths of it: the allocators round up) at
    `worker_bytes` each; fewer than 2: none (one worker would compile everything while this process waits: its
    start's cost, no gain)."""
    count = min(requested, int(0.9 * free_bytes) // max(worker_bytes, 1))
    return count if count >= 2 else 0


def worker_bytes(model) -> int:
    """A worker's GPU memory, estimated from what this process has allocated (the model's weights and caches): 1.5
    times that, for the warm-up's own buffers, logits and graphs, and a process's context. Anything else this
    process holds counts too: then fewer workers, never too many."""
    return int(1.5 * torch.cuda.memory_allocated(model.device)) + CONTEXT_BYTES


def worker_count(model) -> int:
    """How many compile workers a cold warm-up of `model` starts: none off a GPU or under the interpreter (nothing
    compiles there), else `requested_workers` limited by the GPU's free memory (`workers_that_fit`)."""
    if not compiles_to_disk(model):
        return 0
    requested = requested_workers()
    if requested < 2:
        return 0
    free_bytes, _ = torch.cuda.mem_get_info(model.device)
    return workers_that_fit(requested, free_bytes, worker_bytes(model))


# ---- the workers --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Task:
    """What a worker builds and runs: a model of this config, dtype, plan options, max_length and max_batch on this
    device, and its share (index, count) of the warm-up's items."""

    config: ModelConfig
    dtype: torch.dtype
    options: dict  # plan.Options' fields
    max_length: int
    max_batch: int
    device: str
    share: tuple[int, int]

    @classmethod
    def of(cls, model, share: tuple[int, int]) -> "Task":
        device = model.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return cls(model.config, model.dtype, dataclasses.asdict(model.plan.options), model.max_length,
                   model.max_batch, str(device), share)


def run_task(task: Task) -> warmup.WarmUp:
    """A worker's work: the autotuners' results kept off the disk, a model with random weights made on the device,
    its share of the warm-up."""
    from ..benchmark.models import random_weights
    from ..operators.common import autotuners
    from .triton_model import TritonModel

    for tuner in autotuners().values():  # a choice timed beside the other workers must not outlive this process
        tuner.cache_results = False
    device = torch.device(task.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    weights = random_weights(task.config, device, task.dtype)
    model = TritonModel(task.config, weights, max_batch=task.max_batch, max_length=task.max_length, device=device,
                        dtype=task.dtype, **task.options)
    del weights  # (packed into the model's own tensors)
    return warmup.warm_up(model, share=task.share)


@dataclass
class Worker:
    """One started worker: its process, its share and the file its output goes to."""

    process: subprocess.Popen
    share: tuple[int, int]
    log: Path
    seconds: float | None = None  # when it exited, since the start
    failure: str | None = None  # why it did not finish its share

    def describe(self) -> str:
        return f"compile worker {self.share[0] + 1} of {self.share[1]}"


def start_worker(task: Task, log: Path) -> Worker:
    """Start a worker process on `task`: the parent's environment (its Triton cache directory, its GPU, its picks),
    this package first on the path, no workers of its own; its output to `log`."""
    environment = dict(os.environ, **{WORKERS_VARIABLE: "0"})
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    with open(log, "wb") as output:
        process = subprocess.Popen(list(WORKER_COMMAND), stdin=subprocess.PIPE, stdout=output,
                                   stderr=subprocess.STDOUT, env=environment)
    try:
        process.stdin.write(pickle.dumps(task))
        process.stdin.close()
    except OSError:  # it exited before reading (its log says why)
        pass
    return Worker(process, task.share, log)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join("    " + line for line in text.rstrip().splitlines()[-lines:])


def wait_for(workers: list[Worker], timeout: float = WAIT_SECONDS, progress: bool = False) -> list[Worker]:
    """Wait until every worker exits or `timeout` seconds pass (those left are then stopped), a progress line on
    stderr with progress; each failure is reported on stderr whatever progress says. Returns the workers, each with
    its time or its failure."""
    started = time.perf_counter()
    report = progress_printer(f"warm-up: {len(workers)} compile workers") if progress else None
    running, done = list(workers), 0
    try:
        while running:
            for worker in list(running):
                code = worker.process.poll()
                if code is None:
                    continue
                running.remove(worker)
                worker.seconds = time.perf_counter() - started
                if code != 0:
                    worker.failure = f"exit code {code}"
                done += 1
                if report is not None:
                    report(done, len(workers))
            if running and time.perf_counter() - started > timeout:
                for worker in running:
                    worker.failure = f"still running after {timeout:g} s: stopped"
                break
            if running:
                time.sleep(0.1)
    finally:  # the time limit, or the caller interrupted: no worker outlives the wait
        for worker in running:
            worker.process.kill()
            worker.process.wait()
            if worker.failure is None:
                worker.failure = "stopped"
    for worker in workers:
        if worker.failure is not None:
            print(f"warm-up: {worker.describe()} failed ({worker.failure}); the warm-up compiles its part itself:\n"
                  f"{_tail(worker.log)}", file=sys.stderr, flush=True)
    return workers


def compile_in_workers(model, count: int, timeout: float = WAIT_SECONDS, progress: bool = False) -> list[Worker]:
    """Start `count` workers on the shares of `model`'s warm-up and wait for them (`wait_for`). Never raises for a
    worker: what fails is reported, and the caller's own warm-up compiles what it left."""
    started = time.perf_counter()
    workers: list[Worker] = []
    with tempfile.TemporaryDirectory(prefix="qwen-triton-compile-") as logs:
        try:
            for index in range(count):
                workers.append(start_worker(Task.of(model, (index, count)), Path(logs) / f"worker-{index}.log"))
        except OSError as error:
            print(f"warm-up: compile workers could not start ({error}); the warm-up compiles their part itself",
                  file=sys.stderr, flush=True)
        except BaseException:  # interrupted while starting them: none left behind
            for worker in workers:
                worker.process.kill()
                worker.process.wait()
            raise
        wait_for(workers, timeout, progress)
    if progress and workers:
        finished = [worker.seconds for worker in workers if worker.failure is None]
        each = f" (each {min(finished):.1f} to {max(finished):.1f} s)" if finished else ""
        print(f"warm-up: {len(finished)} of {count} compile workers done: {time.perf_counter() - started:.1f} s{each}",
              file=sys.stderr, flush=True)
    return workers


def compiles_to_disk(model) -> bool:
    """Whether `model`'s kernels compile into the Triton cache: on a GPU, not under the interpreter."""
    from ..operators.common import interpreting

    return model.device.type == "cuda" and not interpreting()


def warm_up(model, progress: bool = False) -> warmup.WarmUp:
    """`LLM(...)`'s warm-up: on a GPU whose Triton cache is cold for this model (no marker), compile workers first
    (`worker_count` of them), then the whole warm-up in this process (engine/warmup.py), then the marker. Its
    report counts the workers' time in its seconds."""
    identity = Identity.of(model) if compiles_to_disk(model) else None
    compiled = (0, 0.0)
    if identity is not None and not is_warm(identity):
        count = worker_count(model)
        if count:
            started = time.perf_counter()
            try:
                compile_in_workers(model, count, progress=progress)
            except Exception as error:  # noqa: BLE001 - the workers only save time: never a failed start for them
                print(f"warm-up: compile workers failed ({type(error).__name__}: {error}); the warm-up compiles "
                      "without them", file=sys.stderr, flush=True)
            compiled = (count, time.perf_counter() - started)
    report = warmup.warm_up(model, progress=progress, compiled=compiled)
    if identity is not None:
        mark_warm(identity)
    return report


def main() -> int:
    """A worker process: its Task pickled on stdin."""
    task = pickle.load(sys.stdin.buffer)
    report = run_task(task)
    print(f"{report.summary()} (into the Triton cache {cache_directory()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
