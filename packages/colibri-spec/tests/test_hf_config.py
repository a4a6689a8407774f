"""The HF config mapping: every field mapped or refused by name and value, a validated config out."""

from __future__ import annotations

import pytest
from colibri_spec import ColibriConfig, HFConfigError, checkpoint_tensor_shapes
from colibri_spec.hf_config import FAMILIES, colibri_config_from_hf, hf_config_dict
from colibri_spec.hf_config.families import family_for

QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
             "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 128, "max_position_embeddings": 256,
             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "norm_topk_prob": True,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "_name_or_path": "x"}
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 96, "max_position_embeddings": 512,
         "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 128}}


def test_a_moe_config_maps_to_a_validated_colibri_config():
    config = colibri_config_from_hf(QWEN3_MOE, "q/config.json")
    assert isinstance(config, ColibriConfig)
    assert (config.n_experts, config.expert_dim, config.top_k_infer, config.router_score, config.selection_bias) == (
        4, 32, 2, "softmax", False)
    data = hf_config_dict(QWEN3_MOE, "q/config.json", name="qwen3:tiny")
    assert data["format_version"] == "1.0" and data["model_type"] == "colibri" and data["name"] == "qwen3:tiny"
    assert data["schema_version"] == "1.1"
    assert "layers.1.moe.experts.gate_proj" in checkpoint_tensor_shapes(config)


def test_a_dense_config_with_llama3_rope():
    config = colibri_config_from_hf(LLAMA)
    assert (config.n_dense_layers, config.n_experts, config.tie_embeddings, config.head_dim) == (2, 0, True, 16)
    assert config.rope_scaling.kind == "llama3" and config.rope_scaling.original_max_seq_len == 128


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, r"q/config.json: model_type='gpt2' is not supported; supported: deepseek_v2"),
    ({"model_type": "qwen3_next"}, "Gated DeltaNet linear-attention layers are not implemented"),
    ({"hidden_act": "gelu"}, r"q/config.json: hidden_act='gelu' is not supported \(supported: 'silu'\)"),
    ({"some_new_knob": 1}, "some_new_knob=1 is not supported"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic' is not supported"),
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 is not in \[1, 4\]"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}},
     "quantization_config.fmt='e5m2' is not supported"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method='gptq' is not supported"),
    ({"num_attention_heads": 3}, "q/config.json: invalid config: .*n_heads"),
])
def test_a_field_colibri_cannot_represent_is_refused_by_name_and_value(change, message):
    with pytest.raises(HFConfigError, match=message):
        hf_config_dict({**QWEN3_MOE, **change}, "q/config.json")


def test_a_missing_field_and_the_importers_own_error_class():
    class ImporterError(HFConfigError):
        pass

    data = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    with pytest.raises(ImporterError, match="q/config.json: required field 'num_experts' is missing"):
        hf_config_dict(data, "q/config.json", error=ImporterError)
    with pytest.raises(HFConfigError, match="expected a JSON object"):
        hf_config_dict([1], "q/config.json")


def test_every_family_is_reachable_by_its_model_types():
    assert sorted(FAMILIES) == ["deepseek_v2", "deepseek_v3", "gpt_oss", "llama", "mixtral", "olmoe", "qwen2_moe",
                                "qwen3_moe"]
    for model_type, module in FAMILIES.items():
        assert family_for(model_type, "x") is module and callable(module.map_config)
