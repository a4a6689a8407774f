"""OLMoE (allenai/OLMoE-1B-7B): QK-norm as one RMSNorm over the whole q projection (hidden_size
wide) and the whole k projection, before the head split; softmax top-k router (`norm_topk_prob`
off by default); every layer MoE. `clip_qkv` (clamping q, k, v) is refused when set."""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics, head_dim
from ..names import LlamaStyleNames

MODEL_TYPES = ("olmoe",)
NAMES = LlamaStyleNames()


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    heads_dim = head_dim(fields, d, n_heads)
    if heads_dim * n_heads != d:  # transformers sizes q_norm by hidden_size
        fields.refuse("head_dim", heads_dim, f"OLMoE's q_norm needs num_attention_heads * head_dim == hidden_size {d}")
    fields.expect("attention_bias", (False,), False)
    fields.expect("clip_qkv", (None,), None)
    top_k = fields.integer("num_experts_per_tok")
    expert_dim = fields.integer("intermediate_size")
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_dense_layers=0,
        n_heads=n_heads, n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=heads_dim,
        qk_norm=True, qk_norm_scope="projection", rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        dense_ffn_dim=expert_dim, n_experts=fields.integer("num_experts"), expert_dim=expert_dim,
        top_k_train=top_k, top_k_infer=top_k, route_norm=bool(fields.get("norm_topk_prob", False)),
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-5)), init_std=float(fields.get("initializer_range", 0.02)),
    )
