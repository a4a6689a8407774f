"""DeepSeek-V3 (DeepSeek-V3/R1, Moonlight, Kimi-K2 shapes): multi-head latent attention (colibri-model's
`attention_kind = "mla"`), RoPE on the rope dims only (interleaved pairs when `rope_interleave`,
yarn scaling with its mscale softmax correction), a sigmoid router whose `e_score_correction_bias`
only chooses the top-k (Colibri's selection bias), group-limited top-k (`n_group`, `topk_group`:
groups by the sum of their top-2 scores), `norm_topk_prob`, `routed_scaling_factor`; the first
`first_k_dense_replace` layers dense (`intermediate_size`), then MoE layers with
`n_shared_experts * moe_intermediate_size` ungated shared experts.

Refused: FP8 checkpoints (`quantization_config`, DeepSeek's own release: block-scaled
`weight_scale_inv` tensors are not dequantized here; convert to bf16 first, e.g. DeepSeek's
`fp8_cast_bf16.py`), `attention_bias` (o_proj has no bias tensor in Colibri), grouped KV heads
(`num_key_value_heads != num_attention_heads`). The multi-token-prediction layers
(`num_nextn_predict_layers`, tensors `model.layers.{num_hidden_layers}.*`) are skipped: they only
serve speculative decoding. The original (remote-code) config's `topk_method`, `scoring_func`,
`moe_layer_freq` are checked, `ep_size`, `aux_loss_alpha`, `seq_aux` do not change the forward.
"""

from __future__ import annotations

from ..config_fields import ConfigFields, colibri_config, rope, silu_activation
from ..names import LlamaStyleNames

MODEL_TYPES = ("deepseek_v3",)
NAMES = LlamaStyleNames(shared="shared_experts", router_bias="e_score_correction_bias", extra_layers_ignored=True)
# config.json keys of the original release that only matter to training or parallelism
_NOT_THE_FORWARD = ("ep_size", "aux_loss_alpha", "seq_aux", "auto_map", "num_nextn_predict_layers", "num_mtp_layers")


def refuse_fp8(fields: ConfigFields) -> None:
    quant = fields.data.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        fields.refuse("quantization_config.quant_method", method,
                      "an FP8/pre-quantized DeepSeek checkpoint (block-scaled weight_scale_inv tensors) is not "
                      "dequantized by import-hf; convert it to bf16 first (DeepSeek's fp8_cast_bf16.py)")


def mla_fields(fields: ConfigFields, n_heads: int) -> dict:
    """The attention fields both DeepSeek versions share."""
    kv_heads = fields.integer("num_key_value_heads", n_heads)
    if kv_heads != n_heads:
        fields.refuse("num_key_value_heads", kv_heads, f"MLA here has one key per head: {n_heads}")
    fields.expect("attention_bias", (False,), False)
    fields.get("pretraining_tp", 1)
    nope, rope_dim = fields.integer("qk_nope_head_dim"), fields.integer("qk_rope_head_dim")
    for key, value in (("qk_head_dim", nope + rope_dim), ("head_dim", rope_dim)):  # derived by transformers
        if fields.get(key, value) != value:
            fields.refuse(key, fields.data[key], f"transformers derives {value} from qk_nope/qk_rope_head_dim")
    q_rank = fields.get("q_lora_rank", None)
    if q_rank is not None:
        q_rank = fields.integer("q_lora_rank")
    return dict(attention_kind="mla", n_kv_heads=n_heads, head_dim=nope + rope_dim, q_lora_rank=q_rank,
                kv_lora_rank=fields.integer("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                v_head_dim=fields.integer("v_head_dim"))


def moe_fields(fields: ConfigFields, n_layers: int) -> dict:
    """The layer pattern and the experts both DeepSeek versions share."""
    fields.expect("moe_layer_freq", (1,), 1)
    for key in _NOT_THE_FORWARD:
        fields.get(key, None)
    n_dense = fields.integer("first_k_dense_replace", 0, minimum=0)
    if n_dense > n_layers:
        fields.refuse("first_k_dense_replace", n_dense, f"exceeds num_hidden_layers={n_layers}")
    expert_dim = fields.integer("moe_intermediate_size")
    top_k = fields.integer("num_experts_per_tok")
    n_experts = fields.first(("n_routed_experts", "num_local_experts"))
    n_groups = fields.integer("n_group", 1)
    chosen = fields.integer("topk_group", n_groups)
    if n_experts % n_groups:
        fields.refuse("n_group", n_groups, f"{n_experts} routed experts do not split into equal groups")
    if chosen > n_groups or top_k > chosen * (n_experts // n_groups):
        fields.refuse("topk_group", chosen, f"num_experts_per_tok={top_k} needs more experts than {chosen} of "
                      f"{n_groups} groups hold")
    return dict(n_dense_layers=n_dense, dense_ffn_dim=fields.integer("intermediate_size"),
                n_experts=n_experts, expert_dim=expert_dim,
                shared_expert_dim=fields.integer("n_shared_experts", 0, minimum=0) * expert_dim,
                top_k_train=top_k, top_k_infer=top_k, router_groups=n_groups,
                router_topk_groups=chosen,
                route_scale=float(fields.get("routed_scaling_factor", 1.0)))


def map_config(fields: ConfigFields, name: str) -> dict:
    refuse_fp8(fields)
    d, n_layers = fields.integer("hidden_size"), fields.integer("num_hidden_layers")
    n_heads = fields.integer("num_attention_heads")
    max_seq_len = fields.integer("max_position_embeddings")
    theta, scaling = rope(fields, max_seq_len, yarn=True)
    silu_activation(fields)
    fields.expect("topk_method", ("noaux_tc",), "noaux_tc")
    fields.expect("scoring_func", ("sigmoid",), "sigmoid")
    return colibri_config(
        schema_version="1.2", name=name, vocab_size=fields.integer("vocab_size"), d_model=d, n_layers=n_layers, n_heads=n_heads,
        **mla_fields(fields, n_heads), rope_theta=theta, rope_scaling=scaling, max_seq_len=max_seq_len,
        rope_interleave=bool(fields.get("rope_interleave", True)), **moe_fields(fields, n_layers),
        router_score="sigmoid", selection_bias=True, router_group_score="top2_sum",
        route_norm=bool(fields.get("norm_topk_prob", True)), tie_embeddings=bool(fields.get("tie_word_embeddings", False)),
        norm_eps=float(fields.get("rms_norm_eps", 1e-6)), init_std=float(fields.get("initializer_range", 0.02)),
    )
