"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with per-head QK-norm over head_dim, softmax
top-k router with `norm_topk_prob`, no shared expert, every layer MoE unless `mlp_only_layers` /
`decoder_sparse_step` say otherwise. Tensor names: Llama's, experts under `mlp.experts.{j}`."""

from __future__ import annotations

from ..config_fields import (
    ConfigFields,
    colibri_config,
    decoder_basics,
    head_dim,
    no_sliding_window,
    qwen_dense_layers,
)
from ..names import LlamaStyleNames

MODEL_TYPES = ("qwen3_moe",)
NAMES = LlamaStyleNames()


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    fields.expect("attention_bias", (False,), False)
    no_sliding_window(fields)
    n_experts = fields.first(("num_experts", "num_local_experts"))
    top_k = fields.integer("num_experts_per_tok")
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers,
        n_dense_layers=qwen_dense_layers(fields, n_layers), n_heads=n_heads,
        n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=head_dim(fields, d, n_heads),
        qk_norm=True, qk_norm_scope="head", rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        dense_ffn_dim=fields.integer("intermediate_size"), n_experts=n_experts,
        expert_dim=fields.integer("moe_intermediate_size"), top_k_train=top_k, top_k_infer=top_k,
        route_norm=bool(fields.get("norm_topk_prob", False)), tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )
