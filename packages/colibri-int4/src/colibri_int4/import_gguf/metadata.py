"""GGUF metadata -> the Hugging Face config.json it stands for, key by key (GGUF.md, "Metadata").

llama.cpp's converter writes a config.json's numbers under `{arch}.*` keys (block_count,
embedding_length, attention.head_count, expert_count, rope.freq_base, ...). We write them back
under transformers' names for the family, so that import-hf's mapping
(`colibri_config_from_hf`, with every field mapped or refused) gives the Colibri config: one
mapping of what each family means, not a second one for GGUF.

What llama.cpp's own code decides rather than a key (it is the reference for what a GGUF
computes) is set here per architecture: Qwen3-MoE and Mixtral renormalise the top-k router
weights, Qwen2-MoE and OLMoE do not; GPT-OSS's window pattern and SwiGLU clamp are fixed; DeepSeek's
MLA is stored as one shared kv head; tied embeddings are a GGUF without `output.weight`.

Every `{arch}.*` key is taken or refused by name and value, like config.json fields; `general.*`
(names, licences, the file type), `quantize.*` (how the file was made) and `tokenizer.*`
(tokenizer_json.py) cannot change the forward.
"""

from __future__ import annotations

from ..errors import GGUFImportError

_MISSING = object()

# GGUF's general.architecture -> transformers' model_type (llama with experts is Mixtral's layout)
ARCHITECTURES = {"llama": "llama", "qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe",
                 "gpt-oss": "gpt_oss", "deepseek2": "deepseek_v3"}  # deepseek_v2 when its router is a softmax
# llama.cpp renormalises the chosen experts' weights for these (its build_moe_ffn norm_w argument)
_NORM_TOPK = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False, "gpt-oss": True, "deepseek2": False}
# Keys that describe the file or the model's provenance, never its math.
_INFORMATIONAL_PREFIXES = ("general.", "quantize.", "tokenizer.")
# {arch}.* keys that are bookkeeping here: checked elsewhere or implied by the tensors.
_ARCH_BOOKKEEPING = ("rope.scaling.finetuned", "vocab_size")


class MetadataKeys:
    """The `{arch}.*` keys of one file, handed out one by one; `finish()` refuses the rest."""

    def __init__(self, metadata: dict, arch: str, where: str):
        self.metadata, self.arch, self.where, self.taken = metadata, arch, where, set()

    def get(self, key: str, default=_MISSING):
        full = f"{self.arch}.{key}"
        self.taken.add(full)
        if full in self.metadata:
            return self.metadata[full]
        if default is _MISSING:
            raise GGUFImportError(f"{self.where}: required metadata key '{full}' is missing")
        return default

    def integer(self, key: str, default=_MISSING, minimum: int = 1) -> int:
        value = self.get(key, default)
        if isinstance(value, list) and value and all(v == value[0] for v in value):
            value = value[0]  # a per-layer array with one value throughout
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.refuse(key, value, f"expected an integer >= {minimum}")
        return value

    def number(self, key: str, default=_MISSING) -> float:
        value = self.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            self.refuse(key, value, "expected a number")
        return float(value)

    def refuse(self, key: str, value, why: str):
        shown = value if not isinstance(value, list) or len(value) <= 8 else f"[{len(value)} values]"
        raise GGUFImportError(f"{self.where}: metadata key '{self.arch}.{key}' = {shown!r} is not supported ({why})")

    def finish(self) -> None:
        for key in sorted(self.metadata):
            if key.startswith(f"{self.arch}.") and key not in self.taken:
                if key[len(self.arch) + 1:] not in _ARCH_BOOKKEEPING:
                    self.refuse(key[len(self.arch) + 1:], self.metadata[key],
                                "a key import-gguf does not know; it may change the math")
            elif not key.startswith(f"{self.arch}.") and not key.startswith(_INFORMATIONAL_PREFIXES):
                if key == "split.count" and self.metadata[key] in (0, 1):
                    continue
                if key.startswith("split.") and self.metadata.get("split.count", 1) in (0, 1):
                    continue
                value = self.metadata[key]
                why = ("one part of a split GGUF: merge the parts into one file first (llama.cpp's gguf-split --merge)"
                       if key.startswith("split.") else "a key import-gguf does not know; it may change the math")
                raise GGUFImportError(f"{self.where}: metadata key '{key}' = {value!r} is not supported ({why})")


def architecture(metadata: dict, where: str) -> str:
    """`general.architecture`, refused by name unless import-gguf converts it."""
    arch = metadata.get("general.architecture")
    if arch in ARCHITECTURES:
        return arch
    raise GGUFImportError(
        f"{where}: general.architecture={arch!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def hf_config_from_gguf(metadata: dict, tensor_shapes: dict[str, tuple[int, ...]], where: str) -> dict:
    """The transformers config.json object a GGUF's metadata stands for (see the module docstring).
    `tensor_shapes` (name -> torch-order shape) supplies what GGUF says through its tensors: the
    vocabulary size, tied embeddings, q/k/v biases."""
    arch = architecture(metadata, where)
    keys = MetadataKeys(metadata, arch, where)
    if "token_embd.weight" not in tensor_shapes:
        raise GGUFImportError(f"{where}: tensor 'token_embd.weight' is missing (the token embedding)")
    vocab_size = tensor_shapes["token_embd.weight"][0]
    declared = metadata.get(f"{arch}.vocab_size")
    if declared is not None and declared != vocab_size:
        keys.refuse("vocab_size", declared, f"token_embd.weight has {vocab_size} rows")
    d = keys.integer("embedding_length")
    n_heads = keys.integer("attention.head_count")
    if arch == "deepseek2":
        return _deepseek(keys, vocab_size, d, n_heads, tensor_shapes)
    config = {
        "model_type": ARCHITECTURES[arch], "vocab_size": vocab_size, "hidden_size": d,
        "num_hidden_layers": keys.integer("block_count"), "num_attention_heads": n_heads,
        "num_key_value_heads": keys.integer("attention.head_count_kv", n_heads),
        "max_position_embeddings": keys.integer("context_length"),
        "rms_norm_eps": keys.number("attention.layer_norm_rms_epsilon"),
        "hidden_act": "silu", "tie_word_embeddings": "output.weight" not in tensor_shapes,
        **_head_dim(keys, d, n_heads), **_rope(keys),
    }
    n_experts = keys.integer("expert_count", 0, minimum=0)
    if n_experts:
        top_k = keys.integer("expert_used_count")
        gating = keys.get("expert_gating_func", 1)  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        if gating != 1:
            keys.refuse("expert_gating_func", gating, "these families route with a softmax (1)")
        norm = keys.get("expert_weights_norm", _NORM_TOPK[arch])
        config |= {"num_experts_per_tok": top_k, "norm_topk_prob": bool(norm)}
    if arch == "llama":
        config["intermediate_size"] = keys.integer("feed_forward_length")
        if n_experts:  # Mixtral: llama attention, every layer MoE, experts feed_forward_length wide
            if not config.pop("norm_topk_prob"):  # Mixtral's router always renormalises
                keys.refuse("expert_weights_norm", False, "Mixtral's router renormalises the top-k weights")
            config |= {"model_type": "mixtral", "num_local_experts": n_experts}
    elif arch == "olmoe":
        config |= {"intermediate_size": keys.integer("feed_forward_length"), "num_experts": _moe(keys, n_experts)}
        clamp = keys.get("attention.clamp_kqv", None)
        if clamp:
            keys.refuse("attention.clamp_kqv", clamp, "clamping q, k and v is not implemented")
    elif arch == "gpt-oss":
        _gpt_oss(keys, config, n_experts, tensor_shapes)
    else:  # qwen3moe, qwen2moe: every layer MoE in llama.cpp
        expert_dim = keys.integer("expert_feed_forward_length")
        config |= {"num_experts": _moe(keys, n_experts), "moe_intermediate_size": expert_dim,
                   "intermediate_size": keys.integer("feed_forward_length", expert_dim)}
        if arch == "qwen2moe":
            config["shared_expert_intermediate_size"] = keys.integer("expert_shared_feed_forward_length", 0, minimum=0)
            config["qkv_bias"] = "blk.0.attn_q.bias" in tensor_shapes
    keys.finish()
    return config


def _gpt_oss(keys: MetadataKeys, config: dict, n_experts: int, tensor_shapes: dict) -> None:
    """GPT-OSS as llama.cpp runs it: sliding-window attention on even layers (its swa pattern 2,
    transformers' default layer_types), the clamped SwiGLU at alpha 1.702 and limit 7.0 (fixed in
    llama.cpp's graph), q/k/v/o biases, sinks, expert biases; YaRN without truncation, as the
    released model's config sets it."""
    top_k = config.pop("num_experts_per_tok")
    config.pop("norm_topk_prob")  # the router's softmax over the top-k logits renormalises by itself
    config |= {"num_local_experts": _moe(keys, n_experts), "num_experts_per_tok": top_k,
               "intermediate_size": keys.integer("expert_feed_forward_length"),
               "sliding_window": keys.integer("attention.sliding_window"),
               "attention_bias": "blk.0.attn_q.bias" in tensor_shapes}
    keys.get("feed_forward_length", None)  # the converter writes intermediate_size twice
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling["truncate"] = False


def _deepseek(keys: MetadataKeys, vocab_size: int, d: int, n_heads: int, tensor_shapes: dict) -> dict:
    """DeepSeek-V2/V3 (llama.cpp's deepseek2). llama.cpp runs MLA as one shared key/value head
    (head_count_kv 1, key_length kv_lora_rank + rope dims); the per-head sizes are the *_mla keys
    (older files: key_length / value_length themselves). V3 is the sigmoid router
    (expert_gating_func 2) with its selection bias `exp_probs_b`; V2 the softmax one. YaRN's
    softmax correction is `rope.scaling.yarn_log_multiplier` = 0.1 x mscale_all_dim, and llama.cpp
    takes mscale = mscale_all_dim (no attention factor on cos/sin)."""
    rope_dim = keys.integer("rope.dimension_count")
    kv_rank = keys.integer("attention.kv_lora_rank")
    key_length, value_length = keys.integer("attention.key_length"), keys.integer("attention.value_length")
    kv_heads = keys.integer("attention.head_count_kv", n_heads)
    if keys.get("attention.key_length_mla", None) is not None:
        if kv_heads != 1 or key_length != kv_rank + rope_dim or value_length != kv_rank:
            keys.refuse("attention.key_length", key_length, "an MLA file stores kv_lora_rank + rope dims with one kv head")
        key_length, value_length = keys.integer("attention.key_length_mla"), keys.integer("attention.value_length_mla")
    elif kv_heads != n_heads:
        keys.refuse("attention.head_count_kv", kv_heads, f"MLA has one key per head: {n_heads}")
    n_layers = keys.integer("block_count")
    gating = keys.get("expert_gating_func", 1)
    if gating not in (1, 2):
        keys.refuse("expert_gating_func", gating, "1 (softmax, DeepSeek-V2) or 2 (sigmoid, DeepSeek-V3)")
    groups, used = keys.integer("expert_group_count", 1), keys.integer("expert_group_used_count", 1)
    rope_fields = _rope(keys)
    theta, rope = rope_fields["rope_theta"], rope_fields.get("rope_scaling")
    log_mul = keys.number("rope.scaling.yarn_log_multiplier", 0.0)
    if rope is not None and rope["rope_type"] == "yarn":
        rope |= {"mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
    elif log_mul:
        keys.refuse("rope.scaling.yarn_log_multiplier", log_mul, "only with yarn RoPE")
    q_rank = keys.get("attention.q_lora_rank", None)
    keys.get("nextn_predict_layers", 0)  # multi-token prediction layers: only for speculative decoding
    config = {
        "model_type": "deepseek_v3" if gating == 2 else "deepseek_v2", "vocab_size": vocab_size, "hidden_size": d,
        "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_heads,
        "max_position_embeddings": keys.integer("context_length"),
        "rms_norm_eps": keys.number("attention.layer_norm_rms_epsilon"), "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_shapes, "rope_theta": theta, "rope_scaling": rope,
        "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_length - rope_dim, "v_head_dim": value_length,
        "first_k_dense_replace": keys.integer("leading_dense_block_count", 0, minimum=0),
        "intermediate_size": keys.integer("feed_forward_length"),
        "moe_intermediate_size": keys.integer("expert_feed_forward_length"),
        "n_routed_experts": _moe(keys, keys.integer("expert_count", 0, minimum=0)),
        "num_experts_per_tok": keys.integer("expert_used_count"),
        "n_shared_experts": keys.integer("expert_shared_count", 0, minimum=0),
        "routed_scaling_factor": keys.number("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(keys.get("expert_weights_norm", False)), "n_group": groups, "topk_group": used,
    }
    if gating == 2:
        config |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    else:
        if groups > 1:  # V2's own code scores a group by its best expert, V3's by its top-2 sum: not guessed
            keys.refuse("expert_group_count", groups, "group-limited routing with a softmax router (DeepSeek-V2) "
                        "is not mapped from GGUF: which group score the file means is not recorded")
        config |= {"topk_method": "greedy", "scoring_func": "softmax"}
    keys.finish()
    return config


def _moe(keys: MetadataKeys, n_experts: int) -> int:
    if not n_experts:
        keys.refuse("expert_count", n_experts, "this architecture is a mixture of experts")
    return n_experts


def _head_dim(keys: MetadataKeys, d: int, n_heads: int) -> dict:
    """head_dim from attention.key_length (= value_length) and rope.dimension_count (full rotary only)."""
    key_length = keys.get("attention.key_length", None)
    value_length = keys.get("attention.value_length", key_length)
    if key_length is not None and value_length != key_length:
        keys.refuse("attention.value_length", value_length, f"differs from attention.key_length {key_length}")
    head_dim = key_length if key_length is not None else d // n_heads
    rotary = keys.get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        keys.refuse("rope.dimension_count", rotary, f"only full rotary (head_dim {head_dim})")
    return {} if key_length is None and d % n_heads == 0 else {"head_dim": head_dim}


def _rope(keys: MetadataKeys) -> dict:
    """rope_theta and the legacy rope_scaling object (none, linear, yarn)."""
    theta = keys.number("rope.freq_base", 10000.0)  # llama.cpp's default when the key is absent
    kind = keys.get("rope.scaling.type", "none")
    factor = keys.get("rope.scaling.factor", None)
    original = keys.get("rope.scaling.original_context_length", None)
    attn_factor = keys.get("rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:
        keys.refuse("rope.scaling.attn_factor", attn_factor, "an explicit attention factor")
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_theta": theta}
    if kind == "linear":
        return {"rope_theta": theta, "rope_scaling": {"rope_type": "linear", "factor": float(factor)}}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(factor if factor is not None else 1.0),
                   "original_max_position_embeddings": original}
        for key, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
            value = keys.get(key, None)
            if value is not None:
                scaling[name] = float(value)
        return {"rope_theta": theta, "rope_scaling": scaling}
    keys.refuse("rope.scaling.type", kind, "supported: 'none', 'linear', 'yarn'")
