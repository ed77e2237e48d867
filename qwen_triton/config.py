"""The Qwen3.5 text-model configuration, read from a Hugging Face `config.json`.

Two layouts are accepted:
- `Qwen3_5ForConditionalGeneration` (model_type `qwen3_5`): the layout of the official Qwen/Qwen3.5-* repos,
  with the text model under `text_config` (and a vision tower this engine does not run);
- `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`): the text model's fields at the top level.

Every field that changes the math is read; anything this engine cannot run is refused with a
`ConfigError` that names it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"


class ConfigError(ValueError):
    """A config.json this engine cannot read or cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attn_output_gate: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None
    mrope_interleaved: bool
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # the rest
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    # where the text model's tensors live in the checkpoint ("model.language_model." or "model.")
    weight_prefix: str = "model."
    model_type: str = "qwen3_5_text"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head are rotated (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of the Gated DeltaNet side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


def _get(section: dict, name: str, where: str, default=None, required: bool = True):
    if name in section:
        return section[name]
    if default is not None or not required:
        return default
    raise ConfigError(f"config.json ({where}) is missing the field '{name}'")


def parse_config(raw: dict, source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the parsed JSON of a Hugging Face config."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type == "qwen3_5":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: model_type 'qwen3_5' needs a 'text_config' object")
        text_type = text.get("model_type", "qwen3_5_text")
        if text_type != "qwen3_5_text":
            raise ConfigError(
                f"{source}: unsupported text_config.model_type '{text_type}' (this engine runs 'qwen3_5_text')"
            )
        where = f"{source}: text_config"
        prefix = "model.language_model."
        # the official repos put tie_word_embeddings at the top level and in text_config
        tie_default = raw.get("tie_word_embeddings", False)
    elif model_type == "qwen3_5_text":
        text = raw
        where = source
        prefix = "model."
        tie_default = False
    elif model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        raise ConfigError(
            f"{source}: model_type '{model_type}' (the Qwen3.5 mixture-of-experts variant) is not supported; "
            "this engine runs the dense Qwen3.5 models (model_type 'qwen3_5' or 'qwen3_5_text')"
        )
    elif model_type is None:
        raise ConfigError(f"{source}: no 'model_type' field; expected 'qwen3_5' or 'qwen3_5_text'")
    else:
        raise ConfigError(
            f"{source}: unsupported model_type '{model_type}'; this engine runs 'qwen3_5' and 'qwen3_5_text'"
        )

    def get(name, default=None, required=True):
        return _get(text, name, where, default, required)

    num_layers = int(get("num_hidden_layers"))
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        if interval < 1:
            raise ConfigError(f"{where}: full_attention_interval must be >= 1, got {interval}")
        layer_types = [
            LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(num_layers)
        ]
    layer_types = tuple(layer_types)
    if len(layer_types) != num_layers:
        raise ConfigError(
            f"{where}: layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    for t in layer_types:
        if t not in (LINEAR_ATTENTION, FULL_ATTENTION):
            raise ConfigError(f"{where}: unsupported layer type '{t}' in layer_types")

    # rope: transformers 5 writes rope_parameters; older configs have rope_theta / partial_rotary_factor flat
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"{where}: unsupported rope_type '{rope_type}' (only 'default' is supported)")
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    head_dim = int(get("head_dim", None, required=False) or get("hidden_size") // get("num_attention_heads"))
    rotary_dim = int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(
            f"{where}: partial_rotary_factor {partial} gives a rotary dimension of {rotary_dim} for head_dim "
            f"{head_dim}; it must be even and in (0, head_dim]"
        )
    mrope_section = rope.get("mrope_section")
    if mrope_section is not None:
        mrope_section = tuple(int(s) for s in mrope_section)
        if sum(mrope_section) != rotary_dim // 2:
            raise ConfigError(
                f"{where}: mrope_section {list(mrope_section)} sums to {sum(mrope_section)}, "
                f"but the rotary dimension {rotary_dim} has {rotary_dim // 2} frequencies"
            )

    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: unsupported hidden_act '{text.get('hidden_act')}' (only 'silu')")
    if text.get("attention_bias", False):
        raise ConfigError(f"{where}: attention_bias=true is not supported (Qwen3.5 has no attention biases)")
    ssm_dtype = text.get("mamba_ssm_dtype", "float32")
    if ssm_dtype not in ("float32", None):
        raise ConfigError(f"{where}: unsupported mamba_ssm_dtype '{ssm_dtype}' (the recurrent state is float32)")

    eos = text.get("eos_token_id", raw.get("eos_token_id"))
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())

    cfg = ModelConfig(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=int(get("num_attention_heads")),
        num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=head_dim,
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        mrope_section=mrope_section,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        linear_num_key_heads=int(get("linear_num_key_heads")),
        linear_num_value_heads=int(get("linear_num_value_heads")),
        linear_key_head_dim=int(get("linear_key_head_dim")),
        linear_value_head_dim=int(get("linear_value_head_dim")),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(text.get("tie_word_embeddings", tie_default)),
        max_position_embeddings=int(get("max_position_embeddings", 32768)),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        weight_prefix=prefix,
        model_type=model_type,
        extra={"raw": raw},
    )
    _validate(cfg, where)
    return cfg


def _validate(cfg: ModelConfig, where: str) -> None:
    positive = [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
    ]
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{where}: {name} must be positive, got {getattr(cfg, name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(
            f"{where}: num_attention_heads ({cfg.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({cfg.num_key_value_heads})"
        )
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError(
            f"{where}: linear_num_value_heads ({cfg.linear_num_value_heads}) must be a multiple of "
            f"linear_num_key_heads ({cfg.linear_num_key_heads})"
        )
    if not math.isfinite(cfg.rope_theta) or cfg.rope_theta <= 0:
        raise ConfigError(f"{where}: rope_theta must be positive, got {cfg.rope_theta}")


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise ConfigError(f"no config.json found at {file}")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not valid JSON: {error}") from None
    return parse_config(raw, source=str(file))
