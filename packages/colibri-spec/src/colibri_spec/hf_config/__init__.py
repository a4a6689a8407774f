"""A Hugging Face config.json -> a Colibri model config, every field mapped or refused by name and
value (HF_CONFIG.md). No weights are needed: a runtime can size a model from config.json alone.

    config_fields.py   config.json field by field (`ConfigFields`), and what every family shares
    families/          one module per family: its model types, `map_config`, its tensor names
    names.py           Colibri tensor names -> the Llama-style HF names (per-expert and fused experts)
    quantization.py    the FP8 `quantization_config` the import reads

Converting the weights (shards, FP8 and MXFP4 decoding, quantization) is colibri-int4's `import-hf`.
"""

from __future__ import annotations

import os

from ..checkpoint_config import parse_checkpoint_config
from ..config import ColibriConfig
from ..errors import CheckpointFormatError, HFConfigError
from .config_fields import ConfigFields
from .families import FAMILIES, family_for
from .names import LlamaStyleNames

__all__ = ["FAMILIES", "ConfigFields", "HFConfigError", "LlamaStyleNames", "colibri_config_from_hf", "family_for",
           "hf_config_dict"]


def hf_config_dict(data: dict, where: str | os.PathLike = "config.json", name: str | None = None, *,
                   error: type[Exception] = HFConfigError) -> dict:
    """The checkpoint config.json object (CHECKPOINT.md, with `format_version` and `model_type`)
    of a Hugging Face config.json object, every field mapped or refused, and validated as a
    `ColibriConfig`. Every refusal is one `error` naming the field and `where`. `name` is the
    config's name (default: the model type).

    >>> hf_config_dict(json.load(open("Qwen3-30B-A3B/config.json")))["n_experts"]  # doctest: +SKIP
    128
    """
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object")
    model_type = data.get("model_type")
    family = family_for(model_type, str(where), error)
    fields = ConfigFields(data, where, error)
    config = family.map_config(fields, name or f"{model_type}")
    fields.finish()
    moe = config["n_dense_layers"] < config["n_layers"]
    if moe and not 1 <= config["top_k_infer"] <= config["n_experts"]:
        raise error(f"{where}: num_experts_per_tok={config['top_k_infer']} is not in [1, {config['n_experts']}]")
    try:
        parse_checkpoint_config(config, str(where))
    except CheckpointFormatError as exc:
        raise error(str(exc)) from None
    return config


def colibri_config_from_hf(data: dict, where: str | os.PathLike = "config.json", name: str | None = None, *,
                           error: type[Exception] = HFConfigError) -> ColibriConfig:
    """The validated `ColibriConfig` of a Hugging Face config.json object (see `hf_config_dict`)."""
    return parse_checkpoint_config(hf_config_dict(data, where, name, error=error), str(where))
