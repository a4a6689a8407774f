"""FSDP2 (`fully_shard`) for models whose weights and AdamW state do not fit one device per copy.

With `parallelism="fsdp"` under torchrun, every block and then the root are sharded in place
(parameters become DTensors split across ranks; each block is gathered just for its forward
and backward). DDP keeps a full copy per rank and is the simpler, faster choice while the model
fits (nano's 2.6B parameters + AdamW take ~42 GB in fp32); FSDP2 applies to micro and grande.

Checkpoints stay in the single-file format: the full model and optimizer state are gathered to
rank 0 (collectives every rank must join) and written exactly as a one-process run writes
them, so any world size, sharded or not, can resume them. Loading reads the full files on
every rank before sharding (model) or lets `set_optimizer_state_dict` shard them (optimizer).
"""

from __future__ import annotations

import os

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from .optimizer_io import _names, payload_from_named_state, read_optimizer_file

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: torch.nn.Module) -> None:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole state dict on rank 0 (empty elsewhere). Every rank must call it."""
    return get_model_state_dict(model, options=_FULL)


def full_optimizer_payload(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """optimizer.safetensors content, gathered on rank 0. Every rank must call it."""
    state = get_optimizer_state_dict(model, optimizer, options=_FULL)
    names = _names(model, optimizer)
    return payload_from_named_state(state.get("state", {}), optimizer.param_groups, names)


def load_full_optimizer(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    named = read_optimizer_file(path, model, optimizer)
    names = _names(model, optimizer)
    groups = [{**{k: v for k, v in current.items() if k != "params"}, "params": group_names}
              for current, group_names in zip(optimizer.param_groups, names, strict=True)]
    set_optimizer_state_dict(model, optimizer, {"state": named, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))
