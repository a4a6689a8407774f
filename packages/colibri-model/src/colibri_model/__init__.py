"""colibri-model: the Colibri fine-grained MoE in torch (config, layers, router, experts)."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version

from .balancing import ExpertBiasBalancer
from .checkpoint import (
    FORMAT_VERSION,
    CheckpointFormatError,
    checkpoint_config_dict,
    load_checkpoint,
    parse_checkpoint_config,
    read_config,
    save_checkpoint,
)
from .config import ColibriConfig, ConfigError, RopeScaling
from .experts import ExpertBackend, ExpertGlu, GroupedExperts
from .layers import KVCache
from .model import CausalLMOutput, ColibriForCausalLM
from .moe import MoELayer
from .param_count import count_params
from .presets import PRESETS, get_preset
from .router import RouterStats
from .tensor_names import checkpoint_tensor_shapes, held_dtype
from .tokenizer import load_tokenizer

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-model")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "FORMAT_VERSION",
    "PRESETS",
    "CausalLMOutput",
    "CheckpointFormatError",
    "ColibriConfig",
    "ColibriForCausalLM",
    "RopeScaling",
    "ConfigError",
    "ExpertBackend",
    "ExpertBiasBalancer",
    "ExpertGlu",
    "GroupedExperts",
    "KVCache",
    "MoELayer",
    "RouterStats",
    "checkpoint_config_dict",
    "checkpoint_tensor_shapes",
    "count_params",
    "get_preset",
    "held_dtype",
    "load_checkpoint",
    "load_tokenizer",
    "parse_checkpoint_config",
    "read_config",
    "save_checkpoint",
]
