"""A picks file (qwen_triton/tuning/picks.py) from the output of a run with TRITON_PRINT_AUTOTUNING=1: every
"Triton autotuning for function F, with key as K, ..., best config selected: C" block, the last one per key.

    python benchmarks/picks_from_log.py bench.md --device "NVIDIA H100 80GB HBM3" --out picks.json

A pick whose config is not in its kernel's config space here is reported and left out.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from qwen_triton.operators.common import autotuners
from qwen_triton.tuning.picks import _settings, write

BLOCK = re.compile(r"Triton autotuning for function (\w+),\nwith key as (\(.*?\)),\nfinished after [\d.]+s,\n"
                   r"best config selected: (.*?);\n", re.S)
SETTINGS = ("num_warps", "num_ctas", "num_stages", "maxnreg")


def parse_config(text: str) -> dict:
    values = {name.strip(): ast.literal_eval(value.strip())
              for name, value in (part.split(":", 1) for part in text.split(", "))}
    return dict(config={k: v for k, v in values.items() if k not in SETTINGS},
                **{name: values.get(name) for name in SETTINGS})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--device", required=True, help="the GPU's name, as torch.cuda.get_device_name gives it")
    parser.add_argument("--note", default="", help="what run the log comes from")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tuners: dict = {}  # the kernel's name (its function's) -> its autotuners (several tuners can share a function)
    for name, tuner in autotuners().items():
        tuners.setdefault(tuner.base_fn.__name__, []).append((name, tuner))
    picks, dropped = {}, 0
    for function, key, config in BLOCK.findall(args.log.read_text()):
        settings = parse_config(config)
        # each tuner of that function whose config space holds the pick (one tuner's key meets one launch)
        holders = [name for name, tuner in tuners.get(function, ())
                   if any(_settings(candidate) == settings for candidate in tuner.configs)]
        if not holders:
            print(f"not in any config space of {function}: {config}", file=sys.stderr)
            dropped += 1
        for kernel in holders:
            picks[(kernel, key)] = dict(kernel=kernel, key=key, **settings)
    import triton

    document = dict(device=args.device, triton=triton.__version__, note=args.note,
                    picks=[picks[k] for k in sorted(picks)])
    write(args.out, document)
    print(f"{len(picks)} picks written to {args.out} ({dropped} left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
