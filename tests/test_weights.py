"""Loading safetensors in both layouts, sharded or not, and every bad checkpoint failing with a message
that names the tensor or the file."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from qwen_triton.config import load_config
from qwen_triton.weights import WeightError, expected_shapes, load_weights
from tests.support import small_config, write_checkpoint

PREFIX = "model.language_model."


@pytest.fixture
def checkpoint(tmp_path):
    return write_checkpoint(tmp_path / "model", small_config(), seed=3)


def _rewrite(directory, edit):
    file = directory / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


def test_every_tensor_loaded_and_extras_skipped(checkpoint):
    config = load_config(checkpoint)
    weights = load_weights(checkpoint, config, dtype=torch.float32)
    assert set(weights) == set(expected_shapes(config))
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in stored) and any(k.startswith("mtp.") for k in stored)
    for name, tensor in weights.items():
        assert torch.equal(tensor, stored[PREFIX + name]), name


def test_sharded_causal_layout_untied(tmp_path):
    directory = write_checkpoint(tmp_path, small_config(tie_word_embeddings=False), layout="causal", shards=3)
    assert (directory / "model.safetensors.index.json").exists()
    config = load_config(directory)
    weights = load_weights(directory, config, dtype=torch.bfloat16)
    assert "lm_head.weight" in weights and weights["lm_head.weight"].dtype == torch.bfloat16
    assert weights["layers.0.linear_attn.A_log"].dtype == torch.float32  # gating parameters stay fp32


@pytest.mark.parametrize("layout", ["conditional", "causal"])
def test_sharded_untied_family_shape_in_both_layouts(tmp_path, layout):
    # the 9B / 27B's features: an untied LM head and 3 DeltaNet value heads a key head, over 3 shards
    config_json = small_config(tie_word_embeddings=False, linear_num_key_heads=2, linear_num_value_heads=6)
    directory = write_checkpoint(tmp_path, config_json, layout=layout, shards=3, seed=4)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    stored = {}
    for file in sorted(set(index["weight_map"].values())):
        stored.update(load_file(str(directory / file)))
    config = load_config(directory)
    weights = load_weights(directory, config, dtype=torch.float32)
    assert set(weights) == set(expected_shapes(config)) and not config.tie_word_embeddings
    assert weights["layers.0.linear_attn.A_log"].shape == (6,)
    prefix = PREFIX if layout == "conditional" else "model."
    for name, tensor in weights.items():
        assert torch.equal(tensor, stored[name if name == "lm_head.weight" else prefix + name]), name


def test_missing_tensor_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.pop(PREFIX + "layers.2.mlp.down_proj.weight"))
    with pytest.raises(WeightError, match=r"layers\.2\.mlp\.down_proj\.weight.*missing"):
        load_weights(checkpoint, load_config(checkpoint))


def test_unexpected_text_tensor_is_named(checkpoint):
    _rewrite(checkpoint, lambda t: t.update({PREFIX + "layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(WeightError, match=r"unexpected tensor 'layers\.0\.mlp\.extra\.weight'"):
        load_weights(checkpoint, load_config(checkpoint))


def test_shape_mismatch_names_tensor_and_both_shapes(checkpoint):
    def edit(tensors):
        tensors[PREFIX + "layers.1.self_attn.k_proj.weight"] = torch.zeros(5, 48)
    _rewrite(checkpoint, edit)
    with pytest.raises(WeightError, match=r"layers\.1\.self_attn\.k_proj\.weight.*\[5, 48\].*\[48, 48\]"):
        load_weights(checkpoint, load_config(checkpoint))


def test_truncated_file_is_named(checkpoint):
    file = checkpoint / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightError, match="model.safetensors is truncated"):
        load_weights(checkpoint, load_config(checkpoint))
    file.write_bytes(b"\x01\x02")
    with pytest.raises(WeightError, match="model.safetensors"):
        load_weights(checkpoint, load_config(checkpoint))


def test_missing_shard_and_no_weights(tmp_path):
    directory = write_checkpoint(tmp_path / "sharded", small_config(), shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError, match="model-00002-of-00002.safetensors"):
        load_weights(directory, load_config(directory))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(WeightError, match="no safetensors"):
        load_weights(empty, load_config(directory))


def test_weights_are_not_near_zero(checkpoint):
    """Every sub-layer must change the output: zeroing any one projection changes the logits."""
    from qwen_triton.reference import ReferenceModel

    config = load_config(checkpoint)
    weights = load_weights(checkpoint, config, dtype=torch.float32)
    tokens = torch.arange(1, 12)
    base = ReferenceModel(config, weights, max_length=16).prefill(tokens)
    for name in ["layers.0.linear_attn.out_proj.weight", "layers.1.self_attn.o_proj.weight",
                 "layers.3.mlp.down_proj.weight", "layers.0.linear_attn.conv1d.weight"]:
        changed = dict(weights, **{name: torch.zeros_like(weights[name])})
        logits = ReferenceModel(config, changed, max_length=16).prefill(tokens)
        assert (logits - base).abs().max() > 1e-2 * base.abs().max(), name
