"""Format 1.2: routed experts with biases (GPT-OSS) keep them in their blob, f32 after the
weights, at every expert dtype; the header says so (`experts.bias`), a 1.1 reader refuses that
key instead of misreading the blobs, and containers without biases are written as before."""

from __future__ import annotations

import numpy as np
import pytest
from colibri_int4 import Container, ContainerError, QuantScheme, dequantize_container, export_checkpoint
from colibri_int4.layout import ExpertBlobLayout
from colibri_int4.model_shape import ModelShape

GPT_OSS_LIKE = dict(schema_version="1.2", n_dense_layers=0, shared_expert_dim=0, qk_norm=False, qkv_bias=True,
                    o_bias=True, attn_sinks=True, router_bias=True, expert_proj_bias=True, selection_bias=False,
                    router_score="softmax")


@pytest.mark.parametrize("expert_dtype", ["int4", "int8", "bf16"])
def test_expert_biases_round_trip_through_the_blob_in_f32(make_checkpoint, tmp_path, expert_dtype):
    directory, config, tensors = make_checkpoint(**GPT_OSS_LIKE)
    out = tmp_path / f"{expert_dtype}.coli"
    export_checkpoint(directory, out, QuantScheme(group_size=32, expert_dtype=expert_dtype))
    with Container.open(out) as c:
        assert c.version == (1, 2) and c.header.experts.bias == "f32" and c.blob_layout.bias
        blob = c.read_expert_into(2, 3, bytearray(c.blob_length))
        for part in ("gate", "up", "down"):
            np.testing.assert_array_equal(blob.biases[part], tensors[f"layers.2.moe.experts.{part}_bias"][3])
        names = {t.name for t in c.header.tensors}
        assert {"layers.0.attn.sinks", "layers.0.attn.o_proj.bias", "layers.1.moe.router.bias"} <= names
    restored = dequantize_container(out, tmp_path / "ckpt")
    from safetensors.numpy import load_file

    back = load_file(str(restored / "model.safetensors"))
    np.testing.assert_array_equal(back["layers.1.moe.experts.down_bias"], tensors["layers.1.moe.experts.down_bias"])


def test_bias_sections_follow_the_weights_and_cost_4_bytes_each():
    shape = ModelShape(vocab_size=256, d_model=64, n_layers=1, n_dense_layers=0, n_heads=4, n_kv_heads=2, head_dim=16,
                       qk_norm=False, dense_ffn_dim=0, n_experts=4, expert_dim=64, shared_expert_dim=0,
                       tie_embeddings=False, expert_proj_bias=True)
    plain = ExpertBlobLayout.build(shape.model_copy(update={"expert_proj_bias": False}), QuantScheme(group_size=32))
    biased = ExpertBlobLayout.build(shape, QuantScheme(group_size=32))
    assert biased.sections[: len(plain.sections)] == plain.sections
    extra = biased.sections[len(plain.sections):]
    assert [(s.part, s.kind, s.shape) for s in extra] == [("gate", "bias", (64,)), ("up", "bias", (64,)),
                                                          ("down", "bias", (64,))]
    assert biased.payload_length == plain.payload_length + 4 * (64 + 64 + 64)


def test_a_1_1_reader_refuses_the_bias_key_and_a_mismatch_is_named(make_checkpoint, tmp_path, hostile):
    directory, _, _ = make_checkpoint(**GPT_OSS_LIKE)
    out = tmp_path / "biased.coli"
    export_checkpoint(directory, out, QuantScheme(group_size=32))
    data = out.read_bytes()

    def drop_bias(h):
        del h["experts"]["bias"]

    bad = tmp_path / "no-bias-key.coli"
    bad.write_bytes(hostile(data, drop_bias, minor=2))
    with pytest.raises(ContainerError, match=r"experts\.bias is None, but the config's expert_proj_bias is True"):
        Container.open(bad)
    # A 1.1 reader's ExpertIndex is strict and has no `bias` field: the key fails its schema check
    # (a newer minor only drops unknown *top-level* keys), so the biased blobs are never misread.
    from colibri_int4.header import ExpertIndex
    from pydantic import ValidationError

    fields_1_1 = {k: v for k, v in ExpertIndex.model_fields.items() if k != "bias"}
    assert ExpertIndex.model_config["extra"] == "forbid" and set(fields_1_1) == {"blob_length", "entries"}
    with pytest.raises(ValidationError, match="bias"):
        ExpertIndex.model_validate({"blob_length": 4096, "bias": "bf16", "entries": []})


def test_containers_without_1_2_features_keep_their_version(tiny_container):
    path, _, _ = tiny_container
    with Container.open(path) as c:
        assert c.version == (1, 0) and c.header.experts.bias is None and b'"bias"' not in path.read_bytes()[:65536]
