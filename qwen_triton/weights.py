"""Loading a Qwen3.5 checkpoint's text-model tensors from safetensors.

A checkpoint is one `model.safetensors` or shards listed in `model.safetensors.index.json`. Tensor names
carry the layout's prefix (`model.language_model.` in the official repos, `model.` for a causal-LM
export); inside the engine they are used without it (`layers.0.mlp.up_proj.weight`). The vision tower
(`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are skipped. Anything else that is
missing, unexpected, of the wrong shape or unreadable stops the load with an error that names it.

Memory: each file is memory-mapped (safetensors' `safe_open`) and each tensor is copied straight to its
device and dtype, so the host never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .config import FULL_ATTENTION, ModelConfig

SKIPPED_PREFIXES = ("model.visual.", "mtp.", "visual.")


class WeightError(ValueError):
    """A checkpoint whose tensors do not match the model its config describes."""


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the text model, by its name without the layout prefix, with its shape."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i, layer_type in enumerate(c.layer_types):
        p = f"layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
        if layer_type == FULL_ATTENTION:
            a = p + "self_attn."
            q_rows = c.num_attention_heads * c.head_dim * (2 if c.attn_output_gate else 1)
            shapes[a + "q_proj.weight"] = (q_rows, c.hidden_size)
            shapes[a + "k_proj.weight"] = (c.num_key_value_heads * c.head_dim, c.hidden_size)
            shapes[a + "v_proj.weight"] = (c.num_key_value_heads * c.head_dim, c.hidden_size)
            shapes[a + "o_proj.weight"] = (c.hidden_size, c.num_attention_heads * c.head_dim)
            shapes[a + "q_norm.weight"] = (c.head_dim,)
            shapes[a + "k_norm.weight"] = (c.head_dim,)
        else:
            a = p + "linear_attn."
            shapes[a + "in_proj_qkv.weight"] = (c.linear_conv_dim, c.hidden_size)
            shapes[a + "in_proj_z.weight"] = (c.linear_value_dim, c.hidden_size)
            shapes[a + "in_proj_b.weight"] = (c.linear_num_value_heads, c.hidden_size)
            shapes[a + "in_proj_a.weight"] = (c.linear_num_value_heads, c.hidden_size)
            shapes[a + "conv1d.weight"] = (c.linear_conv_dim, 1, c.linear_conv_kernel_dim)
            shapes[a + "dt_bias"] = (c.linear_num_value_heads,)
            shapes[a + "A_log"] = (c.linear_num_value_heads,)
            shapes[a + "norm.weight"] = (c.linear_value_head_dim,)
            shapes[a + "out_proj.weight"] = (c.hidden_size, c.linear_value_dim)
    shapes["norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


# Tensors kept in float32 whatever the compute dtype: they feed the float32 gating math.
FLOAT32_TENSORS = ("A_log", "dt_bias")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, from its index when sharded."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise WeightError(f"{index} is not a valid safetensors index: {error}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.exists():
                raise WeightError(f"{index} lists the shard {file.name}, which is missing from {path}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if found:
        return found
    raise WeightError(f"no safetensors weights found in {path} (expected model.safetensors or an index)")


def _strip_prefix(name: str, prefix: str) -> str | None:
    """The engine's name for a checkpoint tensor, or None when the tensor is not the text model's."""
    if name.startswith(SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for candidate in (prefix, "model.language_model.", "model."):
        if name.startswith(candidate):
            return name[len(candidate):]
    return name


def _check_file_complete(file: Path) -> None:
    """Catch a truncated download before safetensors maps it: the header's offsets must fit the file."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise WeightError(f"{file} is truncated or not a safetensors file ({size} bytes)")
        header_size = int.from_bytes(head, "little")
        if header_size > size - 8:
            raise WeightError(f"{file} is truncated or not a safetensors file (header of {header_size} bytes)")
        try:
            header = json.loads(handle.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise WeightError(f"{file} is not a safetensors file (unreadable header)") from None
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if 8 + header_size + end > size:
        raise WeightError(
            f"{file} is truncated: its header describes {8 + header_size + end} bytes but the file has {size}"
        )


def iterate_checkpoint(
    path: str | Path, config: ModelConfig
) -> Iterator[tuple[str, Callable[[], torch.Tensor], tuple[int, ...], str]]:
    """Yield (engine name, loader, shape, file) for each text-model tensor, files memory-mapped."""
    from safetensors import safe_open

    for file in checkpoint_files(path):
        _check_file_complete(file)
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as error:  # safetensors raises its own error types
            raise WeightError(f"cannot read {file}: {error}") from None
        with handle:
            for key in handle.keys():
                name = _strip_prefix(key, config.weight_prefix)
                if name is None:
                    continue
                shape = tuple(handle.get_slice(key).get_shape())
                yield name, (lambda h=handle, k=key: h.get_tensor(k)), shape, str(file)


def load_weights(
    path: str | Path,
    config: ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every text-model tensor onto `device` in `dtype` (A_log and dt_bias stay float32).

    Raises WeightError naming the tensor (with both shapes) or the file for any mismatch.
    """
    expected = expected_shapes(config)
    weights: dict[str, torch.Tensor] = {}
    total = len(expected)
    for name, load, shape, file in iterate_checkpoint(path, config):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some exports store the tied head too; the embedding is the one used
        if name not in expected:
            raise WeightError(f"unexpected tensor '{name}' in {file}: not part of the model config.json describes")
        if shape != expected[name]:
            raise WeightError(
                f"tensor '{name}' in {file} has shape {list(shape)}, but the config needs {list(expected[name])}"
            )
        if name in weights:
            raise WeightError(f"tensor '{name}' appears twice in the checkpoint (again in {file})")
        target = torch.float32 if name.endswith(FLOAT32_TENSORS) else dtype
        weights[name] = load().to(device=device, dtype=target)
        if progress is not None:
            progress(len(weights), total)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise WeightError(f"tensor '{missing[0]}'{more} missing from the checkpoint at {os.fspath(path)}")
    return weights
