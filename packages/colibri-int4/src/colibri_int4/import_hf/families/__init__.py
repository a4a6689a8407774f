"""The families are colibri-spec's (`colibri_spec.hf_config.families`); these names stay
importable from here, and `family_for` here refuses with colibri-int4's `HFImportError`."""

from __future__ import annotations

from types import ModuleType

from colibri_spec.hf_config import families as _spec
from colibri_spec.hf_config.families import (
    FAMILIES,
    deepseek_v2,
    deepseek_v3,
    gpt_oss,
    llama,
    mixtral,
    olmoe,
    qwen2_moe,
    qwen3_moe,
)

from ...errors import HFImportError

__all__ = ["FAMILIES", "deepseek_v2", "deepseek_v3", "family_for", "gpt_oss", "llama", "mixtral", "olmoe",
           "qwen2_moe", "qwen3_moe"]


def family_for(model_type, where: str) -> ModuleType:
    """The family module of `model_type`; `HFImportError` naming the supported ones otherwise."""
    return _spec.family_for(model_type, where, HFImportError)
