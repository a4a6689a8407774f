"""AdamW construction and its state in safetensors (no pickle, no torch.load).

`optimizer.safetensors` holds one tensor per (parameter, state key), named
`{parameter name}::{key}` (e.g. `layers.1.moe.router.weight::exp_avg`, `...::step`), and in its
metadata `optimizer_state_version` plus the param groups as JSON with parameter NAMES instead of
positions. Naming by parameter makes the file readable and lets a loader check that every
tensor belongs to the model it is loaded into (shape mismatches are an error, not a crash later).

Parameter groups: matrices (2-D and the stacked 3-D experts) get weight decay; norms do not.
The expert bias is a buffer, never seen by the optimizer (the balancer moves it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from colibri_spec import require_major
from safetensors import SafetensorError
from safetensors.torch import save_file

from ..checkpoint import load_tensors
from ..errors import OptimizerStateError
from .config import TrainConfig

OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_STATE_VERSION = "1.0"


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def optimizer_payload(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(tensors, metadata) of the file, from a local (non-sharded) optimizer."""
    names = _names(model, optimizer)
    flat_names = [n for group in names for n in group]
    state = optimizer.state_dict()
    named_state = {flat_names[index]: entries for index, entries in state["state"].items()}
    return payload_from_named_state(named_state, state["param_groups"], names)


def flat_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`{parameter name}::{key}` -> tensor, straight from the optimizer (DTensor moments stay sharded)."""
    by_param = {id(p): n for n, p in model.named_parameters()}
    flat = {}
    for param, entries in optimizer.state.items():
        for key, value in entries.items():
            flat[f"{by_param[id(param)]}::{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return flat


def optimizer_metadata(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """The metadata of optimizer.safetensors: version, optimizer name, param groups by name."""
    return payload_from_named_state({}, optimizer.param_groups, _names(model, optimizer))[1]


def payload_from_named_state(named_state: dict, param_groups: list[dict], names: list[list[str]]) -> tuple[dict, dict]:
    tensors = {}
    for name, entries in named_state.items():
        for key, value in entries.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{name}::{key}"] = tensor.detach().contiguous().cpu()
    groups = []
    for group, group_names in zip(param_groups, names, strict=True):
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": group_names})
    metadata = {"optimizer_state_version": OPTIMIZER_STATE_VERSION, "optimizer": "AdamW",
                "param_groups": json.dumps(groups)}
    return tensors, metadata


def write_optimizer(path: str | os.PathLike, payload: tuple[dict, dict]) -> None:
    tensors, metadata = payload
    save_file(tensors, str(path), metadata=metadata)


def save_optimizer(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    write_optimizer(path, optimizer_payload(model, optimizer))


def check_optimizer_metadata(metadata: dict, where, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The file's metadata (version, parameter groups by name) fits this model and optimizer."""
    require_major(metadata.get("optimizer_state_version"), OPTIMIZER_STATE_VERSION, key="optimizer_state_version",
                  where=str(where), reader="colibri-model", error=OptimizerStateError)
    try:
        saved_groups = json.loads(metadata["param_groups"])
    except (KeyError, TypeError, json.JSONDecodeError):
        raise OptimizerStateError(f"{where}: no readable param_groups in the metadata") from None
    if [g["params"] for g in saved_groups] != _names(model, optimizer):
        raise OptimizerStateError(f"{where}: parameter groups do not match this model's parameters")


def check_state_shape(where, name: str, entry: str, shape: tuple, shapes: dict[str, tuple]) -> None:
    if name not in shapes:
        raise OptimizerStateError(f"{where}: state for unknown parameter {name}")
    if entry != "step" and tuple(shape) != shapes[name]:
        raise OptimizerStateError(f"{where}: {name}::{entry} has shape {tuple(shape)}, the parameter has {shapes[name]}")


def read_optimizer_file(path: str | os.PathLike, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """The file's state per parameter name, checked against the model (names, groups, shapes)."""
    path = Path(path)
    if not path.is_file():
        raise OptimizerStateError(f"{path}: missing")
    try:
        tensors, metadata = load_tensors(path)  # owned, aligned copies (see load_tensors)
    except (SafetensorError, OSError) as exc:
        raise OptimizerStateError(f"{path}: unreadable safetensors file ({exc})") from None
    check_optimizer_metadata(metadata, path, model, optimizer)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # a DTensor reports its global shape
    named: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name, entry = key.split("::", 1)
        check_state_shape(path, name, entry, tuple(tensor.shape), shapes)
        named.setdefault(name, {})[entry] = tensor
    return named


def load_optimizer(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    apply_named_state(read_optimizer_file(path, model, optimizer), model, optimizer)


def apply_named_state(named: dict[str, dict[str, torch.Tensor]], model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> None:
    """Set the optimizer's state from `{parameter name: {key: tensor}}` (plain or DTensor moments)."""
    names = _names(model, optimizer)
    flat_names = [n for group in names for n in group]
    state = {index: named[name] for index, name in enumerate(flat_names) if name in named}
    position = 0
    groups = []
    # Hyper-parameters come from the CURRENT optimizer (this run's config and device, e.g. fused
    # on CUDA); only the moments and step counts come from the file.
    for current, group_names in zip(optimizer.param_groups, names, strict=True):
        options = {k: v for k, v in current.items() if k != "params"}
        groups.append({**options, "params": list(range(position, position + len(group_names)))})
        position += len(group_names)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
