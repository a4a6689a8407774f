"""Mixtral (Mixtral-8x7B, 8x22B): Llama attention without QK-norm, a softmax over the top-k router
logits (the same as softmax, top-k, renormalise), every layer MoE, experts as `w1` (gate),
`w3` (up), `w2` (down) under `block_sparse_moe.experts.{j}`.

`sliding_window`: a window at least as long as the context changes nothing, so the context is
capped at the window (`max_seq_len = min(max_position_embeddings, sliding_window)`) instead of
implementing windowed attention. `router_jitter_noise` only acts in training."""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics, head_dim
from ..names import LlamaStyleNames

MODEL_TYPES = ("mixtral",)
NAMES = LlamaStyleNames(moe="block_sparse_moe", parts=("w1", "w3", "w2"))


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    window = fields.get("sliding_window", None)
    if window is not None:
        max_seq_len = min(max_seq_len, fields.integer("sliding_window"))
    fields.get("router_jitter_noise", 0.0)
    top_k = fields.integer("num_experts_per_tok")
    expert_dim = fields.integer("intermediate_size")
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_dense_layers=0,
        n_heads=n_heads, n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=head_dim(fields, d, n_heads),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len, dense_ffn_dim=expert_dim,
        n_experts=fields.integer("num_local_experts"), expert_dim=expert_dim, top_k_train=top_k, top_k_infer=top_k,
        route_norm=True, tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-5)), init_std=float(fields.get("initializer_range", 0.02)),
    )
