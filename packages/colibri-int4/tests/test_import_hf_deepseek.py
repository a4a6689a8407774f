"""import-hf's DeepSeek-V3 mapping without transformers: every config field mapped or refused by
name and value, DeepSeek's FP8 quantization_config taken (the weights: test_import_hf_fp8.py) and
other pre-quantized configs refused, the multi-token-prediction layers' tensors skipped, and the planner sizing the container the import writes. (Logits against
transformers' own DeepseekV3ForCausalLM: colibri-stream's test_hf_import.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from colibri_int4 import Container, HFImportError
from colibri_int4.header import model_shape
from colibri_int4.import_hf import colibri_config_from_hf, import_hf, planned_container, quant_scheme
from colibri_int4.import_hf.families import deepseek_v3
from colibri_int4.model_shape import checkpoint_tensor_shapes
from safetensors.numpy import save_file

CONFIG = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 8, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16,
    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    "rope_interleave": True, "attention_bias": False, "num_nextn_predict_layers": 1, "qk_head_dim": 24,
    "head_dim": 8, "transformers_version": "5.24.0",
}


# DeepSeek-V3's published quantization_config
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_the_fp8_release_config_maps_as_its_bf16_conversion_does():
    assert colibri_config_from_hf({**CONFIG, "quantization_config": FP8}) == colibri_config_from_hf(CONFIG)
    assert colibri_config_from_hf({**V2, "quantization_config": FP8}) == colibri_config_from_hf(V2)


def test_the_config_maps_to_mla_group_limited_sigmoid_routing():
    config = colibri_config_from_hf(CONFIG)
    assert config["schema_version"] == "1.2" and config["attention_kind"] == "mla" and config["q_lora_rank"] is None
    assert (config["head_dim"], config["n_kv_heads"], config["v_head_dim"]) == (24, 4, 16)
    assert (config["router_groups"], config["router_topk_groups"], config["router_group_score"]) == (4, 2, "top2_sum")
    assert config["router_score"] == "sigmoid" and config["selection_bias"] and config["route_scale"] == 2.5
    assert (config["n_dense_layers"], config["dense_ffn_dim"], config["shared_expert_dim"]) == (1, 96, 32)
    assert config["rope_scaling"]["kind"] == "yarn" and config["rope_scaling"]["original_max_seq_len"] == 32
    assert config["rope_interleave"] is True


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(quantization_config={**FP8, "fmt": "e5m2"}), "quantization_config.fmt='e5m2' is not supported"),
        (dict(quantization_config={**FP8, "activation_scheme": "static"}),
         "quantization_config.activation_scheme='static' is not supported"),
        (dict(quantization_config={"quant_method": "compressed-tensors"}),  # Kimi-K2-Thinking's int4
         "quantization_config.quant_method='compressed-tensors' is not supported"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported .*one key per head"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (dict(topk_method="greedy"), "topk_method='greedy' is not supported"),
        (dict(scoring_func="softmax"), "scoring_func='softmax' is not supported"),
        (dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
        (dict(qk_head_dim=32), "qk_head_dim=32 is not supported .*derives 24"),
        (dict(n_group=3), "n_group=3 is not supported .*8 routed experts do not split"),
        (dict(topk_group=1, num_experts_per_tok=3), "topk_group=1 is not supported .*num_experts_per_tok=3"),
        (dict(rope_parameters={**CONFIG["rope_parameters"], "attention_factor": 2.0}),
         "rope_parameters.attention_factor=2.0 is not supported"),
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         "rope_parameters.rope_type='dynamic' is not supported .*'yarn'"),
        (dict(first_k_dense_replace=3), "first_k_dense_replace=3 is not supported"),
        (dict(some_new_knob=1), "some_new_knob=1 is not supported .*does not know"),
    ],
)
def test_unsupported_fields_are_refused_by_name_and_value(change, message):
    with pytest.raises(HFImportError, match=message):
        colibri_config_from_hf({**CONFIG, **change}, "ds/config.json")


def test_original_release_fields_are_understood():
    original = {**CONFIG, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "ep_size": 1,
                "aux_loss_alpha": 0.001, "seq_aux": True, "auto_map": {"AutoConfig": "configuration_deepseek.X"}}
    assert colibri_config_from_hf(original) == colibri_config_from_hf(CONFIG)


def _write_checkpoint(directory, with_mtp: bool):
    """Tensors under the HF names of the config above (from the family's own name table), plus
    an MTP layer's tensors under model.layers.2 when asked."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    config = colibri_config_from_hf(CONFIG)
    rng = np.random.default_rng(0)
    tensors = {}
    for name, dims in checkpoint_tensor_shapes(model_shape(config)).items():
        if ".moe.experts." in name:
            layer, part = int(name.split(".")[1]), name.split(".")[-1].split("_")[0]
            for e in range(dims[0]):
                hf_names = dict(zip(("gate", "up", "down"), deepseek_v3.NAMES.expert(layer, e)))
                tensors[hf_names[part]] = rng.normal(0, 0.05, dims[1:]).astype(np.float32)
        else:
            tensors[deepseek_v3.NAMES.resident(name)] = rng.normal(0, 0.05, dims).astype(np.float32)
    if with_mtp:
        tensors["model.layers.2.eh_proj.weight"] = np.zeros((64, 128), np.float32)
        tensors["model.layers.2.self_attn.kv_b_proj.weight"] = np.zeros((128, 32), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(96)}
    (directory / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}}))
    return directory


def test_mtp_layers_are_skipped_and_the_plan_is_the_file(tmp_path):
    plain = _write_checkpoint(tmp_path / "plain", with_mtp=False)
    mtp = _write_checkpoint(tmp_path / "mtp", with_mtp=True)
    for directory in (plain, mtp):
        import_hf(directory, directory.with_suffix(".coli"), quant_scheme("int4", 32), name="m")
    assert plain.with_suffix(".coli").read_bytes() == mtp.with_suffix(".coli").read_bytes()
    with Container.open(plain.with_suffix(".coli")) as container:
        assert container.config["attention_kind"] == "mla"
        resident = container.read_resident()
        assert resident["layers.1.attn.kv_b_proj.weight"].shape == (4 * (16 + 16), 32)
        assert resident["layers.1.moe.router.expert_bias"].shape == (8,)
        assert container.verify().ok
    planned = planned_container(plain, "int4", 32)
    assert planned.file_size == plain.with_suffix(".coli").stat().st_size


V2 = {**{k: v for k, v in CONFIG.items() if k not in ("rope_interleave", "num_nextn_predict_layers")},
      "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "topk_method": "group_limited_greedy",
      "norm_topk_prob": False, "routed_scaling_factor": 1.0, "mlp_bias": False}


def test_v2_maps_to_softmax_group_limited_routing_without_bias_or_renormalisation():
    config = colibri_config_from_hf(V2)
    assert config["attention_kind"] == "mla" and config["rope_interleave"] is True
    assert (config["router_score"], config["selection_bias"], config["route_norm"]) == ("softmax", False, False)
    assert (config["router_groups"], config["router_topk_groups"], config["router_group_score"]) == (4, 2, "max")
    greedy = colibri_config_from_hf({**V2, "topk_method": "greedy"})
    assert (greedy["router_groups"], greedy["router_topk_groups"]) == (1, 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(norm_topk_prob=True), r"norm_topk_prob=True is not supported \(transformers' DeepseekV2 never "
                                    "renormalises"),
        (dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
        (dict(scoring_func="sigmoid"), "scoring_func='sigmoid' is not supported"),
        (dict(mlp_bias=True), "mlp_bias=True is not supported"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantization_config.weight_block_size=None is not supported"),
        (dict(rope_interleave=False), "rope_interleave=False is not supported .*does not know"),
    ],
)
def test_v2_refuses_by_name_and_value(change, message):
    with pytest.raises(HFImportError, match=message):
        colibri_config_from_hf({**V2, **change}, "ds2/config.json")


def test_v2_norm_topk_prob_at_top_1_is_the_same_math_and_is_taken():
    """At one expert per token neither forward renormalises (DeepSeek's code only does at top_k > 1)."""
    top_1 = {**V2, "num_experts_per_tok": 1}
    assert colibri_config_from_hf({**top_1, "norm_topk_prob": True}) == colibri_config_from_hf(top_1)
    assert colibri_config_from_hf(top_1)["route_norm"] is False
