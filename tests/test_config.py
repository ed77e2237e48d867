"""config.json in both layouts, every field that changes the math, and configs that must be refused."""

import json
import math
from pathlib import Path

import pytest

from qwen_triton.checkpoint import PRESETS, official_config
from qwen_triton.config import ConfigError, load_config, parse_config

REAL_CONFIG = Path(__file__).resolve().parents[2] / "shared" / "models" / "qwen3.5-0.8b" / "config.json"


def test_official_layout_of_the_real_model():
    raw = json.loads(REAL_CONFIG.read_text()) if REAL_CONFIG.exists() else official_config(PRESETS["0.8b"])
    config = parse_config(raw)
    assert config.weight_prefix == "model.language_model."
    assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (1024, 3584, 248320)
    assert config.layer_types == tuple((["linear_attention"] * 3 + ["full_attention"]) * 6)
    assert config.rotary_dim == 64 and config.rope_theta == 1e7
    assert config.mrope_section == (11, 11, 10) and config.mrope_interleaved
    assert config.tie_word_embeddings and config.attn_output_gate
    assert config.eos_token_ids == (248044,)
    assert config.linear_conv_dim == 6144 and config.linear_value_dim == 2048


def test_preset_is_exactly_the_shared_config():
    if not REAL_CONFIG.exists():
        pytest.skip("the shared model folder is not beside this checkout")
    real = json.loads(REAL_CONFIG.read_text())["text_config"]
    ours = official_config(PRESETS["0.8b"])["text_config"]
    assert ours == real


FAMILY = REAL_CONFIG.parents[1] / "qwen3.5-family"


@pytest.mark.parametrize("preset, parameters", [("4b", 4.21e9), ("9b", 8.95e9), ("27b", 26.9e9)])
def test_family_presets_are_exactly_the_shared_text_configs(preset, parameters):
    # and hold the parameters the family's README counts (embedding and, where untied, the LM head included)
    from qwen_triton.weights import expected_shapes

    file = FAMILY / f"text_config-{preset}.json"
    if not file.exists():
        pytest.skip("the shared model folder is not beside this checkout")
    assert official_config(PRESETS[preset])["text_config"] == json.loads(file.read_text())
    config = parse_config(official_config(PRESETS[preset]))
    assert config.linear_num_value_heads % config.linear_num_key_heads == 0
    count = sum(math.prod(shape) for shape in expected_shapes(config).values())
    assert abs(count - parameters) <= 0.005 * parameters


def test_causal_layout_and_interval():
    text = dict(PRESETS["tiny"])
    text.pop("layer_types")
    text["full_attention_interval"] = 2
    text["tie_word_embeddings"] = False
    config = parse_config(official_config(text, "causal"))
    assert config.weight_prefix == "model."
    assert config.layer_types == ("linear_attention", "full_attention") * 2
    assert not config.tie_word_embeddings


def test_flat_rope_fields_and_list_of_eos_ids():
    text = dict(PRESETS["tiny"])
    text.pop("rope_parameters")
    text.update(rope_theta=5000.0, partial_rotary_factor=0.5, eos_token_id=[1, 2])
    config = parse_config(official_config(text, "causal"))
    assert config.rope_theta == 5000.0 and config.rotary_dim == 16
    assert config.eos_token_ids == (1, 2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "qwen3_5_moe"}, "qwen3_5_moe"),
        ({"model_type": "llama"}, "unsupported model_type 'llama'"),
        ({"model_type": None}, "no 'model_type'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"linear_num_value_heads": 3}, "linear_num_key_heads"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "sliding_attention"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_configs_that_cannot_run_name_the_fault(change, message):
    raw = official_config(PRESETS["tiny"], "causal")
    for key, value in change.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_config(raw)


def test_moe_in_official_layout_is_refused():
    raw = official_config(PRESETS["tiny"])
    raw["model_type"] = "qwen3_5_moe"
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        parse_config(raw)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(tmp_path)
