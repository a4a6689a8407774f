"""GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b): every layer MoE; attention with q/k/v/o biases
(`attention_bias`), one learned sink logit per head, and a sliding window on the layers that
`layer_types` marks "sliding_attention" (alternating, from layer 0); YaRN RoPE; a router with a
bias whose top-k logits go through a softmax (softmax over all, top-k, renormalised: the same
weights); experts with biases and the clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), stored
interleaved and transposed, or as MXFP4 blocks (gpt_oss_experts.py), which the import decodes
and re-quantizes. `quantization_config` is taken when it says mxfp4 and refused otherwise.
The chat template (harmony) is whatever the tokenizer files carry."""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics, head_dim
from ..names import LlamaStyleNames

MODEL_TYPES = ("gpt_oss",)
NAMES = LlamaStyleNames(router="router", experts="gpt_oss")
LAYER_TYPES = ("sliding_attention", "full_attention")


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    quantization = fields.get("quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        if method != "mxfp4":
            fields.refuse("quantization_config.quant_method", method, "GPT-OSS is read in bf16 or as mxfp4")
    layer_types = fields.get("layer_types", None)
    if layer_types is None:  # transformers' default: sliding on even layers
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers or not set(layer_types) <= set(LAYER_TYPES):
        fields.refuse("layer_types", layer_types, f"{n_layers} entries of {', '.join(LAYER_TYPES)}")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    window = fields.get("sliding_window", None)
    if sliding and window is None:
        fields.refuse("sliding_window", None, "layer_types has sliding_attention layers")
    if window is not None:
        window = fields.integer("sliding_window")
    bias = fields.expect("attention_bias", (True, False), True)
    top_k = fields.integer("num_experts_per_tok")
    # The published configs also carry openai's own names: `experts_per_token` (must agree) and
    # `initial_context_length` (the pre-training context; transformers' forward never reads it,
    # the yarn parameters carry it as original_max_position_embeddings).
    if fields.get("experts_per_token", top_k) != top_k:
        fields.refuse("experts_per_token", fields.get("experts_per_token"), f"differs from num_experts_per_tok={top_k}")
    fields.get("initial_context_length", None)
    expert_dim = fields.integer("intermediate_size")
    alpha, limit = fields.get("swiglu_alpha", 1.702), fields.get("swiglu_limit", 7.0)
    for key, value in (("swiglu_alpha", alpha), ("swiglu_limit", limit)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            fields.refuse(key, value, "expected a number > 0")
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_dense_layers=0,
        n_heads=n_heads, n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=head_dim(fields, d, n_heads),
        qkv_bias=bias, o_bias=bias, attn_sinks=True, sliding_window=window if sliding else None, sliding_layers=sliding,
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len, dense_ffn_dim=expert_dim,
        n_experts=fields.first(("num_local_experts", "num_experts")), expert_dim=expert_dim,
        top_k_train=top_k, top_k_infer=top_k, route_norm=True, router_bias=True,
        expert_proj_bias=True, expert_glu="clamped_swiglu", glu_alpha=float(alpha), glu_limit=float(limit),
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-5)), init_std=float(fields.get("initializer_range", 0.02)),
    )
