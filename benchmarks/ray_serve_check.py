"""Issue 36's GPU run: replicas under Ray Serve against the single-process server, on one machine.

Two phases, each its own process and server (each fits one device call of 10 minutes):
  --phase single  `SERVER` (a `qwen-triton serve` command line, default below) on --port: greedy completions of
                  PROBES prompts (their text kept), then `BENCH --url` (the load generator, `qwen-triton bench
                  --serve`) at --concurrency; SIGTERM. Writes single.json.
  --phase ray     the same command with `--replicas 2 --gpus-per-replica 0.5` (--ray-args): the same prompts,
                  sent until two replicas have answered (the x-qwen-triton-replica header) or each was sent four
                  times; the same load; SIGTERM. Writes ray.json.
With --mps the server's processes run under an MPS control daemon of their own (the replicas' kernels side by
side on the one GPU instead of time-sliced, D147), the daemon quit when the phase ends.
The second phase run also writes compare.json (the first's JSON from --keep, or --single): greedy outputs equal,
the replicas that answered, output tokens/s through Ray over the single server's (issue 36: within 15%), and the
latencies of both.
A phase's JSON goes to --out (default $OUT) and to --keep (default /tmp/ray_serve_check), where the next call on
the same warm machine finds it.

On the GPU machine, whose image lacks the server's packages and Ray: `python3 benchmarks/device_wheels.py` here
puts them in `.whl` (60 MB: Ray's wheel without its Java jars), and one call carries them, e.g. with Ray's HAProxy
in front of one replica (D175):
  carry [".whl"]:
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site
      .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
      && python3 benchmarks/ray_serve_check.py --phase single --concurrency 64
      && python3 benchmarks/ray_serve_check.py --phase ray --ray-args "--replicas 1 --proxy haproxy" --concurrency 64
      ; cp /tmp/ray_serve_check/*/server.log files under $OUT to read a start that failed
(the phases in either order: the second writes compare.json where it finds the first's JSON in --keep; the single
phase first, because its cold start fills the Triton cache that the replica's start then loads from: on a fresh
H100 the Ray phase run first did not serve within 200 s, and the single server after it started in 65 s).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVER = f"{sys.executable} -m qwen_triton.cli serve --max-num-seqs 128 --max-length 2304 --served-model-name qwen"
# the variants' bench runs first (the load's floors need its copy and matmul rates): one variant, one size each
BENCH = (f"{sys.executable} -m qwen_triton.cli bench --serve --variants triton+split_k+cuda_graph --quick "
         "--prefill 128 --contexts 128")
RAY_ARGS = "--replicas 2 --gpus-per-replica 0.5"
PROBES = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "A haiku about the sea:",
          "Translate to German: good morning", "The three laws of motion are", "In 1969, the first", "SELECT * FROM",
          "Dear diary, today", "The quick brown fox", "Photosynthesis converts", "Q: What is 17 * 23?\nA:",
          "import numpy as np\n", "The best way to learn a language is", "Rain fell on the", "Chapter 1\n\n"]
PROBE_TOKENS = 64
REPLICA_HEADER = "x-qwen-triton-replica"


def log(message: str) -> None:
    print(f"ray_serve_check: {message}", file=sys.stderr, flush=True)


class Server:
    """A serve command in a process of its own, its log in `log_path`; `url` once it serves."""

    def __init__(self, command: list[str], log_path: Path, timeout: float, env: dict | None = None):
        self.log_path = log_path
        started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log_path.open("w"),
                                        stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        while not (found := re.search(r"serving \S+ at (http://[^/\s]+)/v1", log_path.read_text())):
            if self.process.poll() is not None or time.monotonic() - started > timeout:
                self.kill()
                raise RuntimeError(f"the server did not start: {' '.join(command)}\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        self.url, self.startup_s = found.group(1), time.monotonic() - started

    def stop(self, timeout: float = 120) -> int | None:
        """SIGTERM, then its exit status (None: it had to be killed)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class MultiProcessService:
    """NVIDIA's MPS control daemon for the server's processes alone: its pipe and log folders under `folder`,
    named to the server through CUDA_MPS_PIPE_DIRECTORY / CUDA_MPS_LOG_DIRECTORY (`env`), so that the replicas'
    CUDA contexts share the GPU's SMs at once instead of taking turns (D147's time-slicing). No GPU setting
    changes; `stop()` quits the daemon."""

    def __init__(self, folder: Path):
        self.env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(folder / "pipe"),
                        CUDA_MPS_LOG_DIRECTORY=str(folder / "log"))
        for name in ("pipe", "log"):
            (folder / name).mkdir(parents=True, exist_ok=True)
        subprocess.run(["nvidia-cuda-mps-control", "-d"], env=self.env, check=True, timeout=30)
        log(f"MPS control daemon started (pipes in {folder / 'pipe'})")

    def stop(self) -> None:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, env=self.env, timeout=60)


def complete(url: str, prompt: str) -> tuple[str, str | None]:
    """A greedy completion's text and the replica that answered (None from the single server)."""
    body = json.dumps({"model": "qwen", "prompt": prompt, "max_tokens": PROBE_TOKENS, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["text"], response.headers.get(REPLICA_HEADER)


def run_bench(bench: str, url: str, concurrency: str, directory: Path) -> dict:
    """The load generator against url: its report's `serve` section, or the error that stopped it."""
    command = [*shlex.split(bench), "--url", url, "--concurrency", concurrency, "--out", str(directory)]
    log(f"load: {' '.join(command)}")
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=540)
    (directory / "bench.log").write_text(result.stdout + result.stderr)
    report = directory / "latest.json"
    if result.returncode != 0 or not report.exists():
        return {"error": f"exit {result.returncode}: {(result.stderr or result.stdout)[-2000:]}"}
    return json.loads(report.read_text()).get("serve", {"error": "the report has no `serve` section"})


def level(serve: dict, concurrency: int) -> dict | None:
    for entry in serve.get("levels", []):
        if entry.get("concurrency") == concurrency:
            return entry
    return None


def tokens_per_s(entry: dict | None) -> float | None:
    return entry.get("output_tokens_per_s") if entry else None


def run_phase(args) -> dict:
    directory = args.keep / args.phase
    directory.mkdir(parents=True, exist_ok=True)
    command = shlex.split(args.server) + ["--port", str(args.port)]
    if args.model:
        command += ["--model", args.model]
    if args.phase == "ray":
        command += shlex.split(args.ray_args)
    log(f"server: {' '.join(command)}")
    service = MultiProcessService(args.keep / "mps") if args.mps else None
    try:
        server = Server(command, directory / "server.log", timeout=args.start_timeout,
                        env=service.env if service else None)
    except BaseException:
        if service:
            service.stop()
        raise
    result: dict = {"phase": args.phase, "command": command, "startup_s": round(server.startup_s, 1),
                    "mps": bool(args.mps)}
    try:
        texts, replicas = {}, {}
        probes = PROBES * (4 if args.phase == "ray" else 1)  # until both replicas have answered
        for index, prompt in enumerate(probes):
            text, replica = complete(server.url, prompt)
            if texts.setdefault(prompt, text) != text:
                raise RuntimeError(f"the same greedy prompt gave two texts: {prompt!r}")
            if replica is not None:
                replicas.setdefault(replica, []).append(prompt)
            if index + 1 >= len(PROBES) and (args.phase == "single" or len(replicas) >= 2):
                break
        result["greedy"] = texts
        result["replicas"] = {name: len(prompts) for name, prompts in replicas.items()}
        result["serve"] = run_bench(args.bench, server.url, args.concurrency, directory)
    finally:
        result["exit_status"] = server.stop()
        if service:
            service.stop()
    return result


def compare(single: dict, ray: dict, concurrency: int) -> dict:
    mismatches = [prompt for prompt, text in single["greedy"].items() if ray["greedy"].get(prompt) != text]
    single_level, ray_level = level(single["serve"], concurrency), level(ray["serve"], concurrency)
    single_rate, ray_rate = tokens_per_s(single_level), tokens_per_s(ray_level)
    ratio = ray_rate / single_rate if single_rate and ray_rate else None
    return {
        "greedy_equal": not mismatches, "greedy_mismatches": mismatches,
        "replicas_that_answered": len(ray["replicas"]),
        "concurrency": concurrency,
        "single_tokens_per_s": single_rate, "ray_tokens_per_s": ray_rate,
        "ray_over_single": ratio, "within_15_percent": ratio is not None and ratio >= 0.85,
        "single_level": single_level, "ray_level": ray_level,
        "exit_status": {"single": single["exit_status"], "ray": ray["exit_status"]},
        "startup_s": {"single": single["startup_s"], "ray": ray["startup_s"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase", choices=["single", "ray"], required=True)
    parser.add_argument("--model", help="--model of the serve command (default: its random-weight 0.8B)")
    parser.add_argument("--server", default=SERVER, help=f"the serve command line (default: {SERVER})")
    parser.add_argument("--ray-args", default=RAY_ARGS, help=f"added to it for Ray (default: {RAY_ARGS})")
    parser.add_argument("--bench", default=BENCH, help=f"the load generator (default: {BENCH})")
    parser.add_argument("--concurrency", default="64", help="the load's levels, N,N,... (issue 35: 1,8,64,128)")
    parser.add_argument("--compare-at", type=int, default=64, help="the level the two phases are compared at")
    parser.add_argument("--mps", action="store_true", help="the server's processes under an MPS control daemon of "
                        "their own (replicas sharing a GPU run their kernels side by side)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--start-timeout", type=float, default=420, help="seconds for the server to serve")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/ray_serve_check/out")))
    parser.add_argument("--keep", type=Path, default=Path("/tmp/ray_serve_check"))
    parser.add_argument("--single", type=Path, help="with --phase ray: the single phase's JSON (default: "
                        "--keep/single.json)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = run_phase(args)
    for folder in (args.keep, args.out):
        (folder / f"{args.phase}.json").write_text(json.dumps(result, indent=2))
    log(f"wrote {args.out / (args.phase + '.json')}")
    other = "single" if args.phase == "ray" else "ray"
    other_path = (args.single if args.phase == "ray" else None) or args.keep / f"{other}.json"
    if not other_path.exists():
        log(f"no {other_path}: run --phase {other} on this machine too, then the comparison follows")
        return
    if other_path.stat().st_mtime < time.time() - 6 * 3600:
        log(f"{other_path} is more than 6 hours old: not compared (run both phases in one session)")
        return
    phases = {args.phase: result, other: json.loads(other_path.read_text())}
    summary = compare(phases["single"], phases["ray"], args.compare_at)
    (args.out / "compare.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({key: value for key, value in summary.items() if not key.endswith("_level")}, indent=2))


if __name__ == "__main__":
    main()
