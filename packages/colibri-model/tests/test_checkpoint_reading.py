"""The public readers of the checkpoint format other packages call: the config rule, the tensor
names and the dtype each tensor is held in (CHECKPOINT.md)."""

from __future__ import annotations

import json

import pytest
import torch
from colibri_model import (
    CheckpointFormatError,
    ColibriForCausalLM,
    checkpoint_config_dict,
    checkpoint_tensor_shapes,
    get_preset,
    held_dtype,
    load_checkpoint,
    parse_checkpoint_config,
    read_config,
)
from safetensors import safe_open


def test_config_dict_round_trips_through_the_public_reader():
    config = get_preset("tiny", vocab_size=300)
    data = checkpoint_config_dict(config)
    assert data["format_version"] == "1.0" and data["model_type"] == "colibri"
    assert parse_checkpoint_config(data, "here") == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("model_type"), r"here: no model_type field \(expected 'colibri'\)"),
        (lambda d: d.update(model_type="llama"), r"here: model_type 'llama' is not 'colibri'"),
        (lambda d: d.pop("format_version"), "here: no format_version field"),
        (lambda d: d.update(d_modle=3), "here: invalid config.*d_modle"),
    ],
)
def test_bad_config_objects_are_refused_naming_the_field(change, message):
    data = checkpoint_config_dict(get_preset("tiny"))
    change(data)
    with pytest.raises(CheckpointFormatError, match=message):
        parse_checkpoint_config(data, "here")


def test_a_config_json_that_is_not_an_object_is_refused():
    with pytest.raises(CheckpointFormatError, match="here: expected a JSON object, got list"):
        parse_checkpoint_config([1, 2], "here")


def test_missing_model_type_in_a_directory_names_the_file(tmp_path):
    ColibriForCausalLM(get_preset("tiny", vocab_size=300)).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"config\.json: no model_type field"):
        read_config(tmp_path)


@pytest.mark.parametrize("changes", [{}, {"qk_norm": False, "tie_embeddings": False, "shared_expert_dim": 0}])
def test_tensor_names_are_those_the_checkpoint_holds(tmp_path, changes):
    config = get_preset("tiny", vocab_size=300, **changes)
    ColibriForCausalLM(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert checkpoint_tensor_shapes(config) == stored


def test_held_dtype_keeps_1d_tensors_fp32():
    assert held_dtype((64,), torch.bfloat16) == torch.float32
    assert held_dtype((8, 64), torch.bfloat16) == torch.bfloat16
    assert held_dtype((4, 8, 64), torch.float32) == torch.float32


def test_bf16_load_holds_norms_and_bias_fp32_and_matrices_bf16(tmp_path):
    torch.manual_seed(0)
    model = ColibriForCausalLM(get_preset("tiny", vocab_size=300))
    with torch.no_grad():  # values bf16 cannot hold exactly
        model.norm.weight.add_(torch.randn(model.norm.weight.shape) * 1e-3)
    model.save_pretrained(tmp_path)
    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16).eval()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == held_dtype(tensor.shape, torch.bfloat16), name
    assert loaded.layers[0].attn_norm.weight.dtype == torch.float32
    assert loaded.moe_layers()[0].router.expert_bias.dtype == torch.float32
    assert loaded.embed.weight.dtype == torch.bfloat16
    # fp32 norms: no bits lost against the fp32 checkpoint
    assert torch.equal(loaded.norm.weight, model.norm.weight)
    logits = loaded(torch.randint(0, 300, (1, 6))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
