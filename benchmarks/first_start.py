"""Issue 34's start-up targets: `LLM(...)` ready (loaded and warmed up) on an empty Triton cache, then again on the
cache that first start left, each in a fresh process, with the configs the autotuner timed counted.

    python benchmarks/first_start.py --cache /tmp/tc-first-start --out first-start.json [--max-batch 128
        --max-length 2304]

The cache directory is emptied first. Each start runs `random_llm` (the 0.8B's shape, random weights made on the
GPU) with TRITON_PRINT_AUTOTUNING=1: "timed" counts the configs the autotuner ran (a key taken from the recorded
picks, tuning/picks.py, times none), "tuned_keys" the keys it chose for, whether by timing or from a pick;
"compile_workers" counts the compile workers the start ran before its warm-up (engine/compile_workers.py: on a cold
cache only; QWEN_TRITON_COMPILE_WORKERS=0 runs none), "compile_workers_s" their time, part of "ready_s".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

START = """
import time, torch
started = time.perf_counter()
from qwen_triton.benchmark.models import random_llm
llm = random_llm("0.8b", max_batch={max_batch}, max_length={max_length}, progress=False)
torch.cuda.synchronize()
report = llm.warm_up_report
print("READY", time.perf_counter() - started, report.compile_workers, report.compile_seconds, flush=True)
"""


def start(cache: Path, max_batch: int, max_length: int, picks: str | None) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), TRITON_PRINT_AUTOTUNING="1", QWEN_TRITON_WARM_UP="1")
    if picks is not None:
        env["QWEN_TRITON_PICKS"] = picks
    result = subprocess.run([sys.executable, "-c", START.format(max_batch=max_batch, max_length=max_length)],
                            env=env, capture_output=True, text=True, timeout=900)
    ready = [line for line in result.stdout.splitlines() if line.startswith("READY")]
    fields = ready[0].split() if ready else None
    ready_s, workers, workers_s = (float(fields[1]), int(fields[2]), float(fields[3])) if ready else (None,) * 3
    return dict(returncode=result.returncode, ready_s=ready_s, compile_workers=workers, compile_workers_s=workers_s,
                timed=result.stdout.count("Autotuning kernel "),
                tuned_keys=result.stdout.count("Triton autotuning for function "),
                workers_said=[line for line in result.stderr.splitlines() if "compile worker" in line][:8],
                error=None if result.returncode == 0 else result.stderr[-3000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the Triton cache directory (emptied first)")
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=2304)
    parser.add_argument("--picks", help="QWEN_TRITON_PICKS for both starts (default: this GPU's shipped file)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shutil.rmtree(args.cache, ignore_errors=True)
    import torch

    report = dict(gpu=torch.cuda.get_device_name(), max_batch=args.max_batch, max_length=args.max_length,
                  picks=args.picks or "shipped")
    report["first"] = start(args.cache, args.max_batch, args.max_length, args.picks)
    print(f"first start (empty cache): {report['first']}", flush=True)
    report["later"] = start(args.cache, args.max_batch, args.max_length, args.picks)
    print(f"later start: {report['later']}", flush=True)
    args.out.write_text(json.dumps(report, indent=2))
    return 0 if report["first"]["returncode"] == report["later"]["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
