"""colibri-model: the Colibri fine-grained MoE in torch (config, layers, router, experts)."""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _metadata_version
from typing import TYPE_CHECKING

try:  # the installed metadata is the one source of the version (pyproject.toml sets it)
    __version__ = _metadata_version("colibri-model")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

# Public names are imported on first use (PEP 562 module __getattr__), not here: `colibri-model --help`
# and `import colibri_model.config` then cost no torch import (about 2 s on a 2-vCPU box).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "balancing": ("ExpertBiasBalancer",),
    "chat": ("encode_chat", "format_chat", "validate_messages"),
    "checkpoint": (
        "FORMAT_VERSION",
        "CheckpointFormatError",
        "checkpoint_config_dict",
        "load_checkpoint",
        "parse_checkpoint_config",
        "read_config",
        "save_checkpoint",
    ),
    "config": ("ColibriConfig", "ConfigError", "RopeScaling"),
    "errors": ("ColibriModelError",),
    "experts": ("ExpertBackend", "ExpertGlu", "GroupedExperts"),
    "layers": ("Attention", "KVCache", "RMSNorm", "SwiGLU"),
    "model": ("Block", "CausalLMOutput", "ColibriForCausalLM"),
    "moe": ("MoELayer",),
    "param_count": ("count_params",),
    "presets": ("PRESETS", "get_preset"),
    "router": ("Router", "RouterStats"),
    "tensor_names": ("checkpoint_tensor_shapes", "held_dtype"),
    "tokenizer": ("EOS_TOKEN", "IM_END", "load_tokenizer"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

if TYPE_CHECKING:  # the same names, for type checkers and IDEs (tests hold the two lists equal)
    from .balancing import ExpertBiasBalancer
    from .chat import encode_chat, format_chat, validate_messages
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
    from .errors import ColibriModelError
    from .experts import ExpertBackend, ExpertGlu, GroupedExperts
    from .layers import Attention, KVCache, RMSNorm, SwiGLU
    from .model import Block, CausalLMOutput, ColibriForCausalLM
    from .moe import MoELayer
    from .param_count import count_params
    from .presets import PRESETS, get_preset
    from .router import Router, RouterStats
    from .tensor_names import checkpoint_tensor_shapes, held_dtype
    from .tokenizer import EOS_TOKEN, IM_END, load_tokenizer

__all__ = [
    "Attention",
    "Block",
    "EOS_TOKEN",
    "FORMAT_VERSION",
    "IM_END",
    "PRESETS",
    "CausalLMOutput",
    "CheckpointFormatError",
    "ColibriConfig",
    "ColibriForCausalLM",
    "ColibriModelError",
    "RopeScaling",
    "ConfigError",
    "ExpertBackend",
    "ExpertBiasBalancer",
    "ExpertGlu",
    "GroupedExperts",
    "KVCache",
    "MoELayer",
    "RMSNorm",
    "Router",
    "RouterStats",
    "SwiGLU",
    "checkpoint_config_dict",
    "checkpoint_tensor_shapes",
    "count_params",
    "encode_chat",
    "format_chat",
    "get_preset",
    "held_dtype",
    "load_checkpoint",
    "load_tokenizer",
    "parse_checkpoint_config",
    "read_config",
    "save_checkpoint",
    "validate_messages",
]


def __getattr__(name: str) -> object:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later look-ups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
