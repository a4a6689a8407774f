"""The model config: validation names the field, presets and parameter counts, the lowest-schema
rule that keeps old configs byte-identical."""

from __future__ import annotations

import hashlib

import pytest
from colibri_spec import PRESETS, ColibriConfig, ConfigError, RopeScaling, count_params, get_preset
from pydantic import ValidationError


def test_presets_validate_and_count_their_published_sizes():
    assert set(PRESETS) == {"tiny", "nano", "micro", "grande"}
    nano = count_params(get_preset("nano"))
    assert (nano["total_params"], nano["active_params_train"]) == (2_634_534_912, 341_299_200)


def test_preset_json_is_what_schema_1_0_wrote():
    # sha256 of nano's JSON as colibri-model wrote it at schema 1.0
    digest = hashlib.sha256(get_preset("nano").to_json().encode()).hexdigest()
    assert digest == "6955460c4ab19043d9ee4ed3ed5934f24f92d7b961dbdeff0cdbe9668aefd9b0"
    assert get_preset("tiny").to_dict()["schema_version"] == "1.0"


def test_a_variant_is_written_at_the_lowest_schema_that_describes_it_and_round_trips():
    config = get_preset("tiny", router_score="softmax", selection_bias=False)
    assert config.to_dict()["schema_version"] == "1.1"
    assert "attention_kind" not in config.to_dict()
    yarn = get_preset("tiny", rope_scaling=RopeScaling(kind="yarn", factor=4, original_max_seq_len=64, beta_fast=32,
                                                       beta_slow=1, truncate=True))
    assert yarn.to_dict()["schema_version"] == "1.2"
    for c in (config, yarn):
        assert ColibriConfig.from_json(c.to_json()) == c


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'huge'; choose one of tiny, nano, micro, grande"):
        get_preset("huge")


@pytest.mark.parametrize(("change", "message"), [
    (dict(n_kv_heads=3), "n_heads: 4 query heads are not divisible by n_kv_heads=3"),
    (dict(top_k_infer=9), "top_k_infer: top_k=9 exceeds n_experts=8"),
    (dict(schema_version="2.0"), r"schema_version: config schema 2.0 is not supported \(this colibri-spec reads 1.2\)"),
    (dict(typo_field=1), "typo_field"),
])
def test_an_invalid_config_names_the_field(change, message):
    with pytest.raises(ValidationError, match=message):
        get_preset("tiny", **change)


def test_kv_cache_shapes_of_latent_attention():
    mla = get_preset("tiny", attention_kind="mla", qk_norm=False, n_kv_heads=4, head_dim=32, kv_lora_rank=64,
                     qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=32)
    assert (mla.kv_cache_heads, mla.key_head_dim, mla.value_head_dim) == (1, 72, 0)
    assert mla.kv_bytes_per_position(2) == 4 * 72 * 2
