"""The checkpoint format is read through colibri-model's public functions: config, tensor names,
and the dtype each tensor is held in agree between `load_checkpoint` and the engine."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from colibri_int4 import Container, ModelShape, QuantScheme, export_checkpoint
from colibri_int4.model_shape import checkpoint_tensor_shapes as container_tensor_shapes
from colibri_model import PRESETS, checkpoint_tensor_shapes, get_preset, held_dtype, load_checkpoint
from colibri_stream import ContainerConfigError, Engine


def test_config_without_model_type_is_refused_at_open_by_colibri_models_rule(tiny, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny[0].parent / "ckpt", checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    del config["model_type"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    out = tmp_path / "no-type.coli"
    export_checkpoint(checkpoint, out, QuantScheme(group_size=32))  # colibri-int4 carries it opaquely
    with Container.open(out) as container:
        assert container.config == config
    with pytest.raises(ContainerConfigError, match=r"no-type\.coli: model config: no model_type field"):
        Engine.open(out, ram_budget="200MB")


def test_engine_holds_every_tensor_in_the_dtype_load_checkpoint_does(tiny):
    from colibri_stream.compute.native_linear import NativeLinear
    from colibri_stream.stored_embedding import StoredEmbedding

    dense = load_checkpoint(tiny[1], dtype=torch.bfloat16)
    with Engine.open(tiny[0], ram_budget="200MB", dtype="bf16", compute="int4") as eng:
        streamed = {n: t.dtype for n, t in eng.model.state_dict().items()}
        assert isinstance(eng.model.embed, StoredEmbedding)  # untied: held as stored, not a parameter
    with Engine.open(tiny[0], ram_budget="200MB", dtype="bf16", compute="native") as eng:
        native = {n: t.dtype for n, t in eng.model.state_dict().items()}
        as_stored = {f"{n}.weight" for n, m in eng.model.named_modules() if isinstance(m, NativeLinear)}
    expected = {n: t.dtype for n, t in dense.state_dict().items() if ".moe.experts." not in n and n != "embed.weight"}
    assert streamed == expected
    # a native engine holds its q4/q8 projections (and a bf16 LM head) as stored, the rest alike
    assert as_stored and native == {n: d for n, d in expected.items() if n not in as_stored}
    assert streamed["layers.1.ffn_norm.weight"] == torch.float32 == held_dtype((64,), torch.bfloat16)
    assert streamed["layers.1.attn.q_proj.weight"] == torch.bfloat16


MLA = dict(attention_kind="mla", qk_norm=False, n_kv_heads=4, head_dim=32, kv_lora_rank=64, qk_nope_head_dim=24,
           qk_rope_head_dim=8, v_head_dim=32, rope_interleave=True, router_groups=4, router_topk_groups=2,
           rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=32, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0, truncate=True))
# config schema 1.2: GPT-OSS's variants
GPT_OSS = dict(name="tiny", qk_norm=False, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=8,
               sliding_layers=(0, 2), router_score="softmax", selection_bias=False, router_bias=True,
               expert_proj_bias=True, expert_glu="clamped_swiglu", glu_limit=1.0, shared_expert_dim=0,
               n_dense_layers=1, top_k_infer=2)
VARIANTS = [dict(name=name) for name in PRESETS] + [GPT_OSS] + [
    dict(name="tiny", qk_norm=False, tie_embeddings=False, shared_expert_dim=0, n_dense_layers=0),
] + [
    # config schema 1.2: DeepSeek's multi-head latent attention (with and without a q latent),
    # group-limited routing, yarn
    dict(name="tiny", **MLA, q_lora_rank=rank) for rank in (64, None)
] + [
    # config schema 1.1: the variants of imported checkpoints
    dict(name="tiny", router_score="softmax", selection_bias=False, qk_norm_scope="projection", n_dense_layers=0),
    dict(name="tiny", qk_norm=False, qkv_bias=True, shared_expert_gate=True, selection_bias=False),
    dict(name="tiny", n_dense_layers=4, n_experts=0, expert_dim=0),
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(f"{k}={v[k]}" for k in v))
def test_container_layout_names_every_checkpoint_tensor_of_colibri_model(variant):
    """A container's layout reads colibri-spec's tensor table through `ModelShape`, the bounded
    subset of the config a header is validated with: it carries every field the table reads, so
    the container and colibri-model name the same tensors with the same shapes."""
    config = get_preset(**variant)
    shape = ModelShape.model_validate(config.model_dump())
    assert container_tensor_shapes(shape) == checkpoint_tensor_shapes(config)


@pytest.mark.parametrize("variant", VARIANTS[-3:] + VARIANTS[-5:-4],
                         ids=["softmax-projection-norm", "qkv-bias-gated-shared", "dense", "mla-1.2"])
def test_exported_1_1_variant_streams_like_its_checkpoint(variant, tmp_path):
    """A Colibri checkpoint of a schema 1.1 or 1.2 variant (not an import): export, then the engine
    against load_checkpoint of the dequantized container (bit-identical weights)."""
    from colibri_int4 import dequantize_container
    from colibri_model import ColibriForCausalLM

    torch.manual_seed(0)
    config = get_preset(**variant, vocab_size=512, max_seq_len=64, init_std=0.05)
    ColibriForCausalLM(config).save_pretrained(tmp_path / "ckpt")
    export_checkpoint(tmp_path / "ckpt", tmp_path / "v.coli", QuantScheme(group_size=32))
    reference = load_checkpoint(dequantize_container(tmp_path / "v.coli", tmp_path / "deq")).eval()
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(ids).logits[0]
    with Engine.open(tmp_path / "v.coli", ram_budget="200MB", dtype="f32", compute="dequant") as eng:
        torch.testing.assert_close(eng.logits(ids[0]), expected, atol=2e-5, rtol=1e-4)


def test_exported_1_2_gpt_oss_variant_streams_like_its_checkpoint(tmp_path):
    """Trained-shape GPT-OSS variant (random, biases made non-zero), exported at int4: the engine's
    int4 expert kernels with biases and the clamped SwiGLU against load_checkpoint of the
    dequantized container (the same weights)."""
    from colibri_int4 import dequantize_container
    from colibri_stream.studies.synthetic_container import export_random_model

    config = get_preset(**GPT_OSS, vocab_size=512, max_seq_len=64, init_std=0.05)
    container = export_random_model(tmp_path, config, bias_std=0.3)
    reference = load_checkpoint(dequantize_container(container, tmp_path / "deq")).eval()
    ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = reference(ids).logits[0]
    for compute in ("dequant", "int4"):
        with Engine.open(container, ram_budget="200MB", dtype="f32", compute=compute,
                         kernel_dtype="f32") as eng:
            assert eng.stats.compute_mode == ("dequant" if compute == "dequant" else "int4-f32")
            torch.testing.assert_close(eng.logits(ids[0]), expected, atol=1e-4, rtol=1e-4)


def test_import_hf_writes_schema_1_2_configs_with_colibri_models_defaults():
    """colibri-int4 may not import colibri-model, so import-hf keeps its own copy of the 1.2
    defaults (every key a 1.2 config is written with): it must be colibri-model's."""
    from colibri_int4.import_hf.config_fields import SCHEMA_1_2_DEFAULTS
    from colibri_model.config import V1_2_DEFAULTS

    assert {k: tuple(v) if isinstance(v, list) else v for k, v in SCHEMA_1_2_DEFAULTS.items()} == V1_2_DEFAULTS
