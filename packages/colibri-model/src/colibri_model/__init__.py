"""colibri-model: the Colibri fine-grained MoE in torch (config, layers, router, experts)."""

from .balancing import ExpertBiasBalancer
from .checkpoint import FORMAT_VERSION, CheckpointFormatError, load_checkpoint, read_config, save_checkpoint
from .config import PRESETS, ColibriConfig, ConfigError, count_params, get_preset
from .experts import ExpertBackend, GroupedExperts
from .layers import KVCache
from .model import CausalLMOutput, ColibriForCausalLM
from .moe import MoELayer
from .router import RouterStats
from .tokenizer import load_tokenizer

__version__ = "0.2.0"

__all__ = [
    "FORMAT_VERSION",
    "PRESETS",
    "CausalLMOutput",
    "CheckpointFormatError",
    "ColibriConfig",
    "ColibriForCausalLM",
    "ConfigError",
    "ExpertBackend",
    "ExpertBiasBalancer",
    "GroupedExperts",
    "KVCache",
    "MoELayer",
    "RouterStats",
    "count_params",
    "get_preset",
    "load_checkpoint",
    "load_tokenizer",
    "read_config",
    "save_checkpoint",
]
