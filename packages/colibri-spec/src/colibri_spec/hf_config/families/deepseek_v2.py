"""DeepSeek-V2 (DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2): multi-head latent attention like V3
(deepseek_mla.py) with RoPE always on interleaved pairs (transformers' complex rotation) and yarn;
a softmax router (over all experts, fp32) whose top-k probabilities are the gates times
`routed_scaling_factor`, never renormalised; `topk_method` "greedy" (plain top-k) or
"group_limited_greedy" (the best `topk_group` of `n_group` groups, each scored by its best
expert); no score-correction bias.

An FP8 block-scaled checkpoint in DeepSeek-V3's form (its quantization_config) is read as V3's is.
Refused besides what V3 refuses: `norm_topk_prob` true with more than one expert per token (read
from transformers' code, checked at 5.24: `DeepseekV2TopkRouter` deletes the attribute it inherits
from Qwen2-MoE's router and never renormalises, while DeepSeek's own modeling_deepseek.py
renormalises the top-k gates to sum 1 when top_k > 1: the two disagree, so neither is guessed; at
top_k 1 both give p x routed_scaling_factor and the flag is taken), `mlp_bias`, and `topk_method`
"noaux_tc" (V3's router: model_type deepseek_v3)."""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, decoder_basics
from ..names import LlamaStyleNames
from .deepseek_mla import mla_fields, moe_fields, router_groups

MODEL_TYPES = ("deepseek_v2",)
NAMES = LlamaStyleNames(shared="shared_experts")


def map_config(fields: ConfigFields, name: str) -> dict:
    d, n_layers, n_heads, max_seq_len, theta, scaling = decoder_basics(fields)
    fields.expect("mlp_bias", (False,), False)
    fields.expect("scoring_func", ("softmax",), "softmax")
    refuse_renormalisation(fields)
    method = fields.expect("topk_method", ("greedy", "group_limited_greedy"), "greedy")
    if method == "greedy":
        fields.get("n_group", None)  # unused by plain top-k
        fields.get("topk_group", None)
        groups = None
    else:
        groups = router_groups(fields)
    return colibri_config(
        schema_version="1.2", name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers,
        n_heads=n_heads, **mla_fields(fields, n_heads), rope_theta=theta, rope_scaling=scaling,
        max_seq_len=max_seq_len, rope_interleave=True, **moe_fields(fields, n_layers, groups),
        router_score="softmax", selection_bias=False, router_group_score="max", route_norm=False,
        tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )


def refuse_renormalisation(fields: ConfigFields) -> None:
    """`norm_topk_prob` true is a disagreement between the two DeepSeek-V2 forwards (module docstring)."""
    if fields.get("norm_topk_prob", False) and fields.integer("num_experts_per_tok") > 1:
        fields.refuse("norm_topk_prob", True, (
            "transformers' DeepseekV2 never renormalises the top-k gates (DeepseekV2TopkRouter ignores the flag: "
            "gates are the softmax probabilities times routed_scaling_factor), while DeepSeek's own "
            "modeling_deepseek.py renormalises them to sum 1 when num_experts_per_tok > 1, so the checkpoint's "
            "intended math is ambiguous; DeepSeek-V2, V2-Chat and V2-Lite publish norm_topk_prob false: set it "
            "false to import transformers' math"))
