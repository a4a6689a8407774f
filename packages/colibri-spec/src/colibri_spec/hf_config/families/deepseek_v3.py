"""DeepSeek-V3 (DeepSeek-V3/R1, Moonlight, Kimi-K2 shapes): multi-head latent attention (colibri-model's
`attention_kind = "mla"`), RoPE on the rope dims only (interleaved pairs when `rope_interleave`,
yarn scaling with its mscale softmax correction), a sigmoid router whose `e_score_correction_bias`
only chooses the top-k (Colibri's selection bias), group-limited top-k (`n_group`, `topk_group`:
groups by the sum of their top-2 scores), `norm_topk_prob`, `routed_scaling_factor`; the first
`first_k_dense_replace` layers dense (`intermediate_size`), then MoE layers with
`n_shared_experts * moe_intermediate_size` ungated shared experts.

DeepSeek's own FP8 release is read as it is: its quantization_config (`quant_method` "fp8", `fmt`
"e4m3", `activation_scheme` "dynamic", any `weight_block_size`) is taken and each F8_E4M3 weight
is dequantized with its `weight_scale_inv` block scales (colibri_int4/fp8.py), then quantized to
`--quant`; any other quantization_config is refused by name and value.

Refused: `attention_bias` (o_proj has no bias tensor in Colibri), grouped KV heads
(`num_key_value_heads != num_attention_heads`). The multi-token-prediction layers
(`num_nextn_predict_layers`, tensors `model.layers.{num_hidden_layers}.*`) are skipped: they only
serve speculative decoding. The original (remote-code) config's `topk_method`, `scoring_func`,
`moe_layer_freq` are checked, `ep_size`, `aux_loss_alpha`, `seq_aux` do not change the forward.
"""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics
from ..names import LlamaStyleNames
from .deepseek_mla import mla_fields, moe_fields, router_groups

MODEL_TYPES = ("deepseek_v3",)
NAMES = LlamaStyleNames(shared="shared_experts", router_bias="e_score_correction_bias", extra_layers_ignored=True)


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    fields.expect("topk_method", ("noaux_tc",), "noaux_tc")
    fields.expect("scoring_func", ("sigmoid",), "sigmoid")
    return colibri_config(
        schema_version="1.2", name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_heads=n_heads,
        **mla_fields(fields, n_heads), rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        rope_interleave=bool(fields.get("rope_interleave", True)), **moe_fields(fields, n_layers, router_groups(fields)),
        router_score="sigmoid", selection_bias=True, router_group_score="top2_sum",
        route_norm=bool(fields.get("norm_topk_prob", True)), tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )
