"""Config validation, presets and parameter accounting, checkpoints and the presets CLI."""

import json

import pytest
import torch
from click.testing import CliRunner
from colibri_model import (
    CheckpointFormatError,
    ColibriConfig,
    ColibriForCausalLM,
    count_params,
    get_preset,
    read_config,
)
from colibri_model.cli import main as cli_main
from pydantic import ValidationError


def test_nano_matches_nanocolibri_published_figures():
    counts = count_params(get_preset("nano"))
    assert abs(counts["active_params_train"] - 341e6) / 341e6 < 0.01
    assert 2.55e9 <= counts["total_params"] <= 2.75e9
    assert counts["active_params_infer"] < counts["active_params_train"]


@pytest.mark.parametrize(
    "name, total, active",
    [("micro", (6.5e9, 7.5e9), (0.9e9, 1.1e9)), ("grande", (24e9, 28e9), (2.2e9, 2.6e9))],
)
def test_larger_presets_hit_their_targets(name, total, active):
    counts = count_params(get_preset(name))
    assert total[0] <= counts["total_params"] <= total[1]
    assert active[0] <= counts["active_params_train"] <= active[1]


def test_count_params_agrees_with_an_allocated_model():
    config = get_preset("tiny", vocab_size=1000)
    model = ColibriForCausalLM(config)
    assert count_params(config)["total_params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(n_heads=4, n_kv_heads=3), "n_heads"),
        (dict(top_k_train=9), "top_k_train"),
        (dict(top_k_infer=9), "top_k_infer"),
        (dict(n_dense_layers=7), "n_dense_layers"),
        (dict(head_dim=33), "head_dim"),
        (dict(d_model=0), "d_model"),
        (dict(schema_version="2.0"), "schema_version"),
        (dict(router_score="relu"), "router_score"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValidationError) as err:
        get_preset("tiny", **change)
    assert field in str(err.value)


def test_config_json_round_trip_and_unknown_field():
    config = get_preset("nano")
    assert ColibriConfig.from_json(config.to_json()) == config
    with pytest.raises(ValidationError, match="d_modle"):
        ColibriConfig.model_validate({**config.model_dump(), "d_modle": 3})


def test_checkpoint_round_trip_is_exact(tmp_path):
    torch.manual_seed(0)
    config = get_preset("tiny", vocab_size=300)
    model = ColibriForCausalLM(config)
    model.moe_layers()[0].router.expert_bias += 0.25
    model.save_pretrained(tmp_path, tokenizer_json='{"fake": true}')
    loaded = ColibriForCausalLM.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert (tmp_path / "tokenizer.json").exists()
    assert json.loads((tmp_path / "config.json").read_text())["format_version"] == "1.0"
    tokens = torch.randint(0, 300, (1, 8))
    assert torch.equal(model.eval()(tokens).logits, loaded.eval()(tokens).logits)


def test_checkpoint_with_unknown_major_version_is_refused(tmp_path):
    ColibriForCausalLM(get_preset("tiny", vocab_size=300)).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["format_version"] = "2.0"
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match=r"format_version 2\.0.*reads 1\.0"):
        read_config(tmp_path)


def test_corrupt_checkpoints_give_clear_errors(tmp_path):
    ColibriForCausalLM(get_preset("tiny", vocab_size=300)).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:100])
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):
        ColibriForCausalLM.from_pretrained(tmp_path)
    weights.write_bytes(original)
    data = json.loads((tmp_path / "config.json").read_text())
    data["n_layers"] = 5  # tensors for layer 4 are missing
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointFormatError, match="missing"):
        ColibriForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="not valid JSON"):
        read_config(tmp_path)
    assert weights.read_bytes() == original  # nothing was lost


def test_presets_cli_json():
    result = CliRunner().invoke(cli_main, ["presets", "--json"])
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert set(rows) >= {"tiny", "nano", "micro", "grande"}
    assert set(rows["nano"]) >= {"name", "total_params", "active_params_train", "active_params_infer"}
