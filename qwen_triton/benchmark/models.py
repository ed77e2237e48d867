"""Random-weight models at a preset's shape, made straight on the device (no checkpoint files): what the
benchmarks and the GPU tests run, since speed does not depend on the weights' values."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from ..checkpoint import PRESETS, official_config, random_tensor
from ..config import parse_config
from ..weights import FLOAT32_TENSORS, expected_shapes


def random_weights(config, device, dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        target = torch.float32 if name.endswith(FLOAT32_TENSORS) else dtype
        weights[name] = random_tensor(name, shape, generator).to(device=device, dtype=target)
    return weights


def random_llm(preset: str = "0.8b", backend: str = "triton", device: str = "cuda", dtype=torch.bfloat16,
               seed: int = 0, max_length: int = 4096, **options):
    """An LLM whose weights are random at the preset's shape; its config.json lives in a temporary folder."""
    from ..engine.llm import LLM

    config_json = official_config(PRESETS[preset])
    folder = Path(tempfile.mkdtemp(prefix=f"qwen-triton-{preset}-"))
    (folder / "config.json").write_text(json.dumps(config_json))
    config = parse_config(config_json)
    return LLM(folder, backend=backend, device=device, dtype=dtype, max_length=max_length,
               weights=random_weights(config, device, dtype, seed), **options)
