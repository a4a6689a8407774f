"""DCP checkpoints: how an FSDP2 run saves and loads without any rank holding the full state.

    RUN/checkpoints/step_00001000/       a checkpoint of a `parallelism="fsdp"` run
        config.json  tokenizer.json      the model config (CHECKPOINT.md), the tokenizer
        training_state.json              TrainingState (TRAINING.md)
        dcp.json                         DcpManifest: version, writer's world size, optimizer metadata
        model/shard-0000R-model-00001-of-00001.safetensors       rank R-1's rows of every weight
        optimizer/shard-0000R-model-00001-of-00001.safetensors   rank R-1's rows of every AdamW moment

The tensor files are written by `torch.distributed.checkpoint.save` through its
`HuggingFaceStorageWriter(save_distributed=True)`: plain safetensors files, one per rank, whose
metadata key `DCP_SHARDING_INFO` gives each tensor's offset in the full tensor; the full shapes
follow from the chunks. Nothing is pickled (DCP's default `.metadata` file is, and its default
tensor files are torch.save streams; both would break "No pickle" and need `torch.load`).
Tensor names are those of model.safetensors and optimizer.safetensors (`{param}::{key}`).

Loading reads, on each rank, only the rows that rank holds (`dcp.load` plans the reads; any
world size may load a checkpoint written by any other: DCP reshards). The same reader takes the
single-file format too (a plain safetensors file is one chunk at offset 0), so an FSDP2 run
resumes a relay payload straight from model.safetensors + optimizer.safetensors, each rank
slicing its rows out of the file, with no conversion and no full copy in any process.

What the relay carries stays the single-file format: `dcp_to_safetensors` assembles it (one
process, the full state in CPU memory: model, then optimizer) at push; `safetensors_to_dcp` is
the inverse (one shard file). Both are exact: a converted checkpoint resumes bit for bit like the
one it came from (tests/test_train_fsdp.py).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from colibri_spec import read_versioned_json
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter, load, save
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor

from ..checkpoint import CONFIG_FILE, TOKENIZER_FILE, CheckpointFormatError, config_to_checkpoint_json
from .checkpointing import (
    CHECKPOINTS_DIR,
    DCP_FILE,
    checkpoint_name,
    fsync_tree,
    is_dcp_checkpoint,
    list_checkpoints,
)
from .distributed import DistributedContext
from .optimizer_io import (
    OPTIMIZER_FILE,
    OptimizerStateError,
    apply_named_state,
    check_optimizer_metadata,
    check_state_shape,
    flat_optimizer_state,
    optimizer_metadata,
)
from .state import TrainingState, write_training_state

DCP_CHECKPOINT_VERSION = "1.0"
MODEL_DIR, OPTIMIZER_DIR = "model", "optimizer"


class DcpManifest(BaseModel):
    """dcp.json: what a reader needs besides the tensor files."""

    model_config = ConfigDict(extra="forbid")
    dcp_checkpoint_version: str = DCP_CHECKPOINT_VERSION
    world_size: int  # ranks that wrote the shards (any world size may read them)
    torch_version: str  # of the writer
    optimizer: dict[str, str]  # the metadata optimizer.safetensors would carry (version, groups)


def read_dcp_manifest(directory: str | os.PathLike) -> DcpManifest:
    return read_versioned_json(Path(directory) / DCP_FILE, DcpManifest, version_key="dcp_checkpoint_version",
                               version=DCP_CHECKPOINT_VERSION, error=CheckpointFormatError, what="manifest",
                               missing="not a DCP checkpoint directory", reader="colibri-model")


def dcp_save(state: dict, directory: Path, *, one_process: bool = False) -> None:
    """`dcp.save` of `state` into `directory`: collective under a process group, unless `one_process`."""
    one_process = one_process or not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # DCP warns on every save without a process group, even when asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        save(state, storage_writer=writer(directory), no_dist=one_process)


def dcp_load(state: dict, tensor_dir: Path, *, one_process: bool = False) -> None:
    """`dcp.load` into `state` (in place) from the safetensors files in `tensor_dir`."""
    one_process = one_process or not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        load(state, storage_reader=HuggingFaceStorageReader(str(tensor_dir)), no_dist=one_process)


def _sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return get_model_state_dict(model) if _sharded(model) else model.state_dict()


def writer(directory: Path) -> HuggingFaceStorageWriter:
    return HuggingFaceStorageWriter(str(directory), save_distributed=True)


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank writes its own rows of the weights and the AdamW state (a collective)."""
    dcp_save(_model_state(model), directory / MODEL_DIR)
    dcp_save(flat_optimizer_state(model, optimizer), directory / OPTIMIZER_DIR)


def stored_tensors(checkpoint: Path, part: str) -> tuple[Path, dict]:
    """(where the tensor files are, {name: TensorStorageMetadata}) of `part` ("model" or
    "optimizer") of a DCP or single-file checkpoint; only complete tensors are accepted."""
    if is_dcp_checkpoint(checkpoint):
        tensor_dir, world = checkpoint / part, read_dcp_manifest(checkpoint).world_size
        files = list(tensor_dir.glob("*.safetensors")) if tensor_dir.is_dir() else []
        if len(files) != world:
            raise CheckpointFormatError(f"{tensor_dir}: {len(files)} shard files, but {DCP_FILE} says {world} ranks "
                                        f"wrote this checkpoint (a shard file is missing or stray)")
    else:
        tensor_dir = checkpoint
    try:
        found = HuggingFaceStorageReader(str(tensor_dir)).read_metadata().state_dict_metadata
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise CheckpointFormatError(f"{tensor_dir}: unreadable tensor files ({exc})") from None
    stored = {k: v for k, v in found.items() if ("::" in k) == (part == OPTIMIZER_DIR)}
    for name, meta in stored.items():  # rows that no file holds would be left unread, silently
        covered = sum(int(torch.Size(c.sizes).numel()) for c in meta.chunks)
        if covered != int(torch.Size(meta.size).numel()):
            raise CheckpointFormatError(f"{tensor_dir}: {name} is incomplete ({covered} of "
                                        f"{torch.Size(meta.size).numel()} elements stored; a shard file is missing)")
    return tensor_dir, stored


def check_shapes(stored: dict[str, tuple], expected: dict[str, tuple], where: Path) -> None:
    """The stored model tensors are exactly the model's: names and full shapes."""
    missing, unexpected = set(expected) - set(stored), set(stored) - set(expected)
    if missing or unexpected:
        detail = ([f"missing {sorted(missing)[:3]}"] if missing else []) + (
            [f"unexpected {sorted(unexpected)[:3]}"] if unexpected else [])
        raise CheckpointFormatError(f"{where}: tensors do not match config.json ({'; '.join(detail)})")
    for name, shape in expected.items():
        if tuple(stored[name]) != tuple(shape):
            raise CheckpointFormatError(f"{where}: {name} has shape {tuple(stored[name])}, "
                                        f"config.json implies {tuple(shape)}")


def _shapes(tensors: dict) -> dict[str, tuple]:
    """Full shapes of tensors (a DTensor reports its global shape) or of stored tensor metadata."""
    return {name: tuple(t.shape) if torch.is_tensor(t) else tuple(t.size) for name, t in tensors.items()}


def load_model_state(model: torch.nn.Module, directory: str | os.PathLike) -> None:
    """Fill `model` (plain or sharded) from a DCP or single-file checkpoint; each rank reads its rows.

    A collective under a process group: every rank calls it.
    """
    tensor_dir, stored = stored_tensors(Path(directory), MODEL_DIR)
    targets = _model_state(model)
    check_shapes(_shapes(stored), _shapes(targets), tensor_dir)
    dcp_load(targets, tensor_dir)
    if _sharded(model):
        set_model_state_dict(model, targets)
    else:
        model.load_state_dict(targets)


def _safetensors_metadata(path: Path) -> dict[str, str]:
    if not path.is_file():
        raise OptimizerStateError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise OptimizerStateError(f"{path}: unreadable safetensors file ({exc})") from None


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         directory: str | os.PathLike) -> None:
    """Fill AdamW's moments and steps (plain or sharded) from a DCP or single-file checkpoint."""
    directory = Path(directory)
    if is_dcp_checkpoint(directory):
        metadata, where = read_dcp_manifest(directory).optimizer, directory / DCP_FILE
    else:
        where = directory / OPTIMIZER_FILE
        metadata = _safetensors_metadata(where)
    check_optimizer_metadata(metadata, where, model, optimizer)
    tensor_dir, stored = stored_tensors(directory, OPTIMIZER_DIR)
    params = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}  # a DTensor reports its global shape
    targets = {}
    for key, meta in stored.items():
        name, entry = key.split("::", 1)
        check_state_shape(tensor_dir, name, entry, tuple(meta.size), shapes)
        dtype = meta.properties.dtype
        # A moment takes its parameter's layout (a DTensor shard under FSDP2); `step` is a scalar.
        targets[key] = torch.zeros(meta.size, dtype=dtype) if entry == "step" else torch.zeros_like(
            params[name], dtype=dtype)
    dcp_load(targets, tensor_dir)
    named: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in targets.items():
        name, entry = key.split("::", 1)
        named.setdefault(name, {})[entry] = tensor
    apply_named_state(named, model, optimizer)


def write_dcp_checkpoint(run_dir: str | os.PathLike, step: int, config, model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer, training_state: Callable[[str], TrainingState],
                         tokenizer_json: str | None, keep: int,
                         ctx: DistributedContext) -> tuple[Path, TrainingState | None]:
    """Write one DCP checkpoint atomically (every rank calls it; rank 0 gets the TrainingState).

    All ranks write their shards into `.tmp-step_N-<id>/` (the id is rank 0's, broadcast), rank
    0 adds the JSON files, flushes everything and renames the directory into place, so a
    `step_*` directory is complete, as in checkpointing.py. Ranks must share the filesystem.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    final = root / checkpoint_name(step)
    if final.exists():  # a second save at the same step (every rank sees it: the last save ended
        return final, None  # with a barrier after the rename)
    checkpoint_id = ctx.shared_uuid()
    state = training_state(checkpoint_id) if ctx.is_main else None
    tmp = root / f".tmp-{final.name}-{checkpoint_id[:8]}"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    ctx.barrier()
    save_sharded(tmp, model, optimizer)
    if ctx.is_main:
        (tmp / CONFIG_FILE).write_text(config_to_checkpoint_json(config))
        if tokenizer_json is not None:
            (tmp / TOKENIZER_FILE).write_text(tokenizer_json)
        manifest = DcpManifest(world_size=ctx.world_size, torch_version=torch.__version__,
                               optimizer=optimizer_metadata(model, optimizer))
        (tmp / DCP_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
        write_training_state(tmp, state)
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_tree(root, files=False)
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    ctx.barrier()
    return final, state
