"""Reading a Hugging Face config.json field by field, so that nothing is silently dropped.

Every family mapper takes the fields it understands through `ConfigFields`; `finish()` then
refuses any field nobody took, unless it is bookkeeping that cannot change the math
(`BOOKKEEPING`). A field Colibri cannot represent is refused by name and value
(`HFConfigError: config.json: rope_parameters.rope_type='dynamic' is not supported ...`), so a new
architecture knob in some checkpoint fails the import instead of producing a model that
computes something else.

Also here: the pieces every family shares (RoPE, activation, dense/MoE layer pattern) and the
Colibri config dict (colibri-spec's CHECKPOINT.md, schema 1.1) they fill in.
"""

from __future__ import annotations

from pathlib import Path

from ..config import V1_2_DEFAULTS
from ..errors import HFConfigError
from .quantization import FP8ConfigError, parse_quantization_config

__all__ = [
    "BOOKKEEPING", "SCHEMA_1_2_DEFAULTS", "ConfigFields", "colibri_config", "decoder_basics", "fp8_quantization",
    "head_dim", "leading_dense_layers", "no_sliding_window", "qwen_dense_layers", "rope", "silu_activation",
    "yarn_scaling",
]

_MISSING = object()

# Keys of transformers' PretrainedConfig and generation/serving settings: none changes the forward.
BOOKKEEPING = frozenset({
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label",
    "label2id", "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states",
    "problem_type", "return_dict", "transformers_version", "use_cache", "bos_token_id", "eos_token_id",
    "pad_token_id", "unk_token_id", "sep_token_id", "decoder_start_token_id", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "is_decoder", "add_cross_attention", "tie_encoder_decoder",
    "pruned_heads", "torchscript", "tf_legacy_loss", "use_bfloat16", "output_router_logits",
    "router_aux_loss_coef", "attention_dropout", "initializer_range", "max_length", "min_length",
    "do_sample", "temperature", "top_p", "top_k", "num_beams", "repetition_penalty",
})


class ConfigFields:
    """config.json of `directory`, handed out field by field (see the module docstring).

    Every refusal raises `error` (by default the class attribute `error`, `HFConfigError`), so an
    importer can have its own error class raised (colibri-int4: `HFImportError`)."""

    error: type[Exception] = HFConfigError

    def __init__(self, data: dict, where: Path | str, error: type[Exception] | None = None):
        self.data, self.where, self.taken = data, str(where), set()
        if error is not None:
            self.error = error

    def get(self, key: str, default=_MISSING):
        self.taken.add(key)
        if key in self.data and self.data[key] is not None:
            return self.data[key]
        if default is _MISSING:
            raise self.error(f"{self.where}: required field '{key}' is missing")
        return default

    def first(self, keys: tuple[str, ...], default=_MISSING):
        """The first of several names for one field (e.g. num_experts / num_local_experts)."""
        for key in keys:
            self.taken.add(key)
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if default is _MISSING:
            raise self.error(f"{self.where}: required field '{keys[0]}' is missing")
        return default

    def integer(self, key: str, default=_MISSING, minimum: int = 1) -> int:
        value = self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.refuse(key, value, f"expected an integer >= {minimum}")
        return value

    def expect(self, key: str, allowed: tuple, default=_MISSING):
        """The field's value, which must be one of `allowed` (what Colibri can represent)."""
        value = self.get(key, default)
        if value not in allowed:
            self.refuse(key, value, f"supported: {', '.join(repr(a) for a in allowed)}")
        return value

    def refuse(self, key: str, value, why: str):
        raise self.error(f"{self.where}: {key}={value!r} is not supported ({why})")

    def finish(self) -> None:
        # a family that reads a pre-quantized form takes the field and checks it (gpt_oss: mxfp4)
        if self.data.get("quantization_config") is not None and "quantization_config" not in self.taken:
            method = (self.data["quantization_config"] or {}).get("quant_method", "?")
            self.refuse("quantization_config.quant_method", method,
                        "a pre-quantized checkpoint; import the bf16/fp16 original")
        for key, value in self.data.items():
            # "_name_or_path" and friends: transformers' private bookkeeping
            if key not in self.taken and key not in BOOKKEEPING and not key.startswith("_"):
                self.refuse(key, value, "a field import-hf does not know; it may change the math")


def head_dim(fields: ConfigFields, d_model: int, n_heads: int) -> int:
    value = fields.get("head_dim", None)
    if value is None:
        if d_model % n_heads:
            fields.refuse("num_attention_heads", n_heads, f"hidden_size {d_model} is not a multiple of it")
        return d_model // n_heads
    return value


def decoder_basics(fields: ConfigFields) -> tuple[int, int, int, int, float, dict | None]:
    """What every supported family reads alike: (hidden size, layers, query heads, context,
    rope theta, rope scaling), with the SiLU activation checked and a block-scaled FP8 release
    taken (`fp8_quantization`)."""
    fp8_quantization(fields)
    d, n_layers = fields.integer("hidden_size"), fields.integer("num_hidden_layers")
    n_heads = fields.integer("num_attention_heads")
    max_seq_len = fields.integer("max_position_embeddings")
    theta, scaling = rope(fields, max_seq_len)
    silu_activation(fields)
    return d, n_layers, n_heads, max_seq_len, theta, scaling


def fp8_quantization(fields: ConfigFields) -> None:
    """Take a block-scaled FP8 E4M3 release's quantization_config (DeepSeek-V3's own release,
    Qwen3's -FP8 releases: `quant_method` "fp8"; colibri-int4's import dequantizes) and
    refuse its variants by name and value. Another quant_method is left to the family (GPT-OSS
    takes mxfp4) or refused when the fields are finished."""
    quant = fields.data.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method") == "fp8":
        try:
            parse_quantization_config(fields.get("quantization_config"))
        except FP8ConfigError as exc:
            fields.refuse(exc.key, exc.value, exc.why)


def silu_activation(fields: ConfigFields) -> None:
    fields.expect("hidden_act", ("silu",), "silu")


def rope(fields: ConfigFields, max_seq_len: int) -> tuple[float, dict | None]:
    """(rope_theta, Colibri rope_scaling) from transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair. Default, linear, llama3 and yarn RoPE are supported (yarn
    with DeepSeek's mscale keys, as transformers reads them); others (dynamic, longrope) are
    refused by name."""
    params = fields.get("rope_parameters", None)
    legacy = fields.get("rope_scaling", None)
    theta = fields.get("rope_theta", None)
    if params is None:
        params = dict(legacy or {})
        params.setdefault("rope_theta", 10000.0 if theta is None else theta)
        where = "rope_scaling"
    else:
        where = "rope_parameters"
    if not isinstance(params, dict):
        fields.refuse(where, params, "expected an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        fields.refuse(f"{where}.partial_rotary_factor", params["partial_rotary_factor"], "only full rotary")
    known = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = {"kind": "linear", "factor": float(params["factor"]), "low_freq_factor": None,
                   "high_freq_factor": None, "original_max_seq_len": None}  # every key, as colibri-model writes it
        known |= {"factor"}
    elif kind == "llama3":
        scaling = {
            "kind": "llama3", "factor": float(params["factor"]), "low_freq_factor": float(params["low_freq_factor"]),
            "high_freq_factor": float(params["high_freq_factor"]),
            "original_max_seq_len": int(params.get("original_max_position_embeddings", max_seq_len)),
        }
        known |= {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    elif kind == "yarn":
        scaling = yarn_scaling(fields, where, params, max_seq_len)
        known |= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                  "truncate", "attention_factor"}
    else:
        fields.refuse(f"{where}.rope_type", kind, "supported: 'default', 'linear', 'llama3', 'yarn'")
    for key in params:
        if key not in known:
            fields.refuse(f"{where}.{key}", params[key], f"not used by {kind} RoPE here")
    return float(params["rope_theta"]), scaling


def yarn_scaling(fields: ConfigFields, where: str, params: dict, max_seq_len: int) -> dict:
    """Colibri's yarn rope_scaling (every key, as colibri-model writes it), read as transformers
    reads it: the pre-training context is required, factor defaults to max_seq_len / that context,
    beta_fast 32, beta_slow 1, truncate true; no mscale means attention factor 0.1 ln(factor) + 1
    on cos/sin."""
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        fields.refuse(f"{where}.original_max_position_embeddings", original, "yarn needs the pre-training context length")
    if params.get("attention_factor") is not None:
        fields.refuse(f"{where}.attention_factor", params["attention_factor"], "an explicit yarn attention factor")
    factor = params.get("factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    return {
        "kind": "yarn", "factor": float(factor if factor is not None else max_seq_len / original),
        "low_freq_factor": None, "high_freq_factor": None, "original_max_seq_len": original,
        "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": None if mscale is None else float(mscale),
        "mscale_all_dim": None if mscale_all_dim is None else float(mscale_all_dim),
        "truncate": bool(params.get("truncate", True)),
    }


def leading_dense_layers(fields: ConfigFields, n_layers: int, dense: set[int]) -> int:
    """Colibri's dense layers come first: `dense` (the indices of dense layers) must be 0..k-1."""
    k = len(dense)
    if dense != set(range(k)):
        fields.refuse("mlp_only_layers", sorted(dense), "dense layers must be the first ones")
    return k


# Config schema 1.2 fields (DeepSeek's MLA and group-limited routing, GPT-OSS) at the values that
# mean "not used", as written in JSON (a list, not the config's tuple, for sliding_layers).
SCHEMA_1_2_DEFAULTS = {**V1_2_DEFAULTS, "sliding_layers": []}


def colibri_config(**fields) -> dict:
    """A complete Colibri config.json object (CHECKPOINT.md) with the routing defaults of an
    imported softmax router: no selection bias, no balancing. Written at the lowest schema that
    describes it, as colibri-model writes it: 1.2 when a GPT-OSS field or yarn RoPE is used, else 1.1."""
    defaults = dict(
        format_version="1.0", model_type="colibri", schema_version="1.1", qk_norm=False, qk_norm_scope="head",
        qkv_bias=False, rope_scaling=None, n_dense_layers=0, n_experts=0, expert_dim=0, top_k_train=1,
        top_k_infer=1, shared_expert_dim=0, shared_expert_gate=False, router_score="softmax", selection_bias=False,
        route_norm=True, route_scale=1.0, bias_update_gamma=0.0, aux_loss_alpha=0.0, tie_embeddings=False,
        init_std=0.02,
    )
    config = {**defaults, **fields}
    scaling = config["rope_scaling"]
    uses_1_2 = any(config.get(k, v) != v for k, v in SCHEMA_1_2_DEFAULTS.items())
    uses_1_2 |= scaling is not None and scaling["kind"] == "yarn"
    if uses_1_2:
        config = {**config, "schema_version": "1.2", **{k: config.get(k, v) for k, v in SCHEMA_1_2_DEFAULTS.items()}}
    return config


def qwen_dense_layers(fields: ConfigFields, n_layers: int) -> int:
    """Qwen-MoE's layer pattern: layer i is dense if in `mlp_only_layers` or if
    `(i + 1) % decoder_sparse_step != 0`; Colibri needs those to be the leading layers."""
    only_dense = set(fields.get("mlp_only_layers", []))
    step = fields.integer("decoder_sparse_step", 1)
    dense = {i for i in range(n_layers) if i in only_dense or (i + 1) % step}
    if dense != set(range(len(dense))):
        fields.refuse("mlp_only_layers/decoder_sparse_step", (sorted(only_dense), step),
                      "Colibri's dense layers must be the first ones")
    return len(dense)


def no_sliding_window(fields: ConfigFields) -> None:
    """Qwen's `use_sliding_window` (with `sliding_window`, `max_window_layers`, `layer_types`)."""
    if fields.get("use_sliding_window", False):
        fields.refuse("use_sliding_window", True, "sliding-window attention is not implemented")
    fields.get("sliding_window", None)
    fields.get("max_window_layers", None)
    kinds = set(fields.get("layer_types", ["full_attention"]))
    if kinds != {"full_attention"}:
        fields.refuse("layer_types", sorted(kinds), "only full attention")
