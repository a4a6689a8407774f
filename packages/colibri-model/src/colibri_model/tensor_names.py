"""The tensors of a checkpoint (CHECKPOINT.md): their names and shapes, and the dtype each is held in.

`checkpoint_tensor_shapes(config)` is colibri-spec's one tensor table, re-exported; colibri-model's
tests hold it equal to the state dict of the model built on the meta device, so the table cannot
drift from the modules that define the tensors. `held_dtype` is the
one rule for the dtype a loaded tensor lives in: `load_checkpoint` applies it, and so does
colibri-stream when it builds the same model from an int4 container, so both hold the same
tensors in the same dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from colibri_spec import checkpoint_tensor_shapes

__all__ = ["checkpoint_tensor_shapes", "held_dtype"]


def held_dtype(shape: Sequence[int], dtype: torch.dtype, name: str | None = None) -> torch.dtype:
    """The dtype a checkpoint tensor of `shape` (named `name`) is held in by a model that runs in
    `dtype`.

    1-D tensors (the RMSNorm weights and `moe.router.expert_bias`) stay fp32: they are a few
    kilobytes, RMSNorm computes in fp32 anyway (so an fp32 weight costs no time and loses no
    bits), and the bias decides top-k ties, which bf16 rounding would change. Linear biases
    (names ending in `.bias`, `qkv_bias`) are the exception: `F.linear` needs them in the
    weight's dtype. Without `name` a bias is counted as fp32, which only over-counts its bytes.
    Everything else is held in `dtype`.
    """
    if name is not None and name.endswith(".bias"):
        return dtype
    return torch.float32 if len(shape) == 1 else dtype
