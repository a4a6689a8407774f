"""The one tensor table: names and shapes from a config (colibri-model's tests hold it equal to
the torch modules; here, what CHECKPOINT.md's table says for a few configs)."""

from __future__ import annotations

import pytest
from colibri_spec import (
    PRESETS,
    ColibriConfig,
    ModelShape,
    checkpoint_tensor_shapes,
    expert_tensor_names,
    get_preset,
)
from pydantic import ValidationError


def test_tiny_table_follows_checkpoint_md():
    config = get_preset("tiny")  # d 128, 4 layers (1 dense), 4 heads / 1 KV head of 32, 8 experts of 64, tied
    table = checkpoint_tensor_shapes(config)
    assert list(table)[:3] == ["embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.q_proj.weight"]
    assert table["embed.weight"] == (49152, 128)
    assert table["layers.0.attn.k_proj.weight"] == (32, 128)
    assert table["layers.0.attn.q_norm.weight"] == (32,)
    assert table["layers.0.ffn.gate_proj.weight"] == (384, 128)
    assert table["layers.1.moe.router.expert_bias"] == (8,)
    assert table["layers.1.moe.experts.down_proj"] == (8, 128, 64)
    assert table["layers.3.moe.shared.up_proj.weight"] == (256, 128)
    assert "lm_head.weight" not in table and list(table)[-1] == "norm.weight"
    assert "layers.1.ffn.gate_proj.weight" not in table and "layers.0.moe.router.weight" not in table


def test_latent_attention_and_biased_experts():
    mla = checkpoint_tensor_shapes(get_preset(
        "tiny", attention_kind="mla", qk_norm=False, n_kv_heads=4, head_dim=32, kv_lora_rank=64, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=32, q_lora_rank=48))
    assert mla["layers.0.attn.q_b_proj.weight"] == (4 * 32, 48)
    assert mla["layers.0.attn.kv_a_proj_with_mqa.weight"] == (64 + 8, 128)
    assert mla["layers.0.attn.kv_b_proj.weight"] == (4 * (24 + 32), 64)
    assert "layers.0.attn.k_proj.weight" not in mla
    biased = checkpoint_tensor_shapes(get_preset("tiny", expert_proj_bias=True, expert_glu="clamped_swiglu",
                                                 router_score="softmax", selection_bias=False, router_bias=True))
    assert biased["layers.1.moe.experts.up_bias"] == (8, 64) and biased["layers.1.moe.router.bias"] == (8,)
    assert "layers.1.moe.router.expert_bias" not in biased


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_bounded_shape_fields_give_the_same_table(name):
    config = get_preset(name)
    assert checkpoint_tensor_shapes(ModelShape.model_validate(config.to_dict())) == checkpoint_tensor_shapes(config)


def test_model_shape_fields_are_config_fields():
    assert set(ModelShape.model_fields) <= set(ColibriConfig.model_fields)


def test_model_shape_bounds_refuse_a_hostile_size():
    with pytest.raises(ValidationError, match="d_model"):
        ModelShape.model_validate({**get_preset("tiny").model_dump(), "d_model": 1 << 30})


def test_expert_tensor_names():
    assert expert_tensor_names(3) == {"gate": "layers.3.moe.experts.gate_proj", "up": "layers.3.moe.experts.up_proj",
                                      "down": "layers.3.moe.experts.down_proj"}
    assert expert_tensor_names(3, bias=True)["down_bias"] == "layers.3.moe.experts.down_bias"
