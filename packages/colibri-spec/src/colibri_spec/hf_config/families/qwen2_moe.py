"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): q/k/v biases, no QK-norm, softmax top-k router
(`norm_topk_prob`, off by default), and a shared expert whose output is scaled per token by
`sigmoid(shared_expert_gate(x))`. Tensor names: Llama's, experts under `mlp.experts.{j}`, the
shared expert under `mlp.shared_expert` and its gate `mlp.shared_expert_gate` ([1, d])."""

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

MODEL_TYPES = ("qwen2_moe",)
NAMES = LlamaStyleNames()


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    no_sliding_window(fields)
    top_k = fields.integer("num_experts_per_tok")
    shared = fields.integer("shared_expert_intermediate_size", 0, minimum=0)
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers,
        n_dense_layers=qwen_dense_layers(fields, n_layers), n_heads=n_heads,
        n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=head_dim(fields, d, n_heads),
        qk_norm=False, qkv_bias=bool(fields.get("qkv_bias", True)),  # always on before transformers 5
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        dense_ffn_dim=fields.integer("intermediate_size"), n_experts=fields.integer("num_experts"),
        expert_dim=fields.integer("moe_intermediate_size"), top_k_train=top_k, top_k_infer=top_k,
        shared_expert_dim=shared, shared_expert_gate=shared > 0,
        route_norm=bool(fields.get("norm_topk_prob", False)), tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )
