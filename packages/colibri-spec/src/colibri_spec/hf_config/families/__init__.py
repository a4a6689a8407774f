"""One module per Hugging Face family: `map_config(fields, name) -> Colibri config dict` and the
tensor names (`NAMES`). `family_for(model_type, where)` picks the module."""

from __future__ import annotations

from types import ModuleType

from ...errors import HFConfigError
from . import deepseek_v2, deepseek_v3, gpt_oss, llama, mixtral, olmoe, qwen2_moe, qwen3_moe

__all__ = ["FAMILIES", "deepseek_v2", "deepseek_v3", "family_for", "gpt_oss", "llama", "mixtral", "olmoe",
           "qwen2_moe", "qwen3_moe"]

_MODULES: tuple[ModuleType, ...] = (qwen3_moe, qwen2_moe, olmoe, mixtral, llama, deepseek_v3, deepseek_v2, gpt_oss)
FAMILIES: dict[str, ModuleType] = {model_type: m for m in _MODULES for model_type in m.MODEL_TYPES}

# What the model types no family maps would need.
_NOT_YET = {
    "qwen3_next": "Gated DeltaNet linear-attention layers",
    "deepseek_v32": "DeepSeek sparse attention (the lightning indexer)",
}


def family_for(model_type, where: str, error: type[Exception] = HFConfigError) -> ModuleType:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    extra = f" ({_NOT_YET[model_type]} are not implemented)" if model_type in _NOT_YET else ""
    raise error(
        f"{where}: model_type={model_type!r} is not supported{extra}; supported: {', '.join(sorted(FAMILIES))}"
    )
