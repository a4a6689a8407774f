"""Parameter counts from a config alone (no weights are allocated), so `count_params` can size a
Grande model on a laptop. The accounting (documented in colibri-model's README):

- total: every stored parameter once (embedding, untied LM head if any, attention, norms,
  dense FFNs, routers, shared experts, all routed experts). The expert bias is a buffer, not a
  parameter, and is not counted.
- active (per token, for a given top_k): the matmul weights a token passes through: attention,
  the dense FFN, the router, the shared expert, top_k routed experts per MoE layer, the norms,
  and ONE vocab x d matrix for the LM head. The input embedding is a lookup, not a matmul, so
  it is not counted as active (with tied embeddings it is the same matrix as the head).
  This is the convention that gives NanoColibri's published 341M active.
"""

from __future__ import annotations

from .config import ColibriConfig


def count_params(config: ColibriConfig) -> dict[str, int]:
    """Total and active parameter counts, from shapes alone (see the module docstring).

    Returns `total_params`, `active_params_train` (top_k_train experts) and
    `active_params_infer` (top_k_infer experts).
    """
    d, hd = config.d_model, config.head_dim
    if config.attention_kind == "mla":
        attn = mla_params(config)
    else:
        attn = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2  # q, o + k, v
        if config.qk_norm:
            attn += 2 * hd if config.qk_norm_scope == "head" else (config.n_heads + config.n_kv_heads) * hd
        attn += (config.n_heads + 2 * config.n_kv_heads) * hd if config.qkv_bias else 0
    attn += d if config.o_bias else 0
    attn += config.n_heads if config.attn_sinks else 0
    norms_per_layer = 2 * d
    dense_ffn = 3 * d * config.dense_ffn_dim
    expert = 3 * d * config.expert_dim + ((2 * config.expert_dim + d) if config.expert_proj_bias else 0)
    shared = 3 * d * config.shared_expert_dim + (d if config.shared_expert_gate else 0)
    router = config.n_experts * (d + (1 if config.router_bias else 0))
    head = config.vocab_size * d

    backbone = config.n_layers * (attn + norms_per_layer) + d  # + final norm
    backbone += config.n_dense_layers * dense_ffn
    backbone += config.n_moe_layers * (router + shared)

    total = backbone + config.n_moe_layers * config.n_experts * expert
    total += head if config.tie_embeddings else 2 * head

    def active(top_k: int) -> int:
        return backbone + config.n_moe_layers * top_k * expert + head

    return {
        "total_params": total,
        "active_params_train": active(config.top_k_train),
        "active_params_infer": active(config.top_k_infer),
    }


def mla_params(config: ColibriConfig) -> int:
    """Parameters of one multi-head latent attention layer (colibri_model.mla)."""
    d, h, q_dim = config.d_model, config.n_heads, config.n_heads * config.head_dim
    rank = config.q_lora_rank
    q = d * q_dim if rank is None else d * rank + rank + rank * q_dim  # q_a, its norm, q_b
    kv = d * (config.kv_lora_rank + config.qk_rope_head_dim) + config.kv_lora_rank  # kv_a, its norm
    kv += config.kv_lora_rank * h * (config.qk_nope_head_dim + config.v_head_dim)  # kv_b
    return q + kv + h * config.v_head_dim * d  # + o_proj
