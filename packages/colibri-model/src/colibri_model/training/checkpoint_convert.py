"""Convert a training checkpoint between the DCP layout (FSDP2 runs) and the single-file format.

    dcp_to_safetensors(step_dir, out)   DCP -> config.json, model.safetensors, optimizer.safetensors,
                                        training_state.json, tokenizer.json  (what the relay carries)
    safetensors_to_dcp(step_dir, out)   the inverse (one shard file per part)

Both run in one process without a process group (rank 0 of a torchrun may call them), hold the
full state in CPU memory (the model, then the optimizer: the single file needs all of it), write
`out` aside and rename it into place, and are exact: every tensor keeps its bits, so a converted
checkpoint resumes exactly like the one it came from. Layouts: dcp_checkpoint.py, TRAINING.md.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from colibri_spec import require_major

from ..checkpoint import (
    CONFIG_FILE,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    CheckpointFormatError,
    load_tensors,
    read_config,
    save_checkpoint,
)
from .checkpointing import DCP_FILE, StateView, fsync_tree
from .dcp_checkpoint import (
    MODEL_DIR,
    OPTIMIZER_DIR,
    DcpManifest,
    check_shapes,
    dcp_load,
    dcp_save,
    read_dcp_manifest,
    stored_tensors,
)
from .model_init import meta_model
from .optimizer_io import OPTIMIZER_FILE, OPTIMIZER_STATE_VERSION, OptimizerStateError, write_optimizer
from .state import TRAINING_STATE_FILE, read_training_state


def _read_full(checkpoint: Path, part: str) -> dict[str, torch.Tensor]:
    tensor_dir, stored = stored_tensors(checkpoint, part)
    full = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in stored.items()}
    dcp_load(full, tensor_dir, one_process=True)
    return full


def _model_shapes(config) -> dict[str, tuple]:
    return {name: tuple(t.shape) for name, t in meta_model(config).state_dict().items()}


def _staging(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointFormatError(f"{out}: exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _finish(tmp: Path, out: Path) -> Path:
    fsync_tree(tmp)
    if out.is_dir():
        out.rmdir()  # empty: _staging checked
    os.rename(tmp, out)
    return out


def _copy(source: Path, dest: Path, *names: str) -> None:
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, dest / name)


def dcp_to_safetensors(source: str | os.PathLike, out: str | os.PathLike, *, weights_only: bool = False) -> Path:
    """The single-file checkpoint of DCP checkpoint `source`, written to `out` (new or empty).

    With `weights_only`, only the model checkpoint (config.json, model.safetensors, tokenizer.json).

    Example:
        >>> dcp_to_safetensors("runs/micro/checkpoints/step_00001000", "push/")   # then push push/
    """
    source, out = Path(source), Path(out)
    manifest = read_dcp_manifest(source)
    config = read_config(source)
    if not weights_only:
        read_training_state(source)  # readable, or a clear error before any work
    model_tensors = _read_full(source, MODEL_DIR)
    check_shapes({n: tuple(t.shape) for n, t in model_tensors.items()}, _model_shapes(config), source / MODEL_DIR)
    tmp = _staging(out)
    try:
        tokenizer = (source / TOKENIZER_FILE).read_text() if (source / TOKENIZER_FILE).is_file() else None
        save_checkpoint(StateView(config, model_tensors), tmp, tokenizer_json=tokenizer)
        del model_tensors
        if not weights_only:
            optimizer = _read_full(source, OPTIMIZER_DIR)
            write_optimizer(tmp / OPTIMIZER_FILE, (optimizer, manifest.optimizer))
            del optimizer
            _copy(source, tmp, TRAINING_STATE_FILE)
        return _finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def safetensors_to_dcp(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """The DCP layout of single-file training checkpoint `source`, written to `out` (new or empty).

    Example:
        >>> safetensors_to_dcp("pulled/", "runs/micro/checkpoints/step_00001000")
    """
    source, out = Path(source), Path(out)
    config = read_config(source)
    read_training_state(source)
    weights, optimizer_path = source / WEIGHTS_FILE, source / OPTIMIZER_FILE
    for path in (weights, optimizer_path):
        if not path.is_file():
            raise CheckpointFormatError(f"{path}: missing (not a single-file training checkpoint)")
    tmp = _staging(out)
    try:
        model_tensors, _ = load_tensors(weights)
        check_shapes({n: tuple(t.shape) for n, t in model_tensors.items()}, _model_shapes(config), weights)
        dcp_save(model_tensors, tmp / MODEL_DIR, one_process=True)
        del model_tensors
        optimizer, metadata = load_tensors(optimizer_path)
        require_major(metadata.get("optimizer_state_version"), OPTIMIZER_STATE_VERSION, key="optimizer_state_version",
                      where=str(optimizer_path), reader="colibri-model", error=OptimizerStateError)
        dcp_save(optimizer, tmp / OPTIMIZER_DIR, one_process=True)
        del optimizer
        _copy(source, tmp, CONFIG_FILE, TOKENIZER_FILE, TRAINING_STATE_FILE)
        manifest = DcpManifest(world_size=1, torch_version=torch.__version__, optimizer=metadata)
        (tmp / DCP_FILE).write_text(manifest.model_dump_json(indent=2) + "\n")
        return _finish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
