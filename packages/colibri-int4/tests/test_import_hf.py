"""import-hf without transformers: a Hugging Face directory written with numpy + safetensors.

Names and values land where CHECKPOINT.md says, shards and transformers 5's fused expert layout
give the same container as one file, every config field is mapped or refused by name and value,
the tokenizer settings and chat template are carried, and containers without 1.1 features are
still written byte for byte as format 1.0 wrote them. (Numerical equality with transformers'
own forward is colibri-stream's test_hf_import.py.)"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner
from colibri_int4 import Container, HFImportError, QuantScheme, write_synthetic_container
from colibri_int4.cli import main
from colibri_int4.import_hf import import_hf, quant_scheme
from colibri_int4.quantize import bf16_bits_to_f32, f32_to_bf16_bits
from safetensors.numpy import save_file

D, E, I_EXPERT, LAYERS, VOCAB = 64, 4, 32, 2, 96
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": VOCAB, "hidden_size": D,
    "intermediate_size": 96, "moe_intermediate_size": I_EXPERT, "num_hidden_layers": LAYERS,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": E, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "max_position_embeddings": 128, "rope_theta": 1000000.0, "rope_scaling": None,
    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 2, "mlp_only_layers": [],
    "decoder_sparse_step": 1, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "eos_token_id": 5,
}


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """HF names of the tiny Qwen3-MoE above, bf16-representable fp32 values."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return bf16_bits_to_f32(f32_to_bf16_bits(rng.normal(0, 0.05, shape).astype(np.float32)))

    out = {"model.embed_tokens.weight": w(VOCAB, D), "model.norm.weight": w(D) + 1, "lm_head.weight": w(VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": w(D) + 1, p + "post_attention_layernorm.weight": w(D) + 1,
                p + "self_attn.q_proj.weight": w(64, D), p + "self_attn.k_proj.weight": w(32, D),
                p + "self_attn.v_proj.weight": w(32, D), p + "self_attn.o_proj.weight": w(D, 64),
                p + "self_attn.q_norm.weight": w(16) + 1, p + "self_attn.k_norm.weight": w(16) + 1,
                p + "mlp.gate.weight": w(E, D)}
        for e in range(E):
            q = p + f"mlp.experts.{e}."
            out |= {q + "gate_proj.weight": w(I_EXPERT, D), q + "up_proj.weight": w(I_EXPERT, D),
                    q + "down_proj.weight": w(D, I_EXPERT)}
    return out


def _tokenizer_json() -> str:
    vocab = {f"w{i}": i for i in range(VOCAB)}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
                       "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
                       "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}})


def _write(directory, config=None, tensors=None, shards: int = 1):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    tensors = _tensors() if tensors is None else tensors
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for k in range(shards):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[k::shards]}
            save_file(part, str(directory / file))
            weight_map |= {n: file for n in part}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "tokenizer.json").write_text(_tokenizer_json())
    return directory


@pytest.fixture()
def hf_dir(tmp_path):
    return _write(tmp_path / "hf")


def test_bf16_import_puts_every_tensor_where_checkpoint_md_says(hf_dir, tmp_path):
    report = import_hf(hf_dir, tmp_path / "m.coli", quant_scheme("bf16"))
    tensors = _tensors()
    with Container.open(tmp_path / "m.coli") as c:
        assert c.version == (1, 1) and c.scheme.expert_dtype == "bf16"
        config = c.config
        resident = c.read_resident()
        np.testing.assert_array_equal(resident["layers.1.moe.router.weight"], tensors["model.layers.1.mlp.gate.weight"])
        np.testing.assert_array_equal(resident["layers.0.attn.q_norm.weight"],
                                      tensors["model.layers.0.self_attn.q_norm.weight"])
        np.testing.assert_array_equal(resident["layers.0.ffn_norm.weight"],
                                      tensors["model.layers.0.post_attention_layernorm.weight"])
        assert "layers.0.moe.router.expert_bias" not in resident  # softmax router: no selection bias
        expert = c.read_expert(1, 3)
        np.testing.assert_array_equal(expert["up"], tensors["model.layers.1.mlp.experts.3.up_proj.weight"])
        np.testing.assert_array_equal(expert["down"], tensors["model.layers.1.mlp.experts.3.down_proj.weight"])
        assert c.tokenizer_config["eos_token_ids"] == [5] and c.read_tokenizer_json() == _tokenizer_json()
    assert config["router_score"] == "softmax" and config["route_norm"] is True and config["n_dense_layers"] == 0
    assert config["rope_theta"] == 1e6 and config["qk_norm_scope"] == "head" and config["schema_version"] == "1.1"
    assert report.model_type == "qwen3_moe" and report.checkpoint_bytes == sum(t.nbytes for t in tensors.values())


def test_int8_and_int4_experts_are_close_and_smaller(hf_dir, tmp_path):
    tensors = _tensors()
    truth = tensors["model.layers.0.mlp.experts.2.gate_proj.weight"]
    sizes = {}
    for quant, tolerance in (("int8", 0.01), ("int4", 0.15)):
        import_hf(hf_dir, tmp_path / f"{quant}.coli", quant_scheme(quant, group_size=32))
        with Container.open(tmp_path / f"{quant}.coli") as c:
            gate = c.read_expert(0, 2)["gate"]
            sizes[quant] = c.blob_length
            assert c.verify().ok
        error = np.sqrt(np.mean((gate - truth) ** 2)) / np.sqrt(np.mean(truth**2))
        assert 0 < error < tolerance, (quant, error)
    assert sizes["int4"] < sizes["int8"]


def test_shards_and_fused_experts_give_the_same_container(hf_dir, tmp_path):
    import_hf(hf_dir, tmp_path / "one.coli", quant_scheme("int4"), name="m")
    sharded = _write(tmp_path / "sharded", shards=3)
    import_hf(sharded, tmp_path / "three.coli", quant_scheme("int4"), name="m")
    tensors = _tensors()
    for i in range(LAYERS):  # transformers 5's in-memory layout: gate rows, then up rows
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [np.concatenate([tensors.pop(p + f"{e}.gate_proj.weight"), tensors.pop(p + f"{e}.up_proj.weight")])
                   for e in range(E)]
        tensors[p + "gate_up_proj"] = np.stack(gate_up)
        tensors[p + "down_proj"] = np.stack([tensors.pop(p + f"{e}.down_proj.weight") for e in range(E)])
    fused = _write(tmp_path / "fused", tensors=tensors)
    import_hf(fused, tmp_path / "fused.coli", quant_scheme("int4"), name="m")
    one = (tmp_path / "one.coli").read_bytes()
    assert (tmp_path / "three.coli").read_bytes() == one == (tmp_path / "fused.coli").read_bytes()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling.rope_type='dynamic' is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
         "rope_scaling.original_max_position_embeddings=None is not supported"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                            "attention_factor": 2.0}),
         r"rope_scaling.attention_factor=2.0 is not supported \(an explicit yarn attention factor\)"),
        (dict(some_new_knob=3), "some_new_knob=3 is not supported .*does not know"),
        (dict(mlp_only_layers=[1]), "mlp_only_layers/decoder_sparse_step=.* dense layers must be the first"),
        (dict(attention_bias=True), "attention_bias=True is not supported"),
        (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quant_method='gptq' is not supported"),
        (dict(model_type="qwen3_next"), "model_type='qwen3_next' is not supported .*Gated DeltaNet"),
        (dict(model_type="gpt2"), "model_type='gpt2' is not supported; supported: deepseek_v2, deepseek_v3, gpt_oss, llama, mixtral"),
        (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 is not in \[1, 4\]"),
    ],
)
def test_unsupported_config_fields_are_refused_by_name_and_value(tmp_path, change, message):
    directory = _write(tmp_path / "hf", config={**CONFIG, **change})
    with pytest.raises(HFImportError, match=message):
        import_hf(directory, tmp_path / "m.coli")
    assert not (tmp_path / "m.coli").exists() and not (tmp_path / "m.coli.tmp").exists()


def test_tensors_that_do_not_fit_the_config_are_refused(tmp_path):
    tensors = _tensors()
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(HFImportError, match=r"experts\.2\.up_proj\.weight' is missing \(routed expert \(layer 1, expert 2\)"):
        import_hf(_write(tmp_path / "a", tensors=tensors), tmp_path / "a.coli")
    tensors = _tensors() | {"model.layers.0.self_attn.o_proj.bias": np.zeros(D, np.float32)}
    with pytest.raises(HFImportError, match="o_proj.bias' has no place in the Colibri model"):
        import_hf(_write(tmp_path / "b", tensors=tensors), tmp_path / "b.coli")
    tensors = _tensors() | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32)}
    import_hf(_write(tmp_path / "c", tensors=tensors), tmp_path / "c.coli")  # a recomputed buffer: ignored
    tensors = _tensors() | {"model.embed_tokens.weight": np.zeros((VOCAB + 1, D), np.float32)}
    with pytest.raises(HFImportError, match=r"embed_tokens.weight' has shape \[97, 64\], config.json implies \[96, 64\]"):
        import_hf(_write(tmp_path / "d", tensors=tensors), tmp_path / "d.coli")


def test_missing_files_are_named(hf_dir, tmp_path):
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(HFImportError, match="tokenizer.json: missing"):
        import_hf(hf_dir, tmp_path / "m.coli")
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(HFImportError, match="no model.safetensors and no model.safetensors.index.json"):
        import_hf(hf_dir, tmp_path / "m.coli")
    sharded = _write(tmp_path / "sharded", shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    other = {"model-00001-of-00002.safetensors": "model-00002-of-00002.safetensors"}
    wrong = other.get(index["weight_map"]["model.norm.weight"], "model-00001-of-00002.safetensors")
    index["weight_map"]["model.norm.weight"] = wrong
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFImportError, match=f"tensor 'model.norm.weight' is not in {wrong}"):
        import_hf(sharded, tmp_path / "m.coli")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/config.json").write_text("{nope")
    with pytest.raises(HFImportError, match="config.json: not valid JSON"):
        import_hf(tmp_path / "bad", tmp_path / "m.coli")


def test_chat_template_and_special_tokens_are_carried(hf_dir, tmp_path):
    (hf_dir / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": {"content": "w5", "lstrip": False}, "pad_token": "w0", "add_bos_token": False}))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    import_hf(hf_dir, tmp_path / "m.coli", quant_scheme("int4"))
    with Container.open(tmp_path / "m.coli") as c:
        assert c.chat_template.startswith("{% for m in messages %}")
        assert c.tokenizer_config == {"chat_template": c.chat_template, "bos_token": None, "eos_token": "w5",
                                      "pad_token": "w0", "eos_token_ids": [5, 6], "add_bos_token": False}
    # tokenizer_config.json's own chat_template wins over the file (transformers' order)
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T"}))
    import_hf(hf_dir, tmp_path / "n.coli", quant_scheme("int4"))
    with Container.open(tmp_path / "n.coli") as c:
        assert c.chat_template == "T"


def test_cli_import_hf_exit_codes(hf_dir, tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["import-hf", str(hf_dir), str(tmp_path / "m.coli"), "--quant", "bf16"])
    assert result.exit_code == 0, result.output
    assert "qwen3_moe" in result.output and "16.000 bits/weight" in result.output
    result = runner.invoke(main, ["inspect", str(tmp_path / "m.coli")])
    assert result.exit_code == 0 and "experts bf16" in result.output
    (hf_dir / "config.json").write_text(json.dumps({**CONFIG, "hidden_act": "relu"}))
    result = runner.invoke(main, ["import-hf", str(hf_dir), str(tmp_path / "x.coli")])
    assert result.exit_code == 2 and "hidden_act='relu' is not supported" in result.output
    assert result.output.strip().count("\n") == 0
    result = runner.invoke(main, ["import-hf", str(hf_dir), str(tmp_path / "x.coli"), "--quant", "int2"])
    assert result.exit_code == 2


@pytest.mark.parametrize("tied", [False, True])
def test_embed_dtype_int6_imports_the_head_as_q6(tmp_path, tied):
    tensors = _tensors()
    if tied:  # the embedding is then the head
        del tensors["lm_head.weight"]
    hf = _write(tmp_path / "hf", {**CONFIG, "tie_word_embeddings": tied}, tensors)
    out = tmp_path / "m.coli"
    result = CliRunner().invoke(main, ["import-hf", str(hf), str(out), "--group", "32", "--embed-dtype", "int6"])
    assert result.exit_code == 0, result.output
    heads = {"embed.weight": "model.embed_tokens.weight"} | ({} if tied else {"lm_head.weight": "lm_head.weight"})
    with Container.open(out) as c:
        assert c.version == (1, 3) and c.verify().ok
        assert {t.name for t in c.header.tensors if t.encoding == "q6"} == set(heads)
        raw = c.read_resident(dequantize=False)
        for name, hf_name in heads.items():
            scales = raw[name].scales_f32()
            error = np.abs(raw[name].dequantize() - tensors[hf_name]).reshape(VOCAB, -1, 32)
            assert (error <= scales[..., None] / 2 * (1 + 1e-6)).all(), name


SYNTHETIC = dict(format_version="1.0", model_type="colibri", vocab_size=320, d_model=64, n_layers=3, n_dense_layers=1,
                 n_heads=2, n_kv_heads=1, head_dim=32, qk_norm=True, dense_ffn_dim=96, n_experts=4, expert_dim=64,
                 shared_expert_dim=32, tie_embeddings=False)


def test_containers_without_1_1_features_are_the_bytes_format_1_0_wrote(tmp_path):
    # sha256 of what colibri-int4 at c4ad406 (format 1.0) wrote for the same calls
    expected = ["c5874e175595baf4fb944a0842447dfd2da348846bf9cde3a80ae7fe864247e1",
                "ece4ea7b3fcf5c4dbcfbbd91b4c91ba77aa70f6d2dd0c000bdb56578b8bc78c4"]
    schemes = [QuantScheme(group_size=32), QuantScheme(group_size=64, symmetric=False, resident_dtype="int4")]
    for scheme, sha in zip(schemes, expected, strict=True):
        path = write_synthetic_container(tmp_path / "s.coli", SYNTHETIC, scheme, seed=3)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        with Container.open(path) as c:
            assert c.version == (1, 0) and c.tokenizer_config is None and c.scheme.expert_dtype == "int4"


@pytest.mark.parametrize("scheme", [quant_scheme("bf16"), quant_scheme("int8", group_size=32),
                                    quant_scheme("int4", group_size=32, symmetric=False, resident_dtype="int4")])
def test_large_matrices_written_in_row_blocks_are_the_same_bytes(hf_dir, tmp_path, monkeypatch, scheme):
    """The embedding of a real vocabulary is converted a block of rows at a time (bounded RAM);
    forced here on tiny matrices, the file is byte-identical to converting them whole."""
    import colibri_int4.export as export

    import_hf(hf_dir, tmp_path / "whole.coli", scheme)
    monkeypatch.setattr(export, "ROW_BLOCK_BYTES", 4096)  # every 2-D tensor, in blocks of 16 rows
    import_hf(hf_dir, tmp_path / "blocks.coli", scheme)
    assert (tmp_path / "blocks.coli").read_bytes() == (tmp_path / "whole.coli").read_bytes()
    with Container.open(tmp_path / "blocks.coli") as c:
        assert c.verify().ok


@pytest.mark.parametrize("quant", ["int4", "int8", "bf16"])
def test_a_config_alone_plans_the_container_import_hf_writes(hf_dir, tmp_path, quant):
    from colibri_int4 import ContainerError
    from colibri_int4.import_hf import colibri_config_from_hf, planned_container, sizes_by_quant

    (hf_dir / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}", "eos_token": "w5"}')
    report = import_hf(hf_dir, tmp_path / "m.coli", quant_scheme(quant))
    no_weights = tmp_path / "plan" / "hf"  # same directory name (the config's name), no weights
    no_weights.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((hf_dir / name).read_bytes())
    planned = planned_container(no_weights / "config.json", quant)
    with Container.open(tmp_path / "m.coli") as real:
        assert planned.header.model_dump(exclude={"tensors", "experts", "tokenizer"}) == \
               real.header.model_dump(exclude={"tensors", "experts", "tokenizer"})
        assert [(t.name, t.offset, t.length) for t in planned.header.tensors] == \
               [(t.name, t.offset, t.length) for t in real.header.tensors]
        assert planned.file_size == real.file_size == report.file_size and planned.version == real.version
        assert planned.blob_layout == real.blob_layout and planned.expert_bytes == real.expert_bytes
    assert report.config == colibri_config_from_hf(CONFIG, "config.json", "qwen3_moe:hf")
    assert sizes_by_quant(no_weights)[quant].file_size == report.file_size
    assert not planned.has_file
    with pytest.raises(ContainerError, match="planned from a config and has no file"):
        planned.read_expert(0, 0)
    with pytest.raises(ContainerError, match="planned from a config and has no file"):
        planned.read_tokenizer_json()


def test_planning_a_bad_config_names_the_field(tmp_path):
    from colibri_int4.import_hf import colibri_config_from_hf, planned_container

    with pytest.raises(HFImportError, match=r"x/config.json: required field 'num_experts' is missing"):
        colibri_config_from_hf({k: v for k, v in CONFIG.items() if k != "num_experts"}, "x/config.json")
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "num_experts_per_tok": 9}))
    with pytest.raises(HFImportError, match=r"num_experts_per_tok=9 is not in \[1, 4\]"):
        planned_container(tmp_path)
    with pytest.raises(HFImportError, match="missing"):
        planned_container(tmp_path / "nowhere")
