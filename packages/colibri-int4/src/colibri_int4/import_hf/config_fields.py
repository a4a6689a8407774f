"""The HF config mapping is colibri-spec's (`colibri_spec.hf_config`); these names stay importable
from here, and `ConfigFields` here refuses with colibri-int4's `HFImportError`."""

from colibri_spec.hf_config import config_fields as _spec
from colibri_spec.hf_config.config_fields import (
    BOOKKEEPING,
    SCHEMA_1_2_DEFAULTS,
    colibri_config,
    decoder_basics,
    fp8_quantization,
    head_dim,
    leading_dense_layers,
    no_sliding_window,
    qwen_dense_layers,
    rope,
    silu_activation,
    yarn_scaling,
)

from ..errors import HFImportError

__all__ = [
    "BOOKKEEPING", "SCHEMA_1_2_DEFAULTS", "ConfigFields", "colibri_config", "decoder_basics", "fp8_quantization",
    "head_dim", "leading_dense_layers", "no_sliding_window", "qwen_dense_layers", "rope", "silu_activation",
    "yarn_scaling",
]


class ConfigFields(_spec.ConfigFields):
    """colibri-spec's `ConfigFields`, whose refusals are `HFImportError`."""

    error = HFImportError
