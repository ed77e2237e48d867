"""Random checkpoints in the official Qwen3.5 layout, for tests and benchmarks.

Real weights cannot be downloaded here, so the engine is tested and benchmarked on checkpoints made by
`qwen-triton make-checkpoint`: a `config.json`, safetensors weights and tokenizer files laid out like a
Hugging Face repo. The weights are random but scaled so that every sub-layer changes the output: a
projection of fan-in n has entries of standard deviation 1/sqrt(n) (unit-variance outputs), norm
weights vary around their neutral value, decays and gates land in their working ranges.
Speed does not depend on the values, so the `0.8b` preset benchmarks the real model, and `4b`, `9b`, `27b` the
rest of the dense family (the 27B's 54 GB is made on the device by benchmark/models.py's `random_llm`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import torch

from .config import parse_config
from .weights import expected_shapes

_LAYER_TYPES_24 = (["linear_attention"] * 3 + ["full_attention"]) * 6

PRESETS: dict[str, dict] = {
    # exactly the text shape of ../shared/models/qwen3.5-0.8b/config.json (the official Qwen/Qwen3.5-0.8B)
    "0.8b": {
        "vocab_size": 248320,
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "rms_norm_eps": 1e-06,
        "full_attention_interval": 4,
        "layer_types": _LAYER_TYPES_24,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "eos_token_id": 248044,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    },
    # the real vocabulary (so text round-trips), everything else small enough for a CPU
    "tiny": {
        "vocab_size": 248320,
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "attention_bias": False,
        "attn_output_gate": True,
        "hidden_act": "silu",
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "mamba_ssm_dtype": "float32",
        "rms_norm_eps": 1e-06,
        "full_attention_interval": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "max_position_embeddings": 262144,
        "tie_word_embeddings": True,
        "eos_token_id": 248044,
        "dtype": "bfloat16",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    },
}


def _family_size(*, hidden_size: int, intermediate_size: int, layers: int, attention_heads: int, value_heads: int,
                 tied: bool) -> dict:
    """A dense Qwen3.5 size's text config: the 0.8B's with the size's own shapes (4 KV heads)."""
    config = copy.deepcopy(PRESETS["0.8b"])
    config.update(hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=layers,
                  num_attention_heads=attention_heads, num_key_value_heads=4, linear_num_value_heads=value_heads,
                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
                  tie_word_embeddings=tied)
    return config


# the dense family beyond 0.8B: exactly the text shapes of ../shared/models/qwen3.5-family/text_config-*.json
# (whether the official 4B ties its LM head is unverified: both load)
PRESETS["4b"] = _family_size(hidden_size=2560, intermediate_size=9216, layers=32, attention_heads=16,
                             value_heads=32, tied=True)
PRESETS["9b"] = _family_size(hidden_size=4096, intermediate_size=12288, layers=32, attention_heads=16,
                             value_heads=32, tied=False)
PRESETS["27b"] = _family_size(hidden_size=5120, intermediate_size=17408, layers=64, attention_heads=24,
                              value_heads=48, tied=False)

# The official repos' top level around text_config (a vision tower this engine does not run).
_VISION_CONFIG = {
    "model_type": "qwen3_5_vision", "depth": 12, "hidden_size": 768, "num_heads": 12,
    "intermediate_size": 3072, "in_channels": 3, "patch_size": 16, "temporal_patch_size": 2,
    "spatial_merge_size": 2, "out_hidden_size": 1024, "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [],
}


def official_config(text_config: dict, layout: str = "conditional") -> dict:
    """The config.json of a checkpoint: `conditional` (official, text under text_config) or `causal` (flat)."""
    text = copy.deepcopy(text_config)
    if layout == "causal":
        return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", **text}
    if layout != "conditional":
        raise ValueError(f"unknown layout '{layout}' (expected 'conditional' or 'causal')")
    text["model_type"] = "qwen3_5_text"
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "text_config": text,
        "vision_config": dict(_VISION_CONFIG),
    }


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """One random tensor, scaled for its role (see the module docstring)."""
    device = generator.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * std

    if name.endswith("A_log"):  # decay rates exp(A_log) in [1, 16), as the model's own init draws them
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=generator).log()
    if name.endswith("dt_bias"):
        return 1.0 + normal(0.1)
    if name.endswith("linear_attn.norm.weight"):  # gated norm: plain weight, neutral at 1
        return 1.0 + normal(0.1)
    if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) or name == "norm.weight":
        return normal(0.1)  # zero-centred RMSNorm: neutral at 0
    if name.endswith("conv1d.weight"):
        return normal(shape[-1] ** -0.5)
    if name == "embed_tokens.weight":  # tied to the LM head: logits of standard deviation about hidden**0.25
        return normal(shape[1] ** -0.25)
    if name == "lm_head.weight":
        return normal(shape[1] ** -0.5)
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        # projections that write the residual stream: scaled down (as GPT-2's init does by depth) so that
        # the sum of many layers stays of the order of one layer, like a trained model's, rather than a
        # chaotic map whose bf16 rounding errors grow tenfold through the stack
        return normal(0.2 * shape[1] ** -0.5)
    if len(shape) == 2:  # projections [out, in]
        return normal(shape[1] ** -0.5)
    raise ValueError(f"no initialisation rule for tensor '{name}'")


def make_checkpoint(
    out: str | Path,
    text_config: dict,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    layout: str = "conditional",
    shards: int = 1,
    extra_tensors: bool = True,
    tokenizer: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a complete random checkpoint to `out` and return its path.

    layout: `conditional` (official: `model.language_model.*`, config with text_config) or `causal`
    (`model.*`, flat config). shards > 1 writes `model-0000i-of-0000n.safetensors` and an index.
    extra_tensors adds small vision-tower (`model.visual.*`) and MTP (`mtp.*`) tensors, as the official
    repos have, which the loader must skip.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config_json = official_config(text_config, layout)
    config = parse_config(config_json)
    prefix = "model.language_model." if layout == "conditional" else "model."
    generator = torch.Generator().manual_seed(seed)

    shapes = expected_shapes(config)
    names = list(shapes)
    tensors: dict[str, torch.Tensor] = {}
    for count, name in enumerate(names, 1):
        value = random_tensor(name, shapes[name], generator)
        stored_dtype = torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype
        key = name if name == "lm_head.weight" else prefix + name
        tensors[key] = value.to(stored_dtype).contiguous()
        if progress is not None:
            progress(count, len(names))
    if extra_tensors:
        tensors["model.visual.patch_embed.proj.weight"] = torch.randn(8, 3, 2, 2, 2, generator=generator).to(dtype)
        tensors["mtp.fc.weight"] = torch.randn(8, 16, generator=generator).to(dtype)

    keys = list(tensors)
    if shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per_shard = -(-len(keys) // shards)
        for index in range(shards):
            file = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[index * per_shard:(index + 1) * per_shard]}
            save_file(part, str(out / file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    if tokenizer:
        from .tokenizer import write_tokenizer_files

        write_tokenizer_files(out)
    return out


def make_preset_checkpoint(preset: str, out: str | Path, seed: int = 0, progress=None) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset '{preset}' (choose from {', '.join(PRESETS)})")
    return make_checkpoint(out, PRESETS[preset], seed=seed, progress=progress)
