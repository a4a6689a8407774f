"""import-gguf without torch: GGUF files written with gguf-py's GGUFWriter from numpy weights.

A GGUF gives the same container as import-hf does for a Hugging Face directory holding the
GGUF's decoded weights (every tensor and expert blob byte for byte, llama's permuted q/k rows
included), and every bad input is one clear error naming the key, tensor or type and the file,
with no output left behind. (Numbers against transformers: colibri-stream's test_gguf_import.py.)"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from colibri_int4 import Container, GGUFImportError
from colibri_int4.cli import main
from colibri_int4.import_gguf import GGUFFile, import_gguf, tokenizer_from_gguf
from colibri_int4.import_hf import import_hf, quant_scheme
from safetensors.numpy import save_file

gguf = pytest.importorskip("gguf")

D, E, I_EXPERT, LAYERS, HEADS, KV, HEAD_DIM = 64, 4, 32, 2, 4, 2, 16
TOKENS = ["<s>", "</s>"] + [chr(c) for c in range(ord("!"), ord("!") + 94)]
VOCAB = len(TOKENS)


def _hf_weights(arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named fp32 weights of a tiny qwen3moe or llama model (experts stacked, as llama.cpp stores them)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        return rng.normal(0, 0.05, shape).astype(np.float32)

    out = {"model.embed_tokens.weight": w(VOCAB, D), "model.norm.weight": w(D) + 1, "lm_head.weight": w(VOCAB, D)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": w(D) + 1, p + "post_attention_layernorm.weight": w(D) + 1,
                p + "self_attn.q_proj.weight": w(HEADS * HEAD_DIM, D), p + "self_attn.k_proj.weight": w(KV * HEAD_DIM, D),
                p + "self_attn.v_proj.weight": w(KV * HEAD_DIM, D), p + "self_attn.o_proj.weight": w(D, HEADS * HEAD_DIM)}
        if arch == "qwen3moe":
            out |= {p + "self_attn.q_norm.weight": w(HEAD_DIM) + 1, p + "self_attn.k_norm.weight": w(HEAD_DIM) + 1,
                    p + "mlp.gate.weight": w(E, D), p + "mlp.experts.gate_proj": w(E, I_EXPERT, D),
                    p + "mlp.experts.up_proj": w(E, I_EXPERT, D), p + "mlp.experts.down_proj": w(E, D, I_EXPERT)}
        else:
            out |= {p + "mlp.gate_proj.weight": w(96, D), p + "mlp.up_proj.weight": w(96, D),
                    p + "mlp.down_proj.weight": w(D, 96)}
    return out


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf LlamaModel.permute
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_gguf(path, arch: str = "qwen3moe", kind: str = "Q8_0", extra_keys: dict | None = None,
                drop: str | None = None, add: dict | None = None, tokenizer_model: str = "gpt2",
                arch_name: str | None = None) -> dict[str, np.ndarray]:
    """Write the tiny model as llama.cpp's converter would; returns the decoded values by HF name."""
    writer = gguf.GGUFWriter(str(path), arch_name or arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(96)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch == "qwen3moe":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
        writer.add_expert_count(E)
        writer.add_expert_used_count(2)
        writer.add_expert_feed_forward_length(I_EXPERT)
    for key, value in (extra_keys or {}).items():
        writer.add_uint32(key, value) if isinstance(value, int) else writer.add_string(key, value)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3] + [1] * (VOCAB - 2))
    writer.add_token_merges(["a b", "c d"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{{ messages }}")
    names = gguf.TensorNameMap(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), LAYERS)
    qtype = gguf.GGMLQuantizationType[kind]
    values = {}
    for hf_name, array in _hf_weights(arch).items():
        stacked = hf_name.endswith("_proj") and ".experts." in hf_name
        name = names.get_name(hf_name) + ".weight" if stacked else names.get_name(hf_name, try_suffixes=(".weight",))
        if name == drop:
            continue
        if array.ndim == 1:
            writer.add_tensor(name, array)
            values[hf_name] = array
            continue
        raw = gguf.quants.quantize(array, qtype)
        values[hf_name] = gguf.quants.dequantize(raw, qtype).reshape(array.shape)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            raw = _permute(raw, HEADS if "q_proj" in hf_name else KV)
        writer.add_tensor(name, raw, raw_dtype=qtype)
    for name, array in (add or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return values


def _hf_directory(directory, arch: str, values: dict[str, np.ndarray], tokenizer: bytes):
    """The Hugging Face directory of the same model and decoded weights (experts one tensor each)."""
    directory.mkdir()
    config = {"model_type": "qwen3_moe" if arch == "qwen3moe" else "llama", "vocab_size": VOCAB, "hidden_size": D,
              "intermediate_size": 96, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV, "max_position_embeddings": 128, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
              "hidden_act": "silu", "tie_word_embeddings": False}
    if arch == "qwen3moe":
        config |= {"head_dim": HEAD_DIM, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I_EXPERT,
                   "norm_topk_prob": True}
    tensors = {}
    for name, array in values.items():
        if ".experts." in name:
            for e in range(E):
                tensors[name.replace(".experts.", f".experts.{e}.") + ".weight"] = np.ascontiguousarray(array[e])
        else:
            tensors[name] = np.ascontiguousarray(array)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_bytes(tokenizer)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "bos_token": "<s>",
                                                                  "eos_token": "</s>"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return directory


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
@pytest.mark.parametrize("quant", ["bf16", "int4"])
def test_the_container_is_the_one_import_hf_writes_for_the_decoded_weights(tmp_path, arch, quant):
    values = _write_gguf(tmp_path / "m.gguf", arch)
    with GGUFFile(tmp_path / "m.gguf") as file:
        tokenizer, _ = tokenizer_from_gguf(file.metadata, str(file.path))
    hf = _hf_directory(tmp_path / "hf", arch, values, tokenizer)
    scheme = quant_scheme(quant, group_size=32)
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "gguf.coli", scheme, name="same")
    import_hf(hf, tmp_path / "hf.coli", scheme, name="same")
    with Container.open(tmp_path / "gguf.coli") as a, Container.open(tmp_path / "hf.coli") as b:
        assert a.config == b.config and a.header.tokenizer_config == b.header.tokenizer_config
        assert [(t.name, t.crc32) for t in a.header.tensors] == [(t.name, t.crc32) for t in b.header.tensors]
        assert [e.crc32 for e in a.header.experts.entries] == [e.crc32 for e in b.header.experts.entries]
        assert a.read_tokenizer_json() == b.read_tokenizer_json() and a.verify().ok
    assert report.tensor_types["Q8_0"] > 0 and report.architecture == arch


def _refused(tmp_path, match: str, **kwargs):
    path = tmp_path / "bad.gguf"
    if not path.exists():
        _write_gguf(path, **kwargs)
    with pytest.raises(GGUFImportError, match=match):
        import_gguf(path, tmp_path / "out.coli", quant_scheme("bf16"))
    assert not (tmp_path / "out.coli").exists() and not (tmp_path / "out.coli.tmp").exists()


def test_truncated_file_is_refused(tmp_path):
    _write_gguf(tmp_path / "bad.gguf")
    data = (tmp_path / "bad.gguf").read_bytes()
    for cut in (len(data) // 2, 200, 10):
        (tmp_path / "bad.gguf").write_bytes(data[:cut])
        _refused(tmp_path, r"bad\.gguf: (not a readable GGUF file|tensor '.+' ends past the end of the file)")


def test_unknown_architecture_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"bad\.gguf: general\.architecture='gemma3' is not supported; supported: deepseek2, gpt-oss, llama, olmoe",
             arch_name="gemma3")


def test_missing_metadata_key_is_refused_by_name(tmp_path):
    # a Qwen3-MoE's keys under deepseek2: MLA's sizes are missing
    _refused(tmp_path, r"bad\.gguf: required metadata key 'deepseek2\.rope\.dimension_count' is missing",
             arch_name="deepseek2")


def test_missing_tensor_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"bad\.gguf: tensor 'blk\.1\.ffn_down_exps\.weight' is missing \(layer 1 routed experts\)",
             drop="blk.1.ffn_down_exps.weight")


def test_unmapped_tensor_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"tensor 'blk\.0\.attn_q\.bias' has no place in the Colibri model",
             add={"blk.0.attn_q.bias": np.zeros(HEADS * HEAD_DIM, np.float32)})


def test_llama3_rope_frequency_table_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"tensor 'rope_freqs\.weight' \(llama3-style RoPE frequency factors\) is not supported",
             arch="llama", add={"rope_freqs.weight": np.ones(HEAD_DIM // 2, np.float32)})


@pytest.mark.parametrize(("key", "value", "match"), [
    ("qwen3moe.attention.sliding_window", 8, r"metadata key 'qwen3moe\.attention\.sliding_window' = 8 is not supported"),
    ("qwen3moe.rope.scaling.type", "longrope", r"'qwen3moe\.rope\.scaling\.type' = 'longrope' is not supported"),
    ("qwen3moe.expert_gating_func", 2, r"'qwen3moe\.expert_gating_func' = 2 is not supported"),
    ("split.count", 3, r"metadata key 'split\.count' = 3 is not supported \(one part of a split GGUF"),
    ("some.other_key", "x", r"metadata key 'some\.other_key' = 'x' is not supported"),
])
def test_metadata_that_would_change_the_math_is_refused_by_name(tmp_path, key, value, match):
    _refused(tmp_path, match, extra_keys={key: value})


def test_unknown_tokenizer_model_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"metadata key 'tokenizer\.ggml\.model' = 't5' is not supported", tokenizer_model="t5")


def test_sentencepiece_vocabulary_without_scores_is_refused_by_name(tmp_path):
    _refused(tmp_path, r"metadata key 'tokenizer\.ggml\.scores' is missing", tokenizer_model="llama")


def test_missing_gguf_package_says_how_to_install_it(tmp_path, monkeypatch):
    _write_gguf(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(GGUFImportError, match=r"needs the gguf package .*pip install 'colibri-int4\[gguf\]'"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "out.coli")


def test_cli_writes_the_container_and_refuses_bad_input_in_one_line(tmp_path):
    _write_gguf(tmp_path / "m.gguf")
    result = CliRunner().invoke(main, ["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "m.coli"), "--no-progress"])
    assert result.exit_code == 0, result.output
    assert "qwen3moe as qwen3_moe" in result.output and "Q8_0" in result.output
    (tmp_path / "bad.gguf").write_bytes((tmp_path / "m.gguf").read_bytes()[:300])
    result = CliRunner().invoke(main, ["import-gguf", str(tmp_path / "bad.gguf"), str(tmp_path / "x.coli")])
    assert result.exit_code == 2 and "bad.gguf" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("kind, symmetric", [("Q4_0", True), ("Q4_1", False)])
def test_the_default_import_keeps_the_files_own_4_bit_grid(tmp_path, kind, symmetric):
    values = _write_gguf(tmp_path / "m.gguf", kind=kind)
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "m.coli")  # no scheme: the file's grid
    assert report.grid.startswith(f"{kind} blocks (100% of the int4 bytes)"), report.grid
    with Container.open(tmp_path / "m.coli") as container:
        scheme = container.scheme
        assert (scheme.group_size, scheme.symmetric, scheme.scale_dtype) == (32, symmetric, "fp16")
        expert = container.read_expert(1, 2)
    for part in ("gate", "up", "down"):
        stored, source = expert[part], values[f"model.layers.1.mlp.experts.{part}_proj"][2]
        # the file's own values come back (fp16 holds Q4_0's d exactly, Q4_1's zero m + 8d rounded)
        np.testing.assert_allclose(stored, source, rtol=0, atol=1e-3 * np.abs(source).max())
    # the scheme's grouping re-quantizes every block: the weights move by a quantization step
    import_gguf(tmp_path / "m.gguf", tmp_path / "g64.coli", quant_scheme("int4"))
    with Container.open(tmp_path / "g64.coli") as container:
        moved = container.read_expert(1, 2)["gate"]
    source = values["model.layers.1.mlp.experts.gate_proj"][2]
    assert np.linalg.norm(moved - source) > 20 * np.linalg.norm(expert["gate"] - source)


def test_embed_dtype_int6_writes_the_head_as_q6_on_the_files_grid(tmp_path):
    values = _write_gguf(tmp_path / "m.gguf", kind="Q4_0")
    result = CliRunner().invoke(main, ["import-gguf", str(tmp_path / "m.gguf"), str(tmp_path / "m.coli"),
                                       "--embed-dtype", "int6", "--no-progress"])
    assert result.exit_code == 0, result.output
    with Container.open(tmp_path / "m.coli") as container:
        assert container.version == (1, 3) and container.scheme.group_size == 32  # the file's grid
        raw = container.read_resident(dequantize=False)
    for name, hf_name in (("embed.weight", "model.embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        assert raw[name].encoding == "q6"
        error = np.abs(raw[name].dequantize() - values[hf_name]).reshape(VOCAB, -1, 32)
        assert (error <= raw[name].scales_f32()[..., None] / 2 * (1 + 1e-6)).all(), name


def test_a_file_without_a_4_bit_grid_keeps_the_schemes_grouping(tmp_path):
    _write_gguf(tmp_path / "m.gguf", kind="Q8_0")
    report = import_gguf(tmp_path / "m.gguf", tmp_path / "m.coli")
    assert report.grid is None
    with Container.open(tmp_path / "m.coli") as container:
        assert (container.scheme.group_size, container.scheme.symmetric) == (64, True)


def test_cli_keeps_the_files_grid_unless_asked_and_notes_a_symmetric_grid_on_minimums(tmp_path):
    _write_gguf(tmp_path / "q41.gguf", kind="Q4_1")
    runner = CliRunner()
    for extra, grid, hinted in (([], True, False), (["--sym"], False, True), (["--group", "64"], False, True),
                                (["--asym", "--group", "32"], False, False), (["--quant", "bf16"], False, False)):
        result = runner.invoke(main, ["import-gguf", str(tmp_path / "q41.gguf"), str(tmp_path / "m.coli"), *extra])
        assert result.exit_code == 0, result.output
        assert ("grid: Q4_1 blocks" in result.output) == grid, (extra, result.output)
        assert ("note: Q4_1 blocks have a minimum" in result.output) == hinted, (extra, result.output)
    _write_gguf(tmp_path / "dense.gguf", arch="llama", kind="Q4_1")  # --quant int4 leaves a dense model int8
    result = runner.invoke(main, ["import-gguf", str(tmp_path / "dense.gguf"), str(tmp_path / "d.coli")])
    assert result.exit_code == 0 and "note:" not in result.output and "grid:" not in result.output
    assert "no routed experts" in result.output and "experts int4" not in result.output  # nothing int4 in it
    result = runner.invoke(main, ["import-gguf", str(tmp_path / "dense.gguf"), str(tmp_path / "d.coli"),
                                  "--resident-dtype", "int4"])
    assert result.exit_code == 0 and "grid: Q4_1 blocks" in result.output and "note:" not in result.output
    result = runner.invoke(main, ["import-gguf", str(tmp_path / "dense.gguf"), str(tmp_path / "d.coli"),
                                  "--resident-dtype", "int4", "--sym"])
    assert result.exit_code == 0 and "note: Q4_1 blocks have a minimum" in result.output
