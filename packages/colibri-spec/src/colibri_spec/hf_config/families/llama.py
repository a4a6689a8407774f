"""Dense Llama-family models (Llama 2/3, SmolLM/SmolLM2, TinyLlama): every layer a dense SwiGLU,
no routed experts, so everything is resident (`n_dense_layers == n_layers`, `n_experts = 0`).
RoPE default, linear or llama3. `attention_bias` / `mlp_bias` are refused (o_proj and MLP
biases have no Colibri tensor); `pretraining_tp` only splits matmuls, the math is the same."""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics, head_dim
from ..names import LlamaStyleNames

MODEL_TYPES = ("llama",)
NAMES = LlamaStyleNames()


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    fields.expect("attention_bias", (False,), False)
    fields.expect("mlp_bias", (False,), False)
    fields.get("pretraining_tp", 1)
    return colibri_config(
        name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_dense_layers=n_layers,
        n_heads=n_heads, n_kv_heads=fields.integer("num_key_value_heads", n_heads), head_dim=head_dim(fields, d, n_heads),
        rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        dense_ffn_dim=fields.integer("intermediate_size"), router_score="sigmoid", selection_bias=True,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )
