"""import-hf for GPT-OSS without transformers: a directory written with numpy + safetensors in both
forms GPT-OSS checkpoints take (interleaved bf16 experts, and MXFP4 blocks + scales as published),
every config field mapped or refused by name and value. (Equality with transformers' forward is
colibri-stream's test_hf_import.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from colibri_int4 import Container, HFImportError
from colibri_int4.import_hf import colibri_config_from_hf, import_hf, quant_scheme
from colibri_int4.mxfp4 import decode_mxfp4, encode_mxfp4
from colibri_int4.quantize import bf16_bits_to_f32, f32_to_bf16_bits
from safetensors.numpy import save_file

D, E, F, LAYERS, VOCAB, HEADS, KV, HD = 64, 4, 32, 2, 96, 4, 2, 16
CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": VOCAB, "hidden_size": D,
    "intermediate_size": F, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
    "head_dim": HD, "num_local_experts": E, "num_experts_per_tok": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": True,
    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"], "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0, "router_aux_loss_coef": 0.9, "output_router_logits": False, "initializer_range": 0.02,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                        "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    "attention_dropout": 0.0, "use_cache": True, "eos_token_id": 5, "pad_token_id": 4, "transformers_version": "5.24.0",
}


def _w(rng, *shape):
    return bf16_bits_to_f32(f32_to_bf16_bits(rng.normal(0, 0.05, shape).astype(np.float32)))


def _tensors(mxfp4: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": _w(rng, VOCAB, D), "model.norm.weight": _w(rng, D) + 1,
           "lm_head.weight": _w(rng, VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": _w(rng, D) + 1, p + "post_attention_layernorm.weight": _w(rng, D) + 1,
                p + "self_attn.sinks": _w(rng, HEADS), p + "mlp.router.weight": _w(rng, E, D),
                p + "mlp.router.bias": _w(rng, E)}
        for proj, rows in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            out |= {p + f"self_attn.{proj}_proj.weight": _w(rng, rows, D), p + f"self_attn.{proj}_proj.bias": _w(rng, rows)}
        out |= {p + "self_attn.o_proj.weight": _w(rng, D, HEADS * HD), p + "self_attn.o_proj.bias": _w(rng, D)}
        q = p + "mlp.experts."
        out |= {q + "gate_up_proj_bias": _w(rng, E, 2 * F), q + "down_proj_bias": _w(rng, E, D)}
        gate_up, down = _w(rng, E, 2 * F, D), _w(rng, E, D, F)  # out x in, gate/up interleaved rows
        if mxfp4:
            out[q + "gate_up_proj_blocks"], out[q + "gate_up_proj_scales"] = encode_mxfp4(gate_up)
            out[q + "down_proj_blocks"], out[q + "down_proj_scales"] = encode_mxfp4(down)
        else:  # transformers' in-memory (and save_pretrained) layout: in x out
            out[q + "gate_up_proj"] = np.ascontiguousarray(gate_up.transpose(0, 2, 1))
            out[q + "down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
    return out


def _write(directory, mxfp4=False, config=None, tensors=None):
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config or CONFIG)
    if mxfp4 and "quantization_config" not in config:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors if tensors is not None else _tensors(mxfp4), str(directory / "model.safetensors"))
    vocab = {f"w{i}": i for i in range(VOCAB)}
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab,
                                                                                     "unk_token": "w0"}}))
    return directory


def test_config_maps_every_gpt_oss_field():
    config = colibri_config_from_hf(CONFIG, "gpt-oss/config.json")
    assert config["schema_version"] == "1.2" and config["n_dense_layers"] == 0 and config["n_experts"] == E
    assert config["attn_sinks"] and config["qkv_bias"] and config["o_bias"] and config["router_bias"]
    assert config["sliding_window"] == 8 and config["sliding_layers"] == [0]
    assert (config["expert_proj_bias"], config["expert_glu"], config["glu_alpha"], config["glu_limit"]) == (
        True, "clamped_swiglu", 1.702, 7.0)
    assert config["router_score"] == "softmax" and config["route_norm"] and not config["selection_bias"]
    assert config["rope_scaling"]["kind"] == "yarn" and config["rope_scaling"]["original_max_seq_len"] == 4096
    assert config["rope_theta"] == 150000.0


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16-interleaved", "mxfp4"])
def test_experts_land_deinterleaved_in_out_x_in_layout_with_their_biases(tmp_path, mxfp4):
    tensors = _tensors(mxfp4)
    directory = _write(tmp_path / "hf", mxfp4, tensors=tensors)
    out = tmp_path / "m.coli"
    import_hf(directory, out, quant_scheme("bf16"))
    q = "model.layers.1.mlp.experts."
    if mxfp4:
        gate_up = decode_mxfp4(tensors[q + "gate_up_proj_blocks"], tensors[q + "gate_up_proj_scales"])[3]
        down = decode_mxfp4(tensors[q + "down_proj_blocks"], tensors[q + "down_proj_scales"])[3]
    else:
        gate_up, down = tensors[q + "gate_up_proj"][3].T, tensors[q + "down_proj"][3].T
    with Container.open(out) as c:
        assert c.version == (1, 2) and c.header.experts.bias == "f32"
        blob = c.read_expert_into(1, 3, bytearray(c.blob_length))
        weights = blob.dequantize()
        np.testing.assert_array_equal(weights["gate"], gate_up[0::2])  # MXFP4 values are exact in bf16
        np.testing.assert_array_equal(weights["up"], gate_up[1::2])
        np.testing.assert_array_equal(weights["down"], down)
        np.testing.assert_array_equal(blob.biases["gate"], tensors[q + "gate_up_proj_bias"][3][0::2])
        np.testing.assert_array_equal(blob.biases["up"], tensors[q + "gate_up_proj_bias"][3][1::2])
        np.testing.assert_array_equal(blob.biases["down"], tensors[q + "down_proj_bias"][3])
        resident = c.read_resident()
        np.testing.assert_array_equal(resident["layers.0.attn.sinks"], tensors["model.layers.0.self_attn.sinks"])
        np.testing.assert_array_equal(resident["layers.1.moe.router.bias"], tensors["model.layers.1.mlp.router.bias"])
        np.testing.assert_array_equal(resident["layers.0.attn.o_proj.bias"], tensors["model.layers.0.self_attn.o_proj.bias"])


def test_int4_import_of_mxfp4_experts_requantizes_them(tmp_path):
    directory = _write(tmp_path / "hf", mxfp4=True)
    out = tmp_path / "m.coli"
    import_hf(directory, out, quant_scheme("int4", group_size=32))
    with Container.open(out) as c:
        assert c.scheme.expert_dtype == "int4" and c.blob_layout.encoding == "q4" and c.blob_layout.bias


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method='gptq' is not supported"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types=.* is not supported"),
        (dict(layer_types=["full_attention"]), "layer_types=.* is not supported .*2 entries"),
        (dict(sliding_window=None), "sliding_window=None is not supported .*sliding_attention layers"),
        (dict(swiglu_limit=-1.0), "swiglu_limit=-1.0 is not supported"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(attention_bias="yes"), "attention_bias='yes' is not supported"),
        (dict(some_new_knob=1), "some_new_knob=1 is not supported"),
        (dict(rope_parameters={**CONFIG["rope_parameters"], "attention_factor": 1.5}), "rope_parameters.attention_factor=1.5"),
    ],
)
def test_unsupported_gpt_oss_fields_are_refused_by_name_and_value(tmp_path, change, message):
    directory = _write(tmp_path / "hf", config={**CONFIG, **change})
    with pytest.raises(HFImportError, match=message):
        import_hf(directory, tmp_path / "m.coli")
    assert not (tmp_path / "m.coli").exists()


def test_a_bad_mxfp4_scale_and_missing_expert_tensors_are_named(tmp_path):
    tensors = _tensors(mxfp4=True)
    tensors["model.layers.0.mlp.experts.down_proj_scales"][2, 0, 0] = 255
    with pytest.raises(HFImportError, match=r"layer 0 expert 2: MXFP4 scale byte 255"):
        import_hf(_write(tmp_path / "a", True, tensors=tensors), tmp_path / "a.coli")
    tensors = _tensors(mxfp4=False)
    del tensors["model.layers.1.mlp.experts.down_proj_bias"]
    with pytest.raises(HFImportError, match=r"'model.layers.1.mlp.experts.down_proj_bias' is missing"):
        import_hf(_write(tmp_path / "b", tensors=tensors), tmp_path / "b.coli")


# openai/gpt-oss-20b's config.json as published (transformers 4.55 era: legacy rope_scaling, openai's
# own experts_per_token / initial_context_length, MXFP4 quantization_config)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}


def test_the_published_gpt_oss_20b_config_maps_and_plans(tmp_path):
    from colibri_int4.import_hf import planned_container

    config = colibri_config_from_hf(GPT_OSS_20B, "gpt-oss-20b/config.json")
    assert (config["n_layers"], config["n_experts"], config["expert_dim"], config["top_k_infer"]) == (24, 32, 2880, 4)
    assert config["sliding_layers"] == list(range(0, 24, 2)) and config["sliding_window"] == 128
    assert config["rope_scaling"]["truncate"] is False and config["rope_theta"] == 150000.0
    (tmp_path / "config.json").write_text(json.dumps(GPT_OSS_20B))
    planned = planned_container(tmp_path, "int4")
    assert planned.blob_layout.bias and planned.version == (1, 2)
    assert 11.5e9 < planned.file_size < 12.5e9  # 20.9B weights, experts at 4.25 bits, the rest int8 (norms bf16)
    with pytest.raises(HFImportError, match="experts_per_token=2 is not supported .*differs"):
        colibri_config_from_hf({**GPT_OSS_20B, "experts_per_token": 2}, "x")


def test_a_synthetic_container_of_gpt_oss_shapes_is_valid(tmp_path):
    from colibri_int4 import QuantScheme, write_synthetic_container

    path = write_synthetic_container(tmp_path / "s.coli", colibri_config_from_hf(CONFIG, "x"), QuantScheme(group_size=32))
    with Container.open(path) as c:
        assert c.version == (1, 2) and c.blob_layout.bias and c.verify().ok
