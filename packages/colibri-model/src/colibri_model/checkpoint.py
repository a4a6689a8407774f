"""Model checkpoints: `config.json` + `model.safetensors` (+ optional `tokenizer.json`), the names
callers use. The config side (file names, format version, config.json's reader and writer) is
colibri-spec's (CHECKPOINT.md); the files' tensors are read and written in checkpoint_io.py;
`load_checkpoint` builds the model from them.
"""

from __future__ import annotations

import os

import torch
from colibri_spec import (
    CONFIG_FILE,
    FORMAT_VERSION,
    MODEL_TYPE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointFormatError,
    CheckpointVersionError,
    checkpoint_config_dict,
    config_to_checkpoint_json,
    load_config,
    parse_checkpoint_config,
    read_config,
)

from .checkpoint_io import load_tensors, read_checkpoint, save_checkpoint
from .model import ColibriForCausalLM

__all__ = [
    "CONFIG_FILE", "FORMAT_VERSION", "MODEL_TYPE", "TOKENIZER_FILE", "WEIGHTS_FILE", "CheckpointFormatError",
    "CheckpointVersionError", "checkpoint_config_dict", "config_to_checkpoint_json", "load_checkpoint",
    "load_config", "load_tensors", "parse_checkpoint_config", "read_checkpoint", "read_config", "save_checkpoint",
]


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None) -> ColibriForCausalLM:
    """Build a ColibriForCausalLM from a checkpoint directory (or Hub repo id). With `dtype`,
    tensors are held as `held_dtype` says (1-D tensors fp32, the rest `dtype`); without, as
    stored (`expert_bias` always fp32)."""
    return ColibriForCausalLM.from_pretrained(path, dtype=dtype, device=device)
